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
        self.groups = dict(resumed.get("groups", {})) if resumed else {}  # returns per game or learner
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
            self.groups.setdefault(group, []).append(score)
            self.writer.add_scalar(f"charts/{group}/episodic_return", score, step)

    def first_update(self, step: int) -> None:
        """Marks the end of the first update (once): the steady-state SPS is measured from here."""
        if self.first is None:
            self.first = (time.time(), step)

    def wall(self) -> float:
        """Seconds this run has trained, over all its resumed parts."""
        return self.previous_wall + time.time() - self.start

    def state(self, step: int, args, **script_state) -> dict:
        """A checkpoint: the script's state plus what this log continues from on `--resume` (the step, the last
        100 returns, the last 10 of each group, the wall time) and the run's arguments."""
        groups = {g: r[-10:] for g, r in self.groups.items()}
        common = dict(global_step=step, returns=self.returns[-100:], groups=groups, wall_time_s=self.wall())
        return {**script_state, **common, "args": dataclasses.asdict(args)}

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

    def collecting(self, step: int, ready: int, needed: int, steps_per_unroll: int) -> None:
        """The progress line while the learner waits for a batch (`ready` of `needed` unrolls in): printed every
        `--log-interval` seconds, so that a run whose first update takes minutes (a large network on a CPU) still
        shows progress. Its SPS counts the steps of the unrolls in hand."""
        now = time.time()
        if now - self.last_log < max(self.args.log_interval, 1.0):
            return
        acted = step - self.start_step + ready * steps_per_unroll
        print(
            f"step {step:>10d}/{self.args.total_timesteps} | SPS {acted / max(now - self.start, 1e-9):7.0f} | "
            f"collecting a batch: {ready}/{needed} unrolls of {steps_per_unroll} steps",
            flush=True,
        )
        self.last_log = now

    def evaluate_games(self, model: dict, games, make_eval_policy, device="cpu"):
        """A multi-task model on every game (the first game's first episode filmed with `--capture-video`): the
        per-game table with human-normalised scores, written to the run folder and logged. Returns (mean of the
        games' means, table), (None, None) with no evaluation episodes."""
        if self.args.eval_episodes <= 0:
            return None, None
        from common.evaluation import evaluate, score_table, write_score_table

        films = [self.path if self.args.capture_video else None] + [None] * (len(games) - 1)  # the first game only
        seed, step = self.args.seed + 10_000, model["global_step"]
        table = score_table(
            {
                g: evaluate(
                    lambda n: make_eval_policy(model, n, str(device)),
                    g,
                    self.args.eval_episodes,
                    None,
                    seed,
                    film,
                    True,
                )
                for g, film in zip(games, films)
            }
        )
        print(write_score_table(table, os.path.join(self.path, "evaluation")), flush=True)
        for row in table["games"]:
            self.writer.add_scalar(f"charts/{row['env_id']}/eval_return", row["mean"], step)
        self.writer.add_scalar("charts/eval_median_human_normalized", table["median_human_normalized"], step)
        return float(np.mean([row["mean"] for row in table["games"]])), table

    def evaluate(self, model: dict, make_eval_policy, device="cpu") -> float | None:
        """`--eval-episodes` episodes of the saved model (common/evaluation.py), the first one filmed with
        `--capture-video`: their mean, logged as charts/eval_return; None with no evaluation episodes."""
        if self.args.eval_episodes <= 0:
            return None
        from common.evaluation import evaluate

        video = self.path if self.args.capture_video else None
        scores = evaluate(
            lambda n: make_eval_policy(model, n, str(device)),
            model["env_id"],
            self.args.eval_episodes,
            seed=self.args.seed + 10_000,
            video_dir=video,
        )
        mean = float(np.mean(scores))
        self.writer.add_scalar("charts/eval_return", mean, model["global_step"])
        print(f"evaluation over {len(scores)} episodes: mean {mean:.1f}", flush=True)
        return mean

    def end(self, model: dict, make_eval_policy, end_time: float, device="cpu", games=(), **extra) -> dict:
        """The end of a run: model.pt (with `--save-model`), the evaluation (of every game for a multi-task
        model), summary.json. `end_time`: when training ended."""
        if self.args.save_model:
            import torch

            torch.save(model, os.path.join(self.path, "model.pt"))
        if not games:
            return self.finish(model["global_step"], self.evaluate(model, make_eval_policy, device), end_time, **extra)
        eval_mean, table = self.evaluate_games(model, games, make_eval_policy, device)
        extra.update(multitask_summary(games, self.groups, table))
        return self.finish(model["global_step"], eval_mean, end_time, f"{len(games)}games", **extra)

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


def loss_stats(result) -> dict:
    """The TensorBoard tags of a loss function's named tuple: `losses/<name>` for the parts of the loss,
    `stats/<name>` for the other scalars; the total (`loss`) and the tensors that are not scalars left out."""
    return {
        (f"losses/{k}" if k.endswith("loss") else f"stats/{k}"): v.detach()
        for k, v in result._asdict().items()
        if k != "loss" and v.dim() == 0
    }


def multitask_summary(games, groups: dict, table) -> dict:
    """summary.json's entries for a multi-task run: its games, each game's last-10 mean, the evaluation table."""
    summary = {
        "env_ids": list(games),
        "mean_episodic_return_last_10_per_game": {
            g: float(np.mean(groups[g][-10:])) if groups.get(g) else None for g in games
        },
    }
    if table is not None:
        summary.update(
            eval_median_human_normalized=table["median_human_normalized"],
            eval_mean_human_normalized=table["mean_human_normalized"],
            eval_per_game=table["games"],
        )
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


# The learner processes of the actor/learner scripts (impala_vtrace, vmpo_atari, vmpo_mujoco).


def world_size() -> int:
    """Learner processes of this run (torchrun's WORLD_SIZE; 1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def learner_process(args):
    """(rank, world, device) of this learner process: the process group under torchrun, the seeds (seed + rank),
    cudnn's determinism and torch's threads (`--learner-threads`, or the cores shared among the learners)."""
    import torch

    rank, world, local_rank = int(os.environ.get("RANK", "0")), world_size(), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = args.cuda and torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if world > 1:
        torch.distributed.init_process_group("nccl" if use_cuda else "gloo")
    torch.manual_seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    torch.set_num_threads(args.learner_threads or max(1, (os.cpu_count() or 2) // (2 * world)))
    return rank, world, device


def broadcast_parameters(params, world: int) -> None:
    """The same initial weights in every learner process (rank 0's)."""
    if world > 1:
        import torch

        for p in params:
            torch.distributed.broadcast(p.data, 0)


def average_gradients(params, world: int) -> None:
    """Averages gradients over learner processes (one all-reduce of a flat buffer). The V-MPO scripts use it
    instead of DDP, so that PopArt can rescale its layer between the forward pass and the loss."""
    import torch

    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    torch.distributed.all_reduce(flat)
    flat /= world
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def log_learner_stats(log: RunLog, agent, tasks, stats: dict, layer_norms: dict, logits, obs, step: int) -> None:
    """A discrete learner's diagnostics: its stats, the gradient norm of each layer, whether the policy depends on
    the state yet (logits' spread across states), the torso's dead units, PopArt's statistics per task, and for
    several games the median human-normalised score of their last 10 episodes."""
    import torch

    from common.evaluation import human_normalized_score
    from common.networks import dead_units, logits_std_across_states

    log.scalars(stats, step)
    log.scalars({f"grad_norm/{name}": v for name, v in layer_norms.items()}, step)
    with torch.no_grad():
        log.scalars({"stats/logits_std_across_states": logits_std_across_states(logits[:-1])}, step)
        log.scalars({"stats/dead_units": dead_units(agent.torso(obs[:-1].flatten(0, 1)))}, step)
    if agent.popart is not None:
        for k, task in enumerate(tasks):
            log.scalars(
                {f"stats/popart_sigma/{task}": agent.popart.sigma[k], f"stats/popart_mu/{task}": agent.popart.mu[k]},
                step,
            )
    if len(tasks) > 1:
        hns = [human_normalized_score(g, np.mean(log.groups[g][-10:])) for g in tasks if log.groups.get(g)]
        if len(hns) == len(tasks):
            log.scalars({"charts/median_human_normalized": float(np.median(hns))}, step)


def learner_failed(error: Exception, run_path: str, pool) -> None:
    """A failed actor or a non-finite value in a learner: the error line, the actors stopped, exit 1 (skipping the
    process-group teardown: torchrun stops the other learners)."""
    from common.processes import report_failure

    report_failure(error, run_path)
    if pool is not None:
        pool.close()
    os._exit(1)


def learner_interrupted(pool, interrupt: Interrupt, save, log: RunLog, script: str, world: int) -> None:
    """Ctrl-C or SIGTERM in a learner: the actors stopped; after one signal `save()` (the last completed update's
    checkpoint; None where there is none yet) and how to continue; exit 130."""
    from common.processes import ignore_further_interrupts

    ignore_further_interrupts()
    print("interrupted: stopping actors", file=sys.stderr, flush=True)
    if pool is not None:
        pool.close()
        if interrupt.once and save is not None:
            step = save()
            if log.writer is not None:
                resume_hint(step, log.path, script, world)
    sys.exit(130)
