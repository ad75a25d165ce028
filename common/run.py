"""What every script's `main` does around its training loop, with no equation in it: the command line, resuming,
the run folder (args.json, TensorBoard), the console line, stopping at a consistent state on Ctrl-C, and the end
of a run (evaluation, summary.json).

    args, resumed = resume_args(args)
    log = RunLog(args, FAMILY_DEFAULTS, args.env_id, resumed, "2 workers x 1 env")
    ... log.episode(score, length, step) ... if log.due(): log.console(step, "entropy 1.2")
    log.finish(step, log.evaluate(model, args), num_workers=2)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import time

import numpy as np

from common.checkpoint import load_checkpoint
from common.envs import UsageError
from common.families import with_family_defaults, write_args


def cli(args_class, main, family_table):
    """The command line of every script: tyro's flags for `args_class`, the task family's defaults for the flags
    not given, and bad input as one line `error: ...` with exit status 2."""
    import tyro

    try:
        main(with_family_defaults(tyro.cli(args_class), family_table))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def resume_args(args):
    """With `--resume`: the run's own arguments (from its checkpoint) and the checkpoint, whose state the caller
    loads once its objects exist; without: `(args, None)`."""
    if not args.resume:
        return args, None
    resumed = load_checkpoint(args.resume)
    saved = {k: tuple(v) if isinstance(v, list) else v for k, v in resumed["args"].items()}
    return dataclasses.replace(type(args)(**saved), resume=args.resume), resumed


class RunLog:
    """A run's folder and what is written to it: args.json, TensorBoard curves, the console line, summary.json.

    `resumed` (a checkpoint, or None) gives the step, returns and wall time to continue from; the curves continue
    from its step (what was logged after it is hidden). Only a process with `write=True` (rank 0) writes."""

    def __init__(self, args, family_table, task_name, resumed, describe, write=True):
        self.args = args
        name = f"{task_name}__{args.exp_name}__{args.seed}__{int(time.time())}"
        self.path = args.resume or os.path.join(args.run_dir, name)
        self.returns = list(resumed["returns"]) if resumed else []
        self.start_step = resumed["global_step"] if resumed else 0
        self.previous_wall = resumed["wall_time_s"] if resumed else 0.0
        self.start = self.last_log = time.time()
        self.first = None  # (time, step) once the first update is done: the steady SPS leaves out start-up
        self.writer = None
        if write:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(self.path, exist_ok=True)
            write_args(self.path, args, family_table)
            self.writer = SummaryWriter(self.path, purge_step=self.start_step + 1 if resumed else None)
            print(f"run folder: {self.path}  ({describe})", flush=True)

    def scalars(self, values: dict, step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, float(value), step)

    def episode(self, score, length, step, *groups) -> None:
        """One finished episode: its return counts in return(100); also logged under `charts/<group>/` (a game,
        a learner) for each group given."""
        self.returns.append(score)
        self.writer.add_scalar("charts/episodic_return", score, step)
        self.writer.add_scalar("charts/episodic_length", length, step)
        for group in groups:
            self.writer.add_scalar(f"charts/{group}/episodic_return", score, step)

    def first_update(self, step: int) -> None:
        """Marks the end of the first update (once): the steady-state SPS is measured from here."""
        if self.first is None:
            self.first = (time.time(), step)

    def wall(self) -> float:
        """Seconds this run has trained, over all its resumed parts."""
        return self.previous_wall + time.time() - self.start

    def due(self) -> bool:
        return time.time() - self.last_log >= self.args.log_interval

    def console(self, step: int, extra: str = "") -> float:
        """Logs charts/SPS and prints the progress line; returns the SPS since this process started."""
        now = time.time()
        sps = (step - self.start_step) / max(now - self.start, 1e-9)
        self.writer.add_scalar("charts/SPS", sps, step)
        recent = f"{np.mean(self.returns[-100:]):.1f}" if self.returns else "n/a"
        left = f"{max(self.args.total_timesteps - step, 0) / sps / 60:.1f} min" if sps > 0 else "n/a"
        extra = f" | {extra}" if extra else ""
        print(
            f"step {step:>10d}/{self.args.total_timesteps} | SPS {sps:7.0f} | return(100) {recent:>8} "
            f"| episodes {len(self.returns)}{extra} | ETA {left}",
            flush=True,
        )
        self.last_log = now
        return sps

    def evaluate(self, model: dict, device="cpu") -> float | None:
        """`--eval-episodes` episodes of the saved model (common/evaluation.py), the first one filmed with
        `--capture-video`: their mean, logged as charts/eval_return; None with no evaluation episodes."""
        if self.args.eval_episodes <= 0:
            return None
        from common.evaluation import evaluate

        video = self.path if self.args.capture_video else None
        scores = evaluate(
            model, self.args.eval_episodes, seed=self.args.seed + 10_000, device=str(device), video_dir=video
        )
        mean = float(np.mean(scores))
        self.writer.add_scalar("charts/eval_return", mean, model["global_step"])
        print(f"evaluation over {len(scores)} episodes: mean {mean:.1f}", flush=True)
        return mean

    def finish(self, step: int, eval_mean, end_time: float, env_id=None, **extra) -> dict:
        """Writes summary.json (the steps, wall time, SPS, last-100 mean, evaluation and the script's `extra`) and
        closes the TensorBoard log. `end_time`: when training ended (evaluation left out of the SPS)."""
        sps = (step - self.start_step) / max(end_time - self.start, 1e-9)
        steady = None
        if self.first is not None and end_time > self.first[0] and step > self.first[1]:
            steady = (step - self.first[1]) / (end_time - self.first[0])
        summary = {
            "env_id": env_id or self.args.env_id,
            "total_timesteps": step,
            "wall_time_s": self.previous_wall + end_time - self.start,
            "sps": sps,
            "sps_after_first_update": steady,
            "mean_episodic_return_last_100": float(np.mean(self.returns[-100:])) if self.returns else None,
            "eval_mean_return": eval_mean,
            **extra,
        }
        with open(os.path.join(self.path, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        self.writer.close()
        return summary


def resume_hint(step: int, run_path: str, script: str, world: int = 1) -> None:
    """The line printed on stderr after a stopped run saved its checkpoint: how to continue it."""
    again = f"torchrun --standalone --nproc_per_node {world} {script}" if world > 1 else f"python {script}"
    print(f"checkpoint at step {step}: continue with {again} --resume {run_path}", file=sys.stderr, flush=True)


class Interrupt:
    """Ctrl-C and SIGTERM in a learner's loop: stop at once, dropping the update in progress, except inside
    `with interrupt.commit():` (the few lines that change the training state), which finishes first; a second
    Ctrl-C stops at once wherever it is. `requested` says whether a stop is pending."""

    def __init__(self):
        self.signals, self.committing = [], False
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum, frame):
        self.signals.append(signum)
        if len(self.signals) > 1 or not self.committing:
            raise KeyboardInterrupt

    @property
    def requested(self) -> bool:
        return bool(self.signals)

    @property
    def once(self) -> bool:
        """One signal only: the stop may still save the last completed update."""
        return len(self.signals) <= 1

    @contextlib.contextmanager
    def commit(self):
        self.committing = True
        try:
            yield
        finally:
            self.committing = False
        if self.signals:
            raise KeyboardInterrupt


def serve_workers(procs, msg_q, log: RunLog, steps, checkpoint, script: str) -> None:
    """The main process of the Hogwild scripts: starts the worker processes and serves them until each has sent
    `("done", w)`: their `("episode", w, step, return, length)` and `("stats", w, step, {tag: value})` messages to
    the log, the console line, a checkpoint every `--checkpoint-interval` seconds. `steps` is the shared step
    counter (read without its lock) and `checkpoint()` saves the shared state and returns its step.

    A failed worker or a non-finite value: the error line, the workers stopped, exit 1. Ctrl-C or SIGTERM: the
    workers stopped, a checkpoint and how to continue, exit 130."""
    from common.checkpoint import NonFiniteError
    from common.processes import (
        WorkerError,
        check_workers,
        ignore_further_interrupts,
        interrupt_on_signals,
        raise_worker_error,
        receive,
        report_failure,
        stop_workers,
    )

    interrupt_on_signals()
    done, last_checkpoint = set(), time.time()
    try:
        for p in procs:
            p.start()
        while len(done) < len(procs):
            msg = receive(msg_q)
            if msg is not None and msg[0] == "episode":
                log.episode(msg[3], msg[4], msg[2])
            elif msg is not None and msg[0] == "stats":
                log.scalars(msg[3], msg[2])
            elif msg is not None and msg[0] == "done":
                done.add(msg[1])
            elif msg is not None:
                raise_worker_error(msg)
            check_workers(procs, msg_q)
            if steps.value > 0:
                log.first_update(steps.value)
            if 0 < log.args.checkpoint_interval <= time.time() - last_checkpoint and steps.value > log.start_step:
                checkpoint()
                last_checkpoint = time.time()
            if log.due():
                log.console(steps.value)
    except (WorkerError, NonFiniteError) as e:
        report_failure(e, log.path)
        stop_workers(procs)
        sys.exit(1)
    except KeyboardInterrupt:
        ignore_further_interrupts()
        print("interrupted: stopping workers", file=sys.stderr, flush=True)
        stop_workers(procs)
        if steps.value > log.start_step:
            resume_hint(checkpoint(), log.path, script)
        sys.exit(130)
    for p in procs:
        p.join()
