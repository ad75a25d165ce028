"""Process plumbing shared by the scripts: the guarded entry of a worker process, the check for dead workers,
stopping them, and what Ctrl-C does in the main process. No equation lives here.

A worker reports on a queue of tuples; `("error", name, traceback)` is the one every script shares."""

from __future__ import annotations

import os
import queue
import signal
import sys
import time
import traceback

import torch

from common.checkpoint import NonFiniteError, non_finite_advice


class WorkerError(RuntimeError):
    """A worker process failed: the message holds its traceback, or its exit code when no traceback came."""


class ParentGone(Exception):
    """The main process has died (a SIGKILLed process cannot stop its workers): the worker exits by itself."""


def exit_if_orphaned(parent_pid: int) -> None:
    """Raise ParentGone once the main process that started this worker is gone."""
    if os.getppid() != parent_pid:
        raise ParentGone


def worker_entry(target, name, msg_q, *args):
    """Entry point of a worker process: Ctrl-C is the main process's to handle, one torch thread, and a failure
    puts `("error", name, traceback)` on `msg_q` before exit code 1. `target(*args)` is the script's own loop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        torch.set_num_threads(1)
        target(*args)
    except ParentGone:
        msg_q.cancel_join_thread()  # nobody reads the queue any more: do not wait to flush it at exit
    except Exception:
        msg_q.put(("error", name, traceback.format_exc()))
        sys.exit(1)


def check_workers(procs, msg_q, what="worker", must_live=False, grace=2.0):
    """Raise WorkerError if a process has ended with a non-zero exit code (with `must_live`, if it has ended at
    all: actors never end by themselves). A dying worker's traceback may reach the queue after its exit: wait up
    to `grace` seconds for it. Other messages read while waiting are dropped: the run is failing."""
    for i, p in enumerate(procs):
        if p.is_alive() or (p.exitcode == 0 and not must_live):
            continue
        deadline = time.time() + grace
        while time.time() < deadline:
            try:
                msg = msg_q.get(timeout=0.2)
            except queue.Empty:
                continue
            if msg[0] == "error":
                raise_worker_error(msg, what)
        raise WorkerError(f"{what} {i} died with exit code {p.exitcode}")


def raise_worker_error(msg, what="worker"):
    """Raise the WorkerError of an `("error", name, traceback)` message."""
    raise WorkerError(f"{what} {msg[1]} failed:\n{msg[2]}")


def stop_workers(procs) -> None:
    """Terminate, then kill what is still alive after 5 s."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def interrupt_on_signals(handler=None) -> None:
    """SIGINT (Ctrl-C) and SIGTERM raise KeyboardInterrupt in the main process, or call `handler(signum, frame)`.
    Set explicitly, so that it also holds where the shell started the process with Ctrl-C ignored."""

    def raise_interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler or raise_interrupt)
    signal.signal(signal.SIGINT, handler or raise_interrupt)


def ignore_further_interrupts() -> None:
    """Called once a run is stopping: a second Ctrl-C must not cut the shutdown and its checkpoint short."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def report_failure(error: Exception, run_path: str) -> None:
    """The one-line error on stderr, with advice where the failure is a non-finite value."""
    print(f"error: {error}", file=sys.stderr, flush=True)
    if isinstance(error, NonFiniteError) or "NonFiniteError" in str(error):
        print(non_finite_advice(run_path), file=sys.stderr, flush=True)


def receive(msg_q, timeout: float = 0.2):
    """The next message from the workers, or None after `timeout` seconds without one."""
    try:
        return msg_q.get(timeout=timeout)
    except queue.Empty:
        return None
