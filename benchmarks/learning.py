"""Learning curves of the six scripts over seeds: run a preset, then a plot and a Markdown table from the logs.

    python benchmarks/learning.py --preset cpu                     # under an hour on 2 CPU cores (3 seeds)
    python benchmarks/learning.py --preset gpu --parallel 4 --time-limit 500 --seeds 1
    python benchmarks/learning.py --preset cpu --report-only       # redraw from the runs already there
    python benchmarks/learning.py --preset atari-cpu --seeds 1     # Breakout, IMPALA and V-MPO, 1M steps each
    python benchmarks/learning.py --preset a3c-atari-cpu --seeds 1 2  # Breakout, a3c.py's four methods, 1M steps
    python benchmarks/learning.py --preset a3c-mujoco-cpu --seeds 1 2 --parallel 2  # Hopper, HalfCheetah: A3C, 1M
    python benchmarks/learning.py --preset mujoco-cpu              # Hopper, Walker2d, HalfCheetah: P3S, TD3, V-MPO
    python benchmarks/learning.py --preset mujoco-long --seeds 1 2 --parallel 2 --time-limit 9000  # V-MPO, 10M
    python benchmarks/learning.py --preset p3s-cpu --seeds 1 2 --parallel 2   # P3S, TD3, one update per step
    python benchmarks/learning.py --preset p3s-delayed-cpu --seeds 1 --parallel 2 --time-limit 9000  # Table 1
    python benchmarks/learning.py --preset acer-mujoco-cpu --seeds 1 2 --parallel 2  # Hopper, HalfCheetah: ACER, 1M
    python benchmarks/learning.py --preset qbert-cpu --seeds 1 2   # Qbert, A3C and ACER, 1M steps
    python benchmarks/learning.py --preset impala-multi-cpu --seeds 1  # one agent on 3 games (3M), each alone (1M)

Every (script, env, budget, arguments) of the preset is run once per seed, each run in its own folder under
`<out>/runs/`, one after another (`--parallel N`: N at a time). The curve of a run is the mean return of its
last 20 training episodes (`charts/episodic_return` in its TensorBoard log) against environment steps; the
plot shows the mean over seeds and the min-max spread, one panel per (script, env); where a run logs evaluations
as it goes (p3s_td3's `evaluations.jsonl`, every R_eval steps) their mean over seeds is drawn too. The table gives, per
entry: seeds, the steps each run reached, the final 20-episode mean (mean ± std over seeds), the evaluation
return from `summary.json` (deterministic or greedy policy, `--eval-episodes` episodes) and the wall time.

`--time-limit S` stops each run with Ctrl-C S seconds after its first progress line (the scripts finish the update
in progress, write their checkpoint and stop); such a run has no evaluation, and the table says how far it got. This
makes a fixed-time comparison on a machine whose speed is not known in advance. The plot needs matplotlib;
without it the table is still written.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WINDOW = 20  # episodes in the running mean


@dataclasses.dataclass(frozen=True)
class Entry:
    script: str
    env_id: str
    steps: int
    args: tuple[str, ...] = ()
    label: str = ""  # tells apart two entries of one script and env
    games: tuple[str, ...] = ()  # several games, one agent (`--env-ids`): a row and a curve per game

    def views(self):
        """(entry as one row shows it, its TensorBoard tag, its share of the steps, its game): one per game of a
        multi-game run, each game's steps taken as the run's over the games (every game has the same number of envs
        and actors, so the split is close to even but not exact: the actors run asynchronously)."""
        if not self.games:
            return [(self, "charts/episodic_return", 1, None)]
        n = len(self.games)
        label = f"{n} games, steps ≈ all / {n}" + (f", {self.label}" if self.label else "")
        return [
            (
                dataclasses.replace(self, env_id=g, steps=self.steps // n, label=label),
                f"charts/{g}/episodic_return",
                n,
                g,
            )
            for g in self.games
        ]

    @property
    def name(self):
        return f"{self.script}__{self.env_id}" + (f"__{self.label}" if self.label else "")


# Public curves drawn beside a preset's runs (dashed): (label, [(environment steps, return)]), per env id. RLlib's
# IMPALA on Breakout (ray-project/rl-experiments, atari-impala, progress.csv; agent steps of 4 frames, game scores).
# MuJoCo: TD3's evaluation curve as its paper reports it (Fujimoto et al. 2018, v1 tasks, 10 seeds: at 100k, 300k,
# 1M steps), PPO's return at 1M (CleanRL's ppo_continuous_action, v4 tasks) and A2C's (Tianshou's MuJoCo benchmark,
# v3 tasks, mean of 10 seeds); Sample Factory 2.0's APPO at 10M, drawn at its budget (the mean reward of its
# Hugging Face model cards, andrewzhang505/sample-factory-2-mujoco-*). Qbert and BeamRider: RLlib's IMPALA and A2C
# (rl-experiments, one seed each) at 1M and 2M steps.
REFERENCES = {
    "Breakout-v5": [
        ("RLlib IMPALA", [(242_000, 4.1), (473_000, 7.9), (786_000, 14.3), (1_030_000, 19.7), (2_040_000, 49.8)]),
    ],
    "Qbert-v5": [
        ("RLlib IMPALA", [(1_000_000, 455), (2_000_000, 719)]),
        ("RLlib A2C", [(1_000_000, 471), (2_000_000, 894)]),
    ],
    "BeamRider-v5": [
        ("RLlib IMPALA", [(1_000_000, 425), (2_000_000, 572)]),
        ("RLlib A2C", [(1_000_000, 418), (2_000_000, 568)]),
    ],
    "Hopper-v4": [
        ("TD3 paper (eval)", [(100_000, 660), (300_000, 2410), (1_000_000, 3391)]),
        ("CleanRL PPO", [(1_000_000, 2383)]),
        ("Tianshou A2C", [(1_000_000, 1253)]),
        ("Sample Factory APPO", [(10_000_000, 2793)]),
    ],
    "Walker2d-v4": [
        ("TD3 paper (eval)", [(100_000, 770), (300_000, 3336), (1_000_000, 4413)]),
        ("CleanRL PPO", [(1_000_000, 2288)]),
        ("Sample Factory APPO", [(10_000_000, 5488)]),
    ],
    "HalfCheetah-v4": [
        ("TD3 paper (eval)", [(100_000, 5514), (300_000, 7697), (1_000_000, 9567)]),
        ("CleanRL PPO", [(1_000_000, 1443)]),
        ("Tianshou A2C", [(1_000_000, 1830)]),
        ("Sample Factory APPO", [(10_000_000, 6263)]),
    ],
    "Ant-v4": [("Sample Factory APPO", [(10_000_000, 5876)])],
    "Humanoid-v4": [("Sample Factory APPO", [(10_000_000, 5439)])],
    # delayed MuJoCo (`--reward-delay`): P3S-TD3's and TD3's steady state in the P3S paper (Table 1, v1 tasks),
    # at no step in particular (None: a level across the panel)
    **{
        f"Delayed {env}": [("P3S paper, Table 1", [(None, p3s)]), ("its TD3, Table 1", [(None, td3)])]
        for env, p3s, td3 in (
            ("Hopper-v4", 3355.53, 1866.02),
            ("Walker2d-v4", 4058.85, 2016.48),
            ("HalfCheetah-v4", 5754.80, 3684.28),
            ("Ant-v4", 724.50, -7.45),
        )
    },
}


def task_name(entry):
    """The task as REFERENCES and the evaluation panels name it: the env id, "Delayed ..." with delayed rewards."""
    return f"Delayed {entry.env_id}" if "--reward-delay" in entry.args else entry.env_id


PRESETS = {
    # about 15 minutes per seed on 2 CPU cores
    "cpu": [
        Entry("impala_vtrace", "CartPole-v1", 300_000),  # the classic-control family's defaults
        Entry("vmpo_atari", "CartPole-v1", 300_000),
        Entry("a3c", "CartPole-v1", 300_000),
        Entry("acer", "CartPole-v1", 300_000),
        Entry("vmpo_mujoco", "InvertedPendulum-v4", 300_000),  # the MuJoCo family's defaults
        Entry("a3c", "InvertedPendulum-v4", 300_000),
        Entry("acer", "InvertedPendulum-v4", 300_000),
        Entry("p3s_td3", "Pendulum-v1", 20_000),
        Entry("vmpo_mujoco", "Hopper-v4", 400_000),
    ],
    # Atari on 2 CPU cores, 1M steps each, `--env-id` and the budget alone (the Atari family's CPU settings)
    "atari-cpu": [
        Entry("impala_vtrace", "Breakout-v5", 1_000_000, ()),
        Entry("vmpo_atari", "Breakout-v5", 1_000_000, ()),
    ],
    # the papers' own Atari agents on 2 CPU cores, `--env-id`, a budget and the agent's flags alone, beside atari-cpu's
    # shallow ones: IMPALA's deep ResNet (Fig. 3) without and with its LSTM, V-MPO's ResNet + LSTM (App. F) at
    # IMPALA's channels (its own 64, 128, 128 are 4x the compute)
    "atari-deep-cpu": [
        Entry("impala_vtrace", "Breakout-v5", 1_000_000, ("--network", "deep"), label="deep"),
        Entry("impala_vtrace", "Breakout-v5", 500_000, ("--network", "deep", "--use-lstm"), label="deep-lstm"),
        Entry(
            "vmpo_atari",
            "Breakout-v5",
            250_000,
            ("--network", "deep", "--channels", "16", "32", "32", "--use-lstm"),
            label="deep-lstm",
        ),
    ],
    # the A3C paper's Fig. 1 comparison on 2 CPU cores: its four asynchronous methods on Breakout, 1M steps each,
    # `--env-id`, the budget and `--method` alone (the Atari family: 2 workers x 1 env, θ⁻ every 10k steps, ε over 1M)
    "a3c-atari-cpu": [
        Entry("a3c", "Breakout-v5", 1_000_000, ("--method", m), label=m)
        for m in ("a3c", "one-step-q", "one-step-sarsa", "n-step-q")
    ],
    # the four methods on CartPole-v1 to the end of the classic family's 1M steps (2 workers x 8 envs): where a run
    # ends, which the learning tests (stopped at a threshold) do not see (docs/a3c.md: the value-based methods)
    "a3c-cartpole": [
        Entry("a3c", "CartPole-v1", 1_000_000, ("--method", m), label=m)
        for m in ("a3c", "one-step-q", "one-step-sarsa", "n-step-q")
    ],
    # A3C on MuJoCo locomotion (the paper's Supp. 9 domain) on 2 CPU cores, `--env-id` and the budget alone (the
    # MuJoCo family: 2 workers x 4 envs, tanh-bounded mean, learned σ, scaled rewards), against Tianshou's A2C
    "a3c-mujoco-cpu": [Entry("a3c", env, 1_000_000) for env in ("Hopper-v4", "HalfCheetah-v4")],
    # ACER on MuJoCo locomotion (Sec. 6's domain) on 2 CPU cores, `--env-id` and the budget alone (the MuJoCo family:
    # separate policy and value torsos, observation normalisation), beside Tianshou's A2C and CleanRL's PPO
    "acer-mujoco-cpu": [Entry("acer", env, 1_000_000) for env in ("Hopper-v4", "HalfCheetah-v4")],
    # A3C and ACER on Qbert at 1M steps, `--env-id` and the budget alone (the Atari family's settings)
    "qbert-cpu": [Entry("a3c", "Qbert-v5", 1_000_000), Entry("acer", "Qbert-v5", 1_000_000)],
    # IMPALA's many-games headline at CPU scale (Sec. 5.3; PopArt, on with --env-ids): one agent on three games, 3M
    # steps in all (about 1M each; `--env-ids` alone: one actor per game, 11 envs each), beside each game alone at 1M
    "impala-multi-cpu": [
        *[Entry("impala_vtrace", game, 1_000_000) for game in ("Breakout-v5", "Qbert-v5", "BeamRider-v5")],
        Entry("impala_vtrace", "3games", 3_000_000, games=("Breakout-v5", "Qbert-v5", "BeamRider-v5")),
    ],
    # MuJoCo locomotion on 2 CPU cores, `--env-id` and the budget alone: P3S-TD3 (4 learners) and TD3 on Hopper,
    # V-MPO (the MuJoCo family's settings) on three tasks
    "mujoco-cpu": [
        Entry("p3s_td3", "Hopper-v4", 1_000_000),
        Entry("p3s_td3", "Hopper-v4", 300_000, ("--num-learners", "1"), label="td3"),
        Entry("vmpo_mujoco", "Hopper-v4", 1_000_000),
        Entry("vmpo_mujoco", "Walker2d-v4", 1_000_000),
        Entry("vmpo_mujoco", "HalfCheetah-v4", 1_000_000),
    ],
    # V-MPO's asymptote (Sec. 5.2, Figs. 5c-d, 11) on 2 CPU cores, `--env-id` and a budget alone, one run a core
    # (`--parallel 2`, `--time-limit` to fit a session): the preset run again continues each stopped run
    "mujoco-long": [
        Entry("vmpo_mujoco", env, 10_000_000)
        for env in ("Hopper-v4", "Walker2d-v4", "HalfCheetah-v4", "Ant-v4", "Humanoid-v4")
    ],
    "mujoco-50m": [
        Entry("vmpo_mujoco", env, 50_000_000) for env in ("Hopper-v4", "Walker2d-v4", "HalfCheetah-v4", "Ant-v4")
    ],
    # P3S-TD3 as its authors' code trains it, TD3 with its published curve's settings, and P3S with one update per
    # step of each learner (the text's reading of Sec. 4.1)
    "p3s-cpu": [
        Entry("p3s_td3", "Hopper-v4", 1_000_000),
        Entry("p3s_td3", "Hopper-v4", 300_000, ("--num-learners", "1"), label="td3"),
        Entry("p3s_td3", "Hopper-v4", 1_000_000, ("--updates-per-step", "1"), label="1-update"),
        Entry("p3s_td3", "Walker2d-v4", 300_000),
        Entry("p3s_td3", "Walker2d-v4", 300_000, ("--num-learners", "1"), label="td3"),
    ],
    # Sec. 4.2, Table 1: rewards delayed by f_reward = 20, P3S-TD3 beside TD3 with `--env-id`, `--reward-delay 20`
    # and a budget alone; long runs, one a core (`--parallel 2`, `--time-limit` to fit a session, the preset run
    # again continues each stopped run; `--only` takes an entry's name to pick one method)
    "p3s-delayed-cpu": [
        Entry("p3s_td3", env, steps, ("--reward-delay", "20", *flags), label=label)
        for env, steps in (("Walker2d-v4", 1_000_000), ("Ant-v4", 1_000_000), ("Hopper-v4", 500_000))
        for label, flags in (("delayed", ()), ("delayed-td3", ("--num-learners", "1")))
    ],
    # each difference between the authors' code and the text on its own, from the text's reading (Hopper, 100k; the
    # text's PyTorch initialisation against Xavier's, `--init torch`, until df79bc6)
    "p3s-changes": [
        Entry("p3s_td3", "Hopper-v4", 100_000, ("--preset", "paper", *flags), label=label)
        for label, flags in (
            ("text", ()),
            ("updates", ("--updates-per-step", "4")),
            ("start", ("--t-initial", "1000", "--learning-starts", "1000")),
            ("mean", ("--distance", "mean")),
            ("nofirst", ("--no-guide-first-period",)),
        )
    ],
    # the papers' kind of task, at their settings, for a GPU machine with 16 cores (use --time-limit)
    "gpu": [
        Entry("impala_vtrace", "Pong-v5", 20_000_000, ("--num-actors", "2", "--num-envs", "64")),
        Entry("vmpo_atari", "Breakout-v5", 20_000_000, ("--num-actors", "2", "--num-envs", "64")),
        Entry("vmpo_mujoco", "HalfCheetah-v4", 20_000_000, ()),
        Entry("p3s_td3", "Hopper-v4", 1_000_000, ()),
    ],
}


def run_folder(out, entry, seed):
    return os.path.join(out, "runs", f"{entry.name}__s{seed}")


def launch(entry, seed, out, extra):
    """Starts one run; a run of this entry and seed that stopped before its budget (a checkpoint, no summary.json)
    is continued with `--resume` instead, so a long preset goes on across sessions."""
    folder = run_folder(out, entry, seed)
    os.makedirs(folder, exist_ok=True)
    script = os.path.join(ROOT, f"{entry.script}.py")
    stopped = [os.path.dirname(p) for p in glob.glob(os.path.join(folder, "*", "checkpoint.pt"))]
    stopped = sorted(p for p in stopped if not os.path.exists(os.path.join(p, "summary.json")))
    task = ["--env-ids", *entry.games] if entry.games else ["--env-id", entry.env_id]
    fresh = [*task, "--seed", str(seed), "--total-timesteps", str(entry.steps), "--run-dir", folder]
    cmd = [sys.executable, script, *(["--resume", stopped[-1]] if stopped else [*fresh, *entry.args, *extra])]
    log = open(os.path.join(folder, "console.log"), "a")
    print("$ " + " ".join(cmd[1:]), flush=True)
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), log


def run_all(jobs, out, parallel, time_limit, extra):
    """Runs (entry, seed) jobs, `parallel` at a time; a run gets SIGINT `time_limit` seconds after its first progress
    line (its start-up, which a loaded machine stretches, does not count), and SIGKILL two minutes later."""
    pending, running, failed = list(jobs), [], []
    while pending or running:
        while pending and len(running) < parallel:
            entry, seed = pending.pop(0)
            proc, log = launch(entry, seed, out, extra)
            run = SimpleNamespace(entry=entry, seed=seed, proc=proc, log=log, offset=log.tell(), t0=time.time())
            running.append(run)
            run.began, run.stopped = None, False
        time.sleep(1.0)
        for run in [r for r in running if r.proc.poll() is None and time_limit]:
            run.began = run.began or (progressed(run.log.name, run.offset) and time.time())
            if run.began and time.time() - run.began > time_limit and not run.stopped:
                run.proc.send_signal(signal.SIGINT)
                run.stopped = True
            elif run.stopped and time.time() - run.began > time_limit + 120:
                run.proc.kill()
        for run in [r for r in running if r.proc.poll() is not None]:
            running.remove(run)
            run.log.close()
            ok = run.proc.returncode == 0 or (run.stopped and run.proc.returncode == 130)
            print(
                f"{run.entry.name} seed {run.seed}: exit {run.proc.returncode} after {time.time() - run.t0:.0f} s"
                + ("" if ok else f" (see {run_folder(out, run.entry, run.seed)}/console.log)"),
                flush=True,
            )
            if not ok:
                failed.append((run.entry, run.seed))
    return failed


def progressed(path, offset) -> bool:
    """Whether a console log has a progress line (`step N/M | SPS ...`) past `offset`."""
    with open(path) as f:
        f.seek(offset)
        return re.search(r"^step +\d+/\d+ \| SPS", f.read(), re.M) is not None


def episode_returns(run_path, tag="charts/episodic_return"):
    """(steps, returns, minutes) of `tag` in a run folder's TensorBoard log, in step order. Minutes of running: gaps
    of more than two minutes between episodes (a run stopped, then resumed in a later session) do not count."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run_path, size_guidance={"scalars": 0})
    acc.Reload()
    if tag not in acc.Tags()["scalars"]:
        return np.zeros(0), np.zeros(0), np.zeros(0)
    events = sorted(acc.Scalars(tag), key=lambda e: e.step)
    gaps = np.diff([e.wall_time for e in events])
    minutes = np.concatenate([[0.0], np.cumsum(np.where(gaps > 120, 0.0, gaps))]) / 60
    return np.array([e.step for e in events], float), np.array([e.value for e in events], float), minutes


def evaluation_curve(run_path):
    """(steps, returns) of the evaluations a run logged as it went (`evaluations.jsonl`; empty without)."""
    path = os.path.join(run_path, "evaluations.jsonl")
    if not os.path.exists(path):
        return np.zeros(0), np.zeros(0)
    rows = [json.loads(line) for line in open(path) if line.strip()]
    return np.array([r["step"] for r in rows], float), np.array([r["eval_return"] for r in rows], float)


MILESTONES = (100_000, 300_000, 500_000, 1_000_000)  # steps at which the table reads the runs' own evaluations


def evaluation_at(evals, step):
    """A run's last evaluation at or before `step`, if the run got that far (None otherwise)."""
    steps, values = evals
    if len(steps) == 0 or steps[-1] < step:
        return None
    return float(values[np.searchsorted(steps, step, side="right") - 1])


def running_mean(values, window=WINDOW):
    """Mean of the last `window` values at each position (fewer at the start)."""
    c = np.cumsum(np.insert(values, 0, 0.0))
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(idx - window, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def curve_on_grid(steps, returns, grid, window=WINDOW):
    """The running mean as a step function of environment steps, read at `grid` (NaN before the first episode)."""
    if len(steps) == 0:
        return np.full(len(grid), np.nan)
    mean = running_mean(returns, window)
    pos = np.searchsorted(steps, grid, side="right") - 1
    return np.where(pos >= 0, mean[np.maximum(pos, 0)], np.nan)


def state_dependence(run_path, lo=120_000, hi=160_000):
    """Medians of `stats/logits_std_across_states` and `stats/dead_units` over steps (lo, hi] (None where the run logs
    neither): whether an Atari policy has come to depend on the state. With PyTorch's default initialisation
    IMPALA's Breakout agent read about 2e-4 and 0.77 there (state-blind, entropy at ln 4), with the scripts'
    orthogonal one 0.11-0.15 and 0.16-0.25 (docs/impala_vtrace.md)."""
    medians = []
    for tag in ("stats/logits_std_across_states", "stats/dead_units"):
        steps, values, _ = episode_returns(run_path, tag)
        inside = values[(steps > lo) & (steps <= hi)]
        medians.append(float(np.median(inside)) if len(inside) else None)
    return medians


def collect(out, entry, seeds, tag="charts/episodic_return", share=1, game=None):
    """Per seed: the run's folder, its curve and its summary (None when it has no log); with `share` > 1, one game
    of a multi-game run (`game`): its curve over its own steps (the run's / share), its own evaluation."""
    runs = []
    for seed in seeds:
        folders = [os.path.dirname(p) for p in glob.glob(os.path.join(run_folder(out, entry, seed), "*", "events.*"))]
        if not folders:
            continue
        path = sorted(folders)[-1]
        steps, returns, minutes = episode_returns(path, tag)
        summary_file = os.path.join(path, "summary.json")
        summary = json.load(open(summary_file)) if os.path.exists(summary_file) else None
        if summary and game:
            evals = [g["mean"] for g in summary.get("eval_per_game", []) if g["env_id"] == game]
            summary = {**summary, "total_timesteps": summary["total_timesteps"] // share}
            summary["eval_mean_return"] = evals[0] if evals else None
        steps = steps / share
        runs.append(
            dict(
                seed=seed,
                path=path,
                steps=steps,
                returns=returns,
                minutes=minutes,
                summary=summary,
                evals=evaluation_curve(path),
            )
        )
    return runs


def fmt(values):
    values = [v for v in values if v is not None and np.isfinite(v)]
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{np.mean(values):.1f} ± {np.std(values):.1f}"


def report(out, preset, entries, seeds, settings):
    machine, rows, panels, minute_panels = settings["machine"], [], [], []
    for source, (entry, tag, share, game) in [(e, view) for e in entries for view in e.views()]:
        runs = collect(out, source, seeds, tag, share, game)
        if not runs:
            continue
        reached = [
            int(r["summary"]["total_timesteps"]) if r["summary"] else int(r["steps"][-1]) if len(r["steps"]) else 0
            for r in runs
        ]
        final = [float(running_mean(r["returns"])[-1]) if len(r["returns"]) else None for r in runs]
        final100 = [float(np.mean(r["returns"][-100:])) if len(r["returns"]) else None for r in runs]
        evals = [r["summary"].get("eval_mean_return") if r["summary"] else None for r in runs]
        walls = [r["summary"]["wall_time_s"] for r in runs if r["summary"] and "wall_time_s" in r["summary"]]
        rows.append(
            dict(
                script=f"{entry.script} {' '.join(entry.args)}".strip() + (f" ({entry.label})" if game else ""),
                env_id=entry.env_id,
                budget=entry.steps,
                args=list(entry.args),
                seeds=[r["seed"] for r in runs],
                steps_reached=reached,
                final_mean_20=final,
                final_mean_100=final100,
                eval_mean_return=evals,
                wall_time_s=walls,
                evals_at={m: [evaluation_at(r["evals"], m) for r in runs] for m in MILESTONES if m <= entry.steps},
                state_dependence=[state_dependence(r["path"]) for r in runs] if not game else [],
            )
        )
        grid = np.linspace(0, max(reached), 101)[1:]
        curves = np.stack([curve_on_grid(r["steps"], r["returns"], grid) for r in runs])
        evals = [r["evals"] for r in runs if len(r["evals"][0])]
        eval_curve = None
        if evals:  # each run's last evaluation at or before each grid point, averaged over the runs that have one
            eval_curve = np.stack([curve_on_grid(s, v, grid, 1) for s, v in evals])
        panels.append((entry, grid, curves, eval_curve))
        longest = max([r["minutes"][-1] for r in runs if len(r["minutes"])], default=0) or 1
        minutes = np.linspace(0, longest, 101)[1:]
        by_minute = np.stack([curve_on_grid(r["minutes"], r["returns"], minutes) for r in runs])
        minute_panels.append((entry, minutes, by_minute, None))
    if settings["parallel"] is None:
        how = "runs made outside this script (each run's args.json and console.log say how)"
    elif settings["parallel"] > 1:
        how = f"{settings['parallel']} runs at a time"
    else:
        how = "one run at a time"
    if settings["time_limit"]:
        how += f", each stopped after {settings['time_limit']:.0f} s"
    extra = f"; every run also got `{' '.join(settings['extra'])}`" if settings["extra"] else ""
    lines = [
        f"Preset `{preset}` on {machine}, {how}{extra}. Final: mean return of the last {WINDOW} training "
        "episodes; eval: the script's end-of-run evaluation (mean ± std over seeds).",
        "",
        "| script | env | budget | seeds | steps reached | final (last 20) | final (last 100) | eval "
        "| wall time per run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        reached = f"{min(r['steps_reached']):,}" + (
            "" if min(r["steps_reached"]) == max(r["steps_reached"]) else f"–{max(r['steps_reached']):,}"
        )
        wall = f"{np.mean(r['wall_time_s']):.0f} s" if r["wall_time_s"] else "–"
        lines.append(
            f"| {r['script']} | {r['env_id']} | {r['budget']:,} | {len(r['seeds'])} | {reached} | "
            f"{fmt(r['final_mean_20'])} | {fmt(r['final_mean_100'])} | {fmt(r['eval_mean_return'])} "
            f"| {wall} |"
        )
    with_evals = [r for r in rows if any(v is not None for vs in r["evals_at"].values() for v in vs)]
    if with_evals:  # the evaluations the runs logged as they went (p3s_td3's, every R_eval steps)
        milestones = sorted({m for r in with_evals for m in r["evals_at"]})
        lines += ["", "Evaluations as the runs went, at " + " / ".join(f"{m:,}" for m in milestones) + " steps:", ""]
        lines += [
            "| script | env | " + " | ".join(f"{m:,}" for m in milestones) + " |",
            "|---|---|" + "---|" * len(milestones),
        ]
        for r in with_evals:
            cells = [fmt(r["evals_at"].get(m, [])) for m in milestones]
            lines.append(f"| {r['script']} | {r['env_id']} | " + " | ".join(cells) + " |")
    atari = [r for r in rows if any(m[0] is not None for m in r["state_dependence"])]
    if atari:  # the Atari runs' state dependence early on: spread at least 0.004 and fewer than 60% units dead
        lines += ["", "State dependence at 120k-160k steps (medians of the logits' spread across states / dead torso "]
        lines[-1] += "units; a state-blind policy reads about 2e-4 / 0.77):"
        lines += ["", "| script | env | per seed |", "|---|---|---|"]
        for r in atari:
            pairs = zip(r["seeds"], r["state_dependence"])
            cells = [f"{s}: {a:.3f} / {d:.2f}" for s, (a, d) in pairs if None not in (a, d)]
            lines.append(f"| {r['script']} | {r['env_id']} | {', '.join(cells)} |")
    table = "\n".join(lines) + "\n"
    base = os.path.join(out, f"learning_{preset}")
    with open(base + ".md", "w") as f:
        f.write(table)
    with open(base + ".json", "w") as f:
        json.dump({"preset": preset, **settings, "rows": rows}, f, indent=2)
    print(table)
    if panels:
        plot(panels, base + ".png", f"{preset} preset: mean and min-max over seeds, {machine}")
        plot(minute_panels, base + "_minutes.png", f"{preset} preset against minutes of running, {machine}", "minutes")
        if any(p[3] is not None for p in panels):
            plot_evaluations(panels, base + "_eval.png", f"{preset} preset: evaluations, mean over seeds, {machine}")
        plot_population(out, entries, seeds, base + "_beta.png", f"{preset} preset: P3S's population, {machine}")
    return rows


def plot_population(out, entries, seeds, path, title):
    """P3S's β and distances (its Fig. 5a-b) from each population run's `population.jsonl`: the best learner's
    evaluation with β (log scale) above, D_spread and D_change with the search radius max(ρ D_change, d_min) below."""
    runs = [(e, r) for e in entries for r in collect(out, e, seeds) if os.path.exists(f"{r['path']}/population.jsonl")]
    if not runs:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(runs), figsize=(5.0 * len(runs), 6.0), squeeze=False)
    for (entry, run), top, bottom in zip(runs, axes[0], axes[1]):
        rows = [json.loads(line) for line in open(f"{run['path']}/population.jsonl") if line.strip()]
        steps = np.array([r["step"] for r in rows], float)
        top.plot(*run["evals"], lw=1, color="C0", label="evaluation (best learner)")
        top.set_ylabel("evaluation return", fontsize=8)
        right = top.twinx()
        right.semilogy(steps, [r["beta"] for r in rows], lw=0.8, color="C3", label="β")
        right.set_ylabel("β", fontsize=8)
        top.set_title(f"{task_name(entry)}, seed {run['seed']}", fontsize=9)
        for key, color in (("d_spread", "C0"), ("d_change", "C1"), ("d_search", "k")):
            values = np.array([r[key] for r in rows], float)
            bottom.semilogy(steps, values, lw=0.6 if key != "d_search" else 1.0, color=color, label=key)
        bottom.set_xlabel("environment steps (all learners)", fontsize=8)
        for ax in (top, right, bottom):
            ax.tick_params(labelsize=7)
        top.legend(fontsize=7, loc="upper left")
        right.legend(fontsize=7, loc="lower right")
        bottom.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def plot_evaluations(panels, path, title):
    """The evaluation curves of every entry that logs them, overlaid per env id (e.g. P3S against TD3), with the
    public reference points."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    import warnings

    envs = list(dict.fromkeys(task_name(entry) for entry, _, _, e in panels if e is not None))
    fig, axes = plt.subplots(1, len(envs), figsize=(5.5 * len(envs), 3.8), squeeze=False)
    for ax, env_id in zip(axes.flat, envs):
        right = 0.0
        for entry, grid, _, eval_curve in panels:
            if task_name(entry) != env_id or eval_curve is None:
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                mean = np.nanmean(eval_curve, 0)
            label = f"{entry.script} {entry.label or 'defaults'} ({len(eval_curve)} seeds)"
            ax.plot(grid, mean, lw=1.2, label=label)
            right = max(right, grid[-1])
        for j, (label, points) in enumerate(REFERENCES.get(env_id, [])):
            draw_reference(ax, j, label, points, right)
        ax.set_title(env_id, fontsize=9)
        ax.set_xlabel("environment steps (all learners)", fontsize=8)
        ax.set_ylabel("evaluation return (best learner)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def draw_reference(ax, j, label, points, right):
    """A published curve's points up to the panel's last step `right` (a level across it where the step is None);
    True if anything was drawn."""
    style = dict(color="k", ls="--" if j == 0 else ":", lw=1, label=label)
    if points[0][0] is None:
        ax.axhline(points[0][1], **style)
        return True
    ref = [(x, y) for x, y in points if x <= 1.05 * right]
    if ref:
        ax.plot(*zip(*ref), marker="os^"[j % 3], ms=3 + j, **style)
    return bool(ref)


def plot(panels, path, title, x="environment steps"):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed (pip install matplotlib)")
        return
    cols = min(3, len(panels))
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(max(4.2 * cols, 7.0), 3.2 * rows), squeeze=False)
    for ax, (entry, grid, curves, eval_curve) in zip(axes.flat, panels):
        with np.errstate(all="ignore"):
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                mean, lo, hi = np.nanmean(curves, 0), np.nanmin(curves, 0), np.nanmax(curves, 0)
        ax.plot(grid, mean, lw=1.5, label=entry.script)
        ax.fill_between(grid, lo, hi, alpha=0.25)
        if eval_curve is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                ax.plot(grid, np.nanmean(eval_curve, 0), lw=1.2, label=f"{entry.script} evaluation")
            ax.legend(fontsize=7)
        for j, (label, points) in enumerate(REFERENCES.get(task_name(entry), []) if x == "environment steps" else []):
            if draw_reference(ax, j, label, points, grid[-1]):
                ax.legend(fontsize=7)
        what = f"{entry.script} {entry.label}".strip()
        ax.set_title(f"{what}: {entry.env_id} ({len(curves)} seeds)", fontsize=9)
        ax.set_xlabel(x, fontsize=8)
        ax.set_ylabel(f"return (last {WINDOW} episodes)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def machine_line():
    line = f"{platform.machine()}, {os.cpu_count()} cores"
    try:
        import torch

        if torch.cuda.is_available():
            line += f", {torch.cuda.get_device_name(0)}"
        else:
            line += ", no GPU"
    except ImportError:
        pass
    return line


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument(
        "--only", nargs="+", default=[], help="entries whose script, env id, name or one of whose games is one of these"
    )
    p.add_argument("--parallel", type=int, default=1, help="runs at a time")
    p.add_argument(
        "--time-limit", type=float, default=0.0, help="seconds from a run's first progress line to its Ctrl-C (0: none)"
    )
    p.add_argument(
        "--out", default=None, help="folder of the runs and the results (default benchmarks/learning_<preset>)"
    )
    p.add_argument("--report-only", action="store_true", help="only read the runs already in --out")
    p.add_argument("extra", nargs="*", help="more arguments for every run, after --")
    a = p.parse_args()
    if a.parallel < 1:
        p.error("--parallel must be at least 1")
    only = set(a.only)
    entries = [e for e in PRESETS[a.preset] if not only or only & {e.script, e.env_id, e.name, *e.games}]
    if not entries:
        p.error(f"--only {' '.join(a.only)} matches nothing in preset {a.preset}")
    out = a.out or os.path.join(ROOT, "benchmarks", f"learning_{a.preset}")
    machine = machine_line()
    failed = []
    if not a.report_only:
        jobs = [(e, s) for s in a.seeds for e in entries]
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "settings.json"), "w") as f:
            json.dump({"machine": machine, "extra": a.extra, "time_limit": a.time_limit, "parallel": a.parallel}, f)
        failed = run_all(jobs, out, a.parallel, a.time_limit, a.extra)
    settings = {"machine": machine, "extra": a.extra, "time_limit": a.time_limit, "parallel": a.parallel}
    if a.report_only:  # runs made outside this script (no settings.json): their folders tell how they ran, not flags
        settings.update(extra=[], time_limit=0, parallel=None)
    if os.path.exists(os.path.join(out, "settings.json")):
        settings = json.load(open(os.path.join(out, "settings.json")))
    report(out, a.preset, entries, a.seeds, settings)
    if failed:
        sys.exit(f"{len(failed)} run(s) failed: " + ", ".join(f"{e.name} seed {s}" for e, s in failed))


if __name__ == "__main__":
    main()
