"""Evaluation with envpool: N episodes of a policy callable, game scores per episode; for Atari, human-normalised
scores over one game or a list. The scripts call `evaluate_model` at the end of a run; `evaluate.py` (the repository
root) reloads a saved model.pt through its script and calls it.

Episodes are played with the evaluation settings (for Atari: no end-of-life episodes, no reward clipping, up to
30 no-ops, 108,000 frames at most) and scored as the raw reward summed over the whole game.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import json
import math
import os

import numpy as np

from common.envs import EpisodeTracker, UsageError, env_spec, is_atari, make_env, require


def load_run_file(path: str, kind: str, keys: tuple = (), mmap: bool = False) -> dict:
    """`torch.load` of a run's checkpoint.pt, model.pt or population file, or a UsageError in one line when it is
    truncated, not a torch file, or not one of this project's (`keys` missing)."""
    import torch

    if not os.path.isfile(path):
        raise UsageError(f"no such file: {path}")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as e:  # truncated: RuntimeError or EOFError; another format: UnpicklingError, ...
        raise UsageError(
            f"{path} cannot be read as a {kind} ({type(e).__name__}): it is damaged (a run killed while writing "
            "it leaves the previous file in place, so a copy or a disk problem did this) or not a torch file"
        ) from None
    if not isinstance(obj, dict) or any(k not in obj for k in keys):
        raise UsageError(f"{path} is not a {kind} of this project's scripts (no {', '.join(keys) or 'dict'})")
    return obj


def resume_checkpoint(folder: str, script: str, cls):
    """`--resume folder`: the run's arguments (an instance of the script's `cls`) and its checkpoint, or a
    UsageError: no checkpoint there, a damaged one, or a run of another script."""
    path = os.path.join(folder, "checkpoint.pt")
    if not os.path.isfile(path):
        raise UsageError(f"--resume {folder}: no checkpoint.pt there (is it a run folder of a run that saved one?)")
    resumed = load_run_file(path, "checkpoint", ("args", "global_step"))
    other = resumed.get("script", script)
    unknown = sorted(set(resumed["args"]) - {f.name for f in dataclasses.fields(cls)})
    if other != script or unknown:
        hint = f"continue it with python {other} --resume {folder}" if other != script else f"its arguments {unknown}"
        raise UsageError(
            f"--resume {folder}: a run of {'another script' if other == script else other}, not of {script}: {hint}"
        )
    saved = {k: tuple(v) if isinstance(v, list) else v for k, v in resumed["args"].items()}
    return dataclasses.replace(cls(**saved), resume=folder), resumed


# Atari-57 reference scores (random, human): the table of Mnih et al. (2015) and Badia et al. (2020, Agent57), as
# used across the literature (e.g. DQN Zoo, Quan and Ostrovski 2020), each the mean game score with up to 30
# no-op starts and at most 108,000 frames an episode. Keys are envpool's game names (`<Game>-v5`).
# fmt: off
ATARI_SCORES = {
    "Alien": (227.8, 7127.7),            "Amidar": (5.8, 1719.5),             "Assault": (222.4, 742.0),
    "Asterix": (210.0, 8503.3),          "Asteroids": (719.1, 47388.7),       "Atlantis": (12850.0, 29028.1),
    "BankHeist": (14.2, 753.1),          "BattleZone": (2360.0, 37187.5),     "BeamRider": (363.9, 16926.5),
    "Berzerk": (123.7, 2630.4),          "Bowling": (23.1, 160.7),            "Boxing": (0.1, 12.1),
    "Breakout": (1.7, 30.5),             "Centipede": (2090.9, 12017.0),      "ChopperCommand": (811.0, 7387.8),
    "CrazyClimber": (10780.5, 35829.4),  "Defender": (2874.5, 18688.9),       "DemonAttack": (152.1, 1971.0),
    "DoubleDunk": (-18.6, -16.4),        "Enduro": (0.0, 860.5),              "FishingDerby": (-91.7, -38.7),
    "Freeway": (0.0, 29.6),              "Frostbite": (65.2, 4334.7),         "Gopher": (257.6, 2412.5),
    "Gravitar": (173.0, 3351.4),         "Hero": (1027.0, 30826.4),           "IceHockey": (-11.2, 0.9),
    "Jamesbond": (29.0, 302.8),          "Kangaroo": (52.0, 3035.0),          "Krull": (1598.0, 2665.5),
    "KungFuMaster": (258.5, 22736.3),    "MontezumaRevenge": (0.0, 4753.3),   "MsPacman": (307.3, 6951.6),
    "NameThisGame": (2292.3, 8049.0),    "Phoenix": (761.4, 7242.6),          "Pitfall": (-229.4, 6463.7),
    "Pong": (-20.7, 14.6),               "PrivateEye": (24.9, 69571.3),       "Qbert": (163.9, 13455.0),
    "Riverraid": (1338.5, 17118.0),      "RoadRunner": (11.5, 7845.0),        "Robotank": (2.2, 11.9),
    "Seaquest": (68.4, 42054.7),         "Skiing": (-17098.1, -4336.9),       "Solaris": (1236.3, 12326.7),
    "SpaceInvaders": (148.0, 1668.7),    "StarGunner": (664.0, 10250.0),      "Surround": (-10.0, 6.5),
    "Tennis": (-23.8, -8.3),             "TimePilot": (3568.0, 5229.2),       "Tutankham": (11.4, 167.6),
    "UpNDown": (533.4, 11693.2),         "Venture": (0.0, 1187.5),            "VideoPinball": (16256.9, 17667.9),
    "WizardOfWor": (563.5, 4756.5),      "YarsRevenge": (3092.9, 54576.9),    "Zaxxon": (32.5, 9173.3),
}
# fmt: on

# Named sets of games for `--env-ids`: all 57, and Atari-5 (Aitchison, Sweetser, Hutter 2023), five games whose
# scores predict the median over the 57.
PRESETS = {
    "atari57": tuple(f"{g}-v5" for g in sorted(ATARI_SCORES)),
    "atari5": ("BattleZone-v5", "DoubleDunk-v5", "NameThisGame-v5", "Phoenix-v5", "Qbert-v5"),
}


def expand_env_ids(env_ids) -> list[str]:
    """Env ids with the presets (`atari57`, `atari5`) replaced by their games, in order, without repeats."""
    out = []
    for e in env_ids:
        for g in PRESETS.get(e.lower(), (e,)):
            if g not in out:
                out.append(g)
    return out


def atari_games(env_ids, env_id) -> list[str]:
    """`--env-ids` expanded: Atari games that envpool knows, `env_id` one too, or a UsageError (one line)."""
    games = expand_env_ids(env_ids)
    for game in games:
        env_spec(game, discrete=True)  # a line naming an unknown one
        require(is_atari(game), f"--env-ids takes Atari games (Pong-v5 Breakout-v5, or atari57, atari5), not {game}")
    require(not games or is_atari(env_id), "--env-ids: an --env-id, if given, must be an Atari game too")
    return games


def human_normalized_score(env_id: str, score: float) -> float:
    """100 · (score − random) / (human − random) for an Atari game (`Breakout-v5` or `Breakout`); NaN for a game
    without reference scores."""
    random, human = ATARI_SCORES.get(env_id.split("-")[0], (math.nan, math.nan))
    return 100.0 * (score - random) / (human - random)


def median_human_normalized(returns: dict, games) -> dict:
    """`charts/median_human_normalized` of several games' last 10 training returns each (`returns`: by game), once
    every game has some; else nothing."""
    scores = [human_normalized_score(g, np.mean(returns[g][-10:])) for g in games if returns.get(g)]
    return {"charts/median_human_normalized": float(np.median(scores))} if 1 < len(scores) == len(games) else {}


def score_table(scores_by_env: dict) -> dict:
    """Per game: episodes, mean score, its standard deviation and the human-normalised score; over the games that
    have reference scores: the median and the mean human-normalised score."""
    rows = []
    for env_id, scores in scores_by_env.items():
        mean, std = float(np.mean(scores)), float(np.std(scores))
        row = dict(env_id=env_id, episodes=len(scores), mean=mean, std=std)
        rows.append(dict(row, human_normalized=human_normalized_score(env_id, mean)))
    hns = [r["human_normalized"] for r in rows if not math.isnan(r["human_normalized"])]
    return {
        "games": rows,
        "median_human_normalized": float(np.median(hns)) if hns else None,
        "mean_human_normalized": float(np.mean(hns)) if hns else None,
    }


def write_score_table(table: dict, prefix: str) -> str:
    """Writes `prefix.json` and `prefix.csv` and returns the table as Markdown."""
    with open(prefix + ".json", "w") as f:
        json.dump(table, f, indent=2)
    with open(prefix + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["env_id", "episodes", "mean", "std", "human_normalized"])
        w.writeheader()
        w.writerows(table["games"])
    lines = ["| game | episodes | mean score | std | human-normalised % |", "|---|---|---|---|---|"]
    lines += [
        f"| {r['env_id']} | {r['episodes']} | {r['mean']:.1f} | {r['std']:.1f} | {r['human_normalized']:.1f} |"
        for r in table["games"]
    ]
    if table["median_human_normalized"] is not None:
        lines.append(
            f"| median / mean | | | | {table['median_human_normalized']:.1f} / {table['mean_human_normalized']:.1f} |"
        )
    return "\n".join(lines)


def evaluate(make_policy, env_id: str, episodes: int = 10, num_envs: int | None = None, seed: int = 0,
             video_dir: str | None = None, full_action_space: bool = False) -> list[float]:  # fmt: skip
    """Plays `episodes` episodes of `env_id` with `make_policy(num_envs)`, a callable `policy(obs, rewards, first)
    -> actions`, and returns their game scores. Each env plays a fixed quota of episodes, so short episodes are not
    favoured. With `video_dir`, env 0's first episode is written there."""
    num_envs = num_envs or min(episodes, 8)
    quota = np.full(num_envs, episodes // num_envs) + (np.arange(num_envs) < episodes % num_envs)
    render = video_dir is not None
    env = make_env(env_id, num_envs, seed, training=False, render=render, full_action_space=full_action_space)
    policy = make_policy(num_envs)
    tracker = EpisodeTracker(num_envs)
    obs, info = env.reset()
    ids = info["env_id"]
    rewards, first, ended = np.zeros(num_envs, np.float32), np.ones(num_envs, bool), np.zeros(num_envs, bool)
    scores = [[] for _ in range(num_envs)]
    frames, recording = [], video_dir is not None
    while any(len(s) < q for s, q in zip(scores, quota)):
        if recording:
            frames.append(env.render()[0])
        actions = policy(obs, rewards, first)
        obs, rewards, term, trunc, info = env.step(actions, ids)
        ids = info["env_id"]
        for e, score, _ in tracker.step(ids, rewards, term, trunc, info):
            if len(scores[e]) < quota[e]:
                scores[e].append(score)
            if e == 0 and recording:
                recording = False
                write_apng(os.path.join(video_dir, "videos", "eval_episode_0.png"), frames)
        first, ended = ended, term | trunc  # the obs after an episode's last one starts the next episode
    return [s for per_env in scores for s in per_env]


def evaluate_games(make_policy, games, episodes: int, seed: int, prefix: str, video_dir=None, num_envs=None):
    """A multi-task policy (all 18 Atari actions) on each game of `games` for `episodes` episodes (the first game's
    first episode filmed into `video_dir`); the per-game table printed and written to `prefix`.json/.csv. Returns
    the scores by game and the table."""
    film = [video_dir] + [None] * (len(games) - 1)
    scores = {g: evaluate(make_policy, g, episodes, num_envs, seed, v, True) for g, v in zip(games, film)}
    table = score_table(scores)
    print(write_score_table(table, prefix), flush=True)
    return scores, table


def evaluate_model(log, model, make_eval_policy, device="cpu"):
    """The end of a run: `--eval-episodes` episodes of the saved `model`, played by the script's `make_eval_policy`
    (the first filmed with `--capture-video`), logged to `log` (the script's RunLog): their mean, or None."""
    n, film = log.args.eval_episodes, log.path if log.args.capture_video else None
    if n == 0:
        return None
    policy = functools.partial(make_eval_policy, model, device=str(device))
    mean = float(np.mean(evaluate(policy, log.args.env_id, n, None, log.args.seed + 10_000, film)))
    print(f"evaluation over {n} episodes: mean {mean:.1f}", flush=True)
    log.scalars({"charts/eval_return": mean}, model["global_step"])
    return mean


def evaluate_games_model(log, model, make_eval_policy, device="cpu") -> tuple:
    """`evaluate_model`, and for several games (`--env-ids`) each game's episodes with a table (`evaluation/`): (the
    mean return, summary.json's extra entries)."""
    n, games, step = log.args.eval_episodes, log.args.env_ids, model["global_step"]
    if n == 0 or not games:
        return evaluate_model(log, model, make_eval_policy, device), {}
    policy = functools.partial(make_eval_policy, model, device=str(device))
    film = log.path if log.args.capture_video else None
    _, table = evaluate_games(policy, games, n, log.args.seed + 10_000, os.path.join(log.path, "evaluation"), film)
    log.scalars({f"charts/{r['env_id']}/eval_return": r["mean"] for r in table["games"]}, step)
    log.scalars({"charts/eval_median_human_normalized": table["median_human_normalized"]}, step)
    extra = {f"eval_{k}": table[k] for k in ("median_human_normalized", "mean_human_normalized")}
    last10 = {g: float(np.mean(log.groups[g][-10:])) if log.groups.get(g) else None for g in games}
    extra.update(eval_per_game=table["games"], env_ids=list(games), mean_episodic_return_last_10_per_game=last10)
    return float(np.mean([r["mean"] for r in table["games"]])), extra


def write_apng(path: str, frames: list, fps: int = 30) -> None:
    """Writes RGB frames `[H, W, 3]` uint8 as an animated PNG (plays in any web browser; no codec needed)."""
    from PIL import Image  # Pillow: envpool's own dependency

    os.makedirs(os.path.dirname(path), exist_ok=True)
    images = [Image.fromarray(np.ascontiguousarray(f)) for f in frames]
    images[0].save(path, save_all=True, append_images=images[1:], duration=1000 / fps, loop=0)


def recurrent_policy(agent, num_envs, device="cpu", greedy=False, reward_clip=False):
    """`policy(obs, rewards, first) -> actions` for a discrete-action `agent` that takes the previous action and
    reward and may carry an LSTM state (impala_vtrace, vmpo_atari): it keeps that state and the previous action
    itself; rewards are clipped to [-1, 1] as in training where `reward_clip`. Samples from the softmax over the
    logits, or takes their argmax with `greedy`."""
    import torch

    agent.eval()
    state = agent.initial_state(num_envs, device)
    prev_action = torch.zeros(num_envs, dtype=torch.long, device=device)

    @torch.no_grad()
    def policy(obs, rewards, first):
        nonlocal state, prev_action
        first_t = torch.as_tensor(first, device=device).bool()
        r = torch.as_tensor(rewards, device=device).float()
        r = r.clamp(-1, 1) if reward_clip else r
        prev = torch.where(first_t, 0, prev_action)
        logits, _, state = agent(torch.as_tensor(obs, device=device)[None], prev[None], r[None], first_t[None], state)
        prev_action = logits[0].argmax(-1) if greedy else torch.distributions.Categorical(logits=logits[0]).sample()
        return prev_action.cpu().numpy()

    return policy
