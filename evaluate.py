"""Plays a saved model.pt of any script of this project: the model names its script, whose `make_eval_policy`
rebuilds the policy; `common/evaluation.py` plays it.

    python evaluate.py runs/<run>/model.pt --episodes 10 [--capture-video] [--greedy]
    python evaluate.py runs/<run>/model.pt --env-ids atari57 --episodes 30   # a multi-task model, per game
"""

import argparse
import importlib
import json
import os
import sys

import numpy as np

from common.envs import UsageError, check_render, env_spec
from common.evaluation import evaluate, evaluate_games, expand_env_ids, load_run_file


def main(argv=None):
    p = argparse.ArgumentParser(description="Evaluate a saved model.pt of any script of this project.")
    p.add_argument("model", help="path to a run's model.pt")
    p.add_argument("--episodes", type=int, default=10)
    p.add_argument("--num-envs", type=int, default=None)
    p.add_argument("--seed", type=int, default=12345)
    p.add_argument("--greedy", action="store_true", help="take the most probable (or the mean) action")
    p.add_argument("--capture-video", action="store_true", help="write the first episode under <run>/videos/")
    p.add_argument("--cuda", action="store_true")
    p.add_argument(
        "--env-ids", nargs="+", default=None, help="games (or presets: atari57, atari5) for a per-game table"
    )
    p.add_argument("--out", default=None, help="--env-ids: path prefix of the .json/.csv table (<run>/evaluation)")
    a = p.parse_args(argv)
    if a.episodes < 1:
        raise UsageError(f"--episodes must be at least 1, got {a.episodes}")
    import torch

    model = load_run_file(a.model, "model.pt")
    if "returns" in model and "wall_time_s" in model:  # RunLog.state's
        raise UsageError(f"{a.model} is a checkpoint; evaluate.py plays the model.pt beside it")
    if "script" not in model or "env_id" not in model:
        raise UsageError(f"{a.model} is not a model.pt of this project's scripts (no script, env_id)")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        script = importlib.import_module(model["script"])
    except ImportError:
        raise UsageError(f"{a.model} is a model of {model['script']}.py, which is not beside evaluate.py") from None
    if not hasattr(script, "make_eval_policy"):
        raise UsageError(f"{a.model} names {model['script']}, which is not a script of this project")
    if a.env_ids and not model.get("full_action_space"):
        raise UsageError(f"--env-ids plays a multi-task model (all 18 actions); {a.model} knows {model['env_id']} only")
    env_ids = expand_env_ids(a.env_ids or [])
    for e in env_ids:
        env_spec(e)
    if a.capture_video:
        check_render(model["env_id"])
    device = "cuda" if a.cuda and torch.cuda.is_available() else "cpu"
    run = os.path.dirname(os.path.abspath(a.model))
    film = run if a.capture_video else None

    def policy(num_envs):
        return script.make_eval_policy(model, num_envs, device, a.greedy)

    if env_ids:  # a table of the games (the first game's first episode filmed)
        out = a.out or os.path.join(run, "evaluation")
        scores, table = evaluate_games(policy, env_ids, a.episodes, a.seed, out, film, a.num_envs)
        print(json.dumps({k: table[k] for k in ("median_human_normalized", "mean_human_normalized")}))
        return scores
    full_action_space = model.get("full_action_space", False)
    scores = evaluate(policy, model["env_id"], a.episodes, a.num_envs, a.seed, film, full_action_space)
    summary = dict(env_id=model["env_id"], episodes=len(scores), mean=float(np.mean(scores)), std=float(np.std(scores)))
    print(json.dumps({**summary, "scores": scores}))
    return scores


if __name__ == "__main__":
    try:
        main()
    except UsageError as e:  # bad input: one line, exit status 2, as the scripts
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
