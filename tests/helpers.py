"""Shared by the tests: run a script as a subprocess, read its TensorBoard events, wait for processes."""

import contextlib
import glob
import importlib
import io
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from common.envs import make_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def flags(*parts):
    """A command line's arguments, as a user types them: each part a string of space-separated flags and values, or
    a list of them."""
    return [a for p in parts for a in (p.split() if isinstance(p, str) else p)]


def run_script(script, argv, run_dir, timeout=300):
    """Runs `script` (a file name, or a full command) with `--run-dir run_dir` and returns the run folder."""
    cmd = [sys.executable, script] if isinstance(script, str) else list(script)
    out = subprocess.run(
        [*cmd, *argv, "--run-dir", str(run_dir)], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, f"exit {out.returncode}\nstdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-3000:]}"
    runs = [d for d in glob.glob(os.path.join(str(run_dir), "*")) if os.path.isdir(d)]
    assert len(runs) == 1, runs
    return runs[0]


def torchrun(script, argv, run_dir):
    """`run_script` of `script argv` as two learners under torchrun."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script]
    return run_script(cmd, argv, run_dir)


def learns(script, argv, run_dir, target, timeout=900, evaluations=False):
    """Runs `script` with `argv` (the defaults a user gets, with a budget) and watches its console line: once the mean
    return of its last 100 episodes, over 100 episodes or more, reaches `target`, a Ctrl-C stops the run (it saves
    the update in hand and exits 130); otherwise it runs its budget out. With `evaluations` (p3s_td3.py) it watches the
    periodic evaluation's score (`eval X at step`) instead. Returns the best value seen and the run folder. A learning
    test asserts that the budget is enough; the run's whole curve is a benchmark's business."""
    no_eval = [] if evaluations else ["--eval-episodes", "0"]  # the end's evaluation: none (p3s: its periodic ones)
    cmd = [sys.executable, script, *argv, *no_eval, "--log-interval", "1", "--run-dir", str(run_dir)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    best, lines = -float("inf"), []
    line_pattern = re.compile(
        r"\| eval (-?[\d.]+) at " if evaluations else r"return\(100\)\s+(-?[\d.]+) \| episodes (\d+)"
    )
    try:
        for line in proc.stdout:
            lines.append(line)
            m = line_pattern.search(line)
            value = float(m.group(1)) if m and (evaluations or int(m.group(2)) >= 100) else None
            if value is not None and best < target <= value:
                os.kill(proc.pid, signal.SIGINT)  # once: the first line at the target
            best = max(best, value) if value is not None else best
        proc.wait(timeout=120)
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode in (0, 130), f"exit {proc.returncode}\n" + "".join(lines[-40:])
    runs = [d for d in glob.glob(os.path.join(str(run_dir), "*")) if os.path.isdir(d)]
    assert len(runs) == 1, runs
    return best, runs[0]


def events(run_path):
    """A run's TensorBoard events, read whole (`.Scalars(tag)`: a tag's events in step order)."""
    acc = EventAccumulator(run_path, size_guidance={"scalars": 0})
    acc.Reload()
    return acc


def events_tags(run_path, values_of=None):
    """The scalar tags of a run's TensorBoard events, or the values of one tag in step order."""
    acc = events(run_path)
    if values_of is None:
        return set(acc.Tags()["scalars"])
    return [e.value for e in acc.Scalars(values_of)]


def logged_by(run_path, tag, step):
    """Whether a run's TensorBoard events hold `tag` at `step` or before (a `ready` for `kill_resume_stop`: a worker
    that logs it may start after others have passed the checkpoint's step)."""
    acc = events(run_path)
    return tag in acc.Tags()["scalars"] and any(e.step <= step for e in acc.Scalars(tag))


def wait_gone(pids, timeout):
    """True once none of `pids` is alive (zombies count as gone)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        alive = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().split()[2] != "Z":
                        alive.append(pid)
            except FileNotFoundError:
                pass
        if not alive:
            return True
        time.sleep(0.2)
    return False


def children(pid):
    """The pids of the direct children of `pid`."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def imported_envpool_modules(module):
    """The envpool modules that importing `module` loads (a script's import must touch no environment)."""
    code = f"import {module}, sys; print(sorted(m for m in sys.modules if m.startswith('envpool')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def assert_usage_error(script, argv, run_dir, needle, process=None):
    """Bad input: exit status 2, one line `error: ...` naming `needle`, no traceback, no run folder. With `process`
    (by default the first bad input of each script in a session) as `python script ...` runs it (a hang guard, no
    time bound: what is checked is the exit before any work); else the script's `cli()` in this process, as its
    `__main__` calls it, its `RunLog` a tripwire (the run would begin)."""
    process = script not in AS_A_PROCESS if process is None else process
    AS_A_PROCESS.add(script)
    if process:
        cmd = [sys.executable, script, *argv, "--run-dir", str(run_dir)]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
        code, err = out.returncode, out.stderr
    else:
        module, err_io, threads = importlib.import_module(script.removesuffix(".py")), io.StringIO(), torch_threads()
        saved_argv, saved_log, code = sys.argv, module.RunLog, None
        sys.argv = [script, *argv, "--run-dir", str(run_dir)]
        module.RunLog = run_began
        try:
            with contextlib.redirect_stderr(err_io):
                module.cli()
        except SystemExit as e:
            code = e.code
        finally:
            sys.argv, module.RunLog = saved_argv, saved_log
            torch_threads(threads)
        err = err_io.getvalue()
    assert code == 2, (code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], err
    assert "Traceback" not in err and not os.listdir(run_dir)  # no work done, no run folder


AS_A_PROCESS = set()  # the scripts whose bad input has run as a process in this session


def run_began(*args, **kwargs):
    raise AssertionError("the bad input was taken: the run began")


def torch_threads(count=None):
    """torch's thread count in this process, or sets it (a script's set-up may change it)."""
    return torch.get_num_threads() if count is None else torch.set_num_threads(count)


def spawned(pid):
    """The pids of `pid`'s children that multiprocessing's spawn started (actors, workers, learners)."""
    found = []
    for c in children(pid):
        try:
            if "spawn_main" in open(f"/proc/{c}/cmdline").read():
                found.append(c)
        except OSError:  # gone meanwhile
            pass
    return found


def wait_for_actors(proc, timeout=120):
    """The pids of `proc`'s spawned worker processes, once at least one has started."""
    deadline = time.time() + timeout
    actors = []
    while time.time() < deadline and not actors:
        time.sleep(1.0)
        actors = spawned(proc.pid)
    assert actors, "no actor process started"
    return actors


def assert_two_ctrl_cs_end_cleanly(proc):
    """An impatient user: Ctrl-C twice, 0.3 s apart; the second must not cut the shutdown short (exit 130, no
    traceback). `proc` has its stderr piped as text; returns it."""
    os.kill(proc.pid, signal.SIGINT)
    time.sleep(0.3)  # the impatient user's second Ctrl-C: part of the scenario, no synchronisation
    os.kill(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=300) == 130  # a hang guard
    err = proc.stderr.read()
    assert "Traceback" not in err, err[-3000:]
    return err


STOP_LINES = ("stopping after the update in hand", "checkpoint at step ")  # what a stopped run writes to stderr


def assert_only_stop_lines(err, also=()):
    """The whole of a stopped run's stderr (with `also`: the prefixes of its stdout's lines where they are merged) is
    the stop's own lines: no warning (a leaked semaphore, say), no traceback."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert any(line.startswith(STOP_LINES[1]) for line in lines), err[-3000:]
    assert all(line.startswith((*STOP_LINES, *also)) for line in lines), err[-3000:]


def assert_killed_process_ends_the_run(script, argv, run_dir, victim):
    """Starts `script` for a long run and, once it has written its first progress line (a `step ...` line: the main
    process is in its loop, its signal handlers in place; no time guessed for this machine), `victim` "actor" (or
    "worker", "learner", "population") SIGKILLs one of its spawned processes (the run must end non-zero, naming it:
    "<victim> <n> died with exit code -9"), "sigterm" sends SIGTERM to the main process (the run must end),
    "sigint-twice" sends Ctrl-C twice 0.3 s apart (the run must end with 130 and no traceback); either way no spawned
    process may outlive the run. The waits are hang guards of minutes, not speed checks (a loaded 2-core machine once
    took more than 30 s to end a run after its actor's kill). Returns the stderr read (empty after "sigterm")."""
    log = os.path.join(str(run_dir), "console.log")
    with open(log, "w") as out:
        cmd = [sys.executable, script, *argv, "--run-dir", str(run_dir)]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.PIPE, text=True)
    err = ""
    try:
        actors = wait_for_actors(proc, timeout=300)
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            if any(line.startswith("step ") for line in open(log).read().split("\n")[:-1]):  # complete lines
                break
            time.sleep(0.1)
        assert proc.poll() is None, open(log).read()[-3000:]  # still running: in its loop
        if victim in ("actor", "worker", "learner", "population"):
            os.kill(actors[0], signal.SIGKILL)
            assert proc.wait(timeout=300) != 0
            err = proc.stderr.read()
            assert re.search(rf"{victim} \d+ died with exit code -9", err), err[-3000:]
        elif victim == "sigint-twice":
            err = assert_two_ctrl_cs_end_cleanly(proc)
        else:
            os.kill(proc.pid, signal.SIGTERM)
            assert proc.wait(timeout=300) != 0
        assert wait_gone(actors, timeout=120), "an actor outlived its learner"
    finally:
        if proc.poll() is None:
            proc.kill()
    return err


def killed_and_resumed(script, argv, run_dir, budget, steps_per_update, curve, killed=None):
    """`script argv` with a budget of `budget` steps (and a checkpoint every 0.5 s, seed 3), SIGKILLed as soon as its
    first checkpoint.pt is there, so that its budget is far from spent (its actors must then exit by themselves;
    `killed(run folder)` looks at it then), continues with --resume: the same folder and arguments, the update counter
    from the checkpoint, `curve` going on from the checkpoint's step, and the budget reached in the end. Returns the
    run folder, the first checkpoint, the last and the run's events."""
    extra = f"--total-timesteps {budget} --checkpoint-interval 0.5 --eval-episodes 0 --log-interval 0 --seed 3"
    proc = subprocess.Popen(
        [sys.executable, script, *flags(argv, extra), "--run-dir", str(run_dir)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        actors, deadline = wait_for_actors(proc), time.time() + 120
        while time.time() < deadline and not (found := glob.glob(os.path.join(str(run_dir), "*", "checkpoint.pt"))):
            time.sleep(0.2)
        assert found, "no checkpoint written"
        proc.kill()
        proc.wait(timeout=30)
        assert wait_gone(actors, timeout=20), "an actor outlived its killed learner"
    finally:
        if proc.poll() is None:
            proc.kill()
    run, updates = os.path.dirname(found[0]), budget // steps_per_update
    if killed:
        killed(run)
    saved = torch.load(found[0], weights_only=False)
    assert 0 < saved["update"] < updates and saved["global_step"] == saved["update"] * steps_per_update
    assert not os.path.exists(os.path.join(run, "summary.json"))  # it did not finish
    assert run_script(script, ["--resume", run], run_dir, timeout=600) == run  # the same folder, no new one
    assert json.load(open(os.path.join(run, "summary.json")))["total_timesteps"] == budget
    final = torch.load(found[0], weights_only=False)
    assert final["update"] == updates and final["args"]["seed"] == 3  # the run's own arguments
    acc = events(run)
    steps = [e.step for e in acc.Scalars(curve)]
    assert steps == sorted(steps) and steps[-1] == budget  # after purging, one continuing curve
    # the checkpoint's own update reached the curves with it (logged, then flushed by the save), the rest went on
    assert saved["global_step"] in steps and any(s > saved["global_step"] for s in steps)
    return run, saved, final, acc


def evaluate_py(argv, timeout=300):
    """`python evaluate.py argv` in the repository: the completed process, its output captured as text."""
    cmd = [sys.executable, "evaluate.py", *argv]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def evaluate_cli(run, episodes=2, extra=()):
    """Plays a run's model.pt through `python evaluate.py` (with the flags `extra`) and returns its JSON report."""
    out = evaluate_py([os.path.join(run, "model.pt"), "--episodes", str(episodes), *extra])
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def assert_non_finite_stops_the_run(script, argv, run_dir, checkpoint_expected=True, processes=True):
    """A learning rate of 1e30 blows the weights up within a few updates: the run must stop with exit code 1
    and a line naming the non-finite quantity, keep a checkpoint of finite weights from before (when one was
    written: Hogwild workers can get there before the main process writes its first), and leave no process
    behind (with `processes`, it must have started some: p3s_td3.py starts none)."""
    cmd = [sys.executable, script, *argv, *flags("--learning-rate 1e30 --checkpoint-interval 1e-6 --eval-episodes 0")]
    stderr = open(os.path.join(str(run_dir), "stderr.txt"), "w")
    proc = subprocess.Popen([*cmd, "--run-dir", str(run_dir)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr)
    workers, deadline = set(), time.time() + 240
    try:
        while proc.poll() is None and time.time() < deadline:  # note the workers while it runs
            workers.update(spawned(proc.pid))
            time.sleep(0.1)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = open(os.path.join(str(run_dir), "stderr.txt")).read()
    assert workers or not processes, "no worker process seen"
    assert proc.returncode == 1, err[-2000:]
    lines = [x for x in err.splitlines() if re.match(r"(error|\S*NonFiniteError): non-finite \S+ ", x)]
    assert lines, err[-2000:]
    line = lines[0]
    assert wait_gone(workers, timeout=20), "a worker outlived the stopped run"
    ckpt = glob.glob(os.path.join(str(run_dir), "*", "checkpoint.pt"))
    if not checkpoint_expected and not ckpt:
        assert "no checkpoint was written" in err, err[-2000:]
        return line, None
    assert "last good checkpoint" in err, err[-2000:]
    assert len(ckpt) == 1
    state = torch.load(ckpt[0], map_location="cpu", weights_only=False)
    parts = [part for part in state.values() if isinstance(part, dict)]
    tensors = [v for part in parts for v in part.values() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    assert tensors and all(bool(torch.isfinite(v).all()) for v in tensors)
    return line, state


def ctrl_c_during_second_update(script, argv, run_dir, steps_per_update, deadline_s=900):
    """Runs `script` with `--log-interval 0` (one progress line per update) and sends Ctrl-C once the first update
    is done, while the next is collected or in progress. Asserts that the run finishes the update in hand and starts
    no other (what makes a stop take seconds, whatever the machine's speed), checkpoints the last completed one (k or
    k + 1 updates of `steps_per_update` steps, k those done when Ctrl-C is sent: a fast machine may finish a second
    update between two looks at the log), exits with 130, says how to continue and leaves no actor behind."""

    def updates_done(text):  # complete lines only: a line still being written may not show "collecting" yet
        return sum(line.startswith("step ") and "collecting" not in line for line in text.split("\n")[:-1])

    log = os.path.join(str(run_dir), "console.log")
    with open(log, "w") as out:
        cmd = [sys.executable, script, *argv, *flags("--log-interval 0 --checkpoint-interval 0 --eval-episodes 0")]
        cmd += ["--run-dir", os.path.join(str(run_dir), "runs")]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + deadline_s
        while time.time() < deadline and proc.poll() is None and not updates_done(open(log).read()):
            time.sleep(0.05)
        seen = updates_done(open(log).read())
        assert seen >= 1, open(log).read()[-3000:]  # the first update is done
        actors = spawned(proc.pid)
        os.kill(proc.pid, signal.SIGINT)
        proc.wait(timeout=deadline_s)  # a hang guard: what is asserted is the count of updates below
    finally:
        if proc.poll() is None:
            proc.kill()
    text = open(log).read()
    assert proc.returncode == 130, text[-3000:]
    assert wait_gone(actors, timeout=30), "an actor outlived the stopped run"
    done = updates_done(text)
    assert done in (seen, seen + 1), text[-3000:]  # the update in hand completed, no other started
    assert "continue with" in text and "--resume" in text, text[-3000:]
    assert_only_stop_lines(text, also=("step ", "task family: ", "run folder: "))
    (run,) = glob.glob(os.path.join(str(run_dir), "runs", "*"))
    ckpt = torch.load(os.path.join(run, "checkpoint.pt"), weights_only=False)
    assert ckpt["update"] == done and ckpt["global_step"] == done * steps_per_update


def kill_resume_stop(script, argv, run_dir, stop_signal, kill_past=0, past=1, timeout=300, ready=None):
    """The life of a long run, each step taken on what the run has written, never on a clock: `script argv` (with a
    budget it cannot spend within the test) is SIGKILLed once it has saved a checkpoint past step `kill_past` (for
    which `ready(run folder, checkpoint)` holds, if given), and its spawned processes must then exit by themselves;
    `--resume` continues it in the same folder; once the resumed run has saved a checkpoint at least `past` steps
    beyond that one, `stop_signal` (Ctrl-C or SIGTERM) asks it to stop: it must finish the update in hand, save, say
    how to continue and exit with 130, with nothing else on stderr and no process left. Returns (run folder, the first
    checkpoint, the last, the resumed run's stderr)."""

    def start(args, **streams):
        cmd = [sys.executable, script, *args]
        return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, text=True, **streams)

    def checkpoint_after(proc, step, ready=None):  # the run folder's checkpoint once its step is past `step` (polled)
        deadline = time.time() + timeout
        while time.time() < deadline and proc.poll() is None:
            found = glob.glob(os.path.join(str(run_dir), "*", "checkpoint.pt"))
            if found:
                saved = torch.load(found[0], weights_only=False)  # written atomically: whole or not yet there
                if saved["global_step"] > step and (ready is None or ready(os.path.dirname(found[0]), saved)):
                    return found[0], saved
            time.sleep(0.2)
        raise AssertionError(f"no checkpoint past step {step} (and ready) within {timeout} s (exit {proc.poll()})")

    argv = [*argv, *flags("--checkpoint-interval 0.5 --eval-episodes 0 --run-dir"), str(run_dir)]
    proc = start(argv, stderr=subprocess.DEVNULL)
    try:
        actors = wait_for_actors(proc, timeout)
        path, first = checkpoint_after(proc, kill_past, ready)
        actors = {*actors, *spawned(proc.pid)}  # those that started after the first
        proc.kill()
        proc.wait(timeout=30)
        assert wait_gone(actors, timeout=30), "a spawned process outlived its killed main process"
    finally:
        if proc.poll() is None:
            proc.kill()
    run = os.path.dirname(path)
    assert not os.path.exists(os.path.join(run, "summary.json"))  # it did not finish
    proc = start(["--resume", run], stderr=subprocess.PIPE)
    try:
        actors = wait_for_actors(proc, timeout)
        checkpoint_after(proc, first["global_step"] + past - 1)
        actors = {*actors, *spawned(proc.pid)}
        proc.send_signal(stop_signal)
        assert proc.wait(timeout=120) == 130
        err = proc.stderr.read()
        assert wait_gone(actors, timeout=30), "a spawned process outlived the stopped run"
    finally:
        if proc.poll() is None:
            proc.kill()
    assert_only_stop_lines(err)
    last = torch.load(path, weights_only=False)
    assert f"checkpoint at step {last['global_step']}: continue with python {script} --resume {run}" in err, err
    assert glob.glob(os.path.join(str(run_dir), "*")) == [run]  # the same folder, no new one
    return run, first, last, err


def acted_unrolls(script, agent, argv, num_unrolls):
    """Runs `script.act` (impala_vtrace, vmpo_atari) in this process with `agent` and `argv`'s actor settings until it
    has sent `num_unrolls` full unrolls; returns each env's unrolls in the order it sent them, as {name: [T+1, ...]}."""
    args = script.parse_args(argv)
    specs = script.buffer_specs(script.env_spec(args.env_id).observation_space, agent.policy.out_features, args)
    slots = args.num_envs + 2
    buffers = {k: torch.zeros((slots, *shape), dtype=dt) for k, (shape, dt) in specs.items()}
    sent = {e: [] for e in range(args.num_envs)}

    class Enough(Exception):
        pass

    class FullQueue:  # the learner's end: keeps a copy of each full unroll, frees its slot, stops the actor
        def put(self, slot):
            (env,) = np.flatnonzero(link.slot == slot)  # `write` hands the env a new slot after this
            sent[env].append({k: v[slot].clone() for k, v in buffers.items()})
            link.free_q.put(slot)
            if sum(map(len, sent.values())) == num_unrolls:
                raise Enough

    link = script.ActorChannel(
        agent, torch.zeros(1, dtype=torch.long), buffers, queue.Queue(), FullQueue(), queue.Queue()
    )
    for i in range(slots):
        link.free_q.put(i)
    (cfg,) = script.actor_configs(args, 0, torch.device("cpu"))
    try:
        script.act(cfg, link)
    except Enough:
        return sent
    raise AssertionError("act returned")


def assert_lstm_state_carried_and_zeroed(agent, chains, readout):
    """A plain loop over each env's rows from a zero state, one LSTMCell step per row with the state zeroed where a
    row is the first of an episode, against what the actor stored: the state before each unroll (so the state crosses
    from one unroll to the next) and the logits at every row (`readout`: the LSTM's output to logits). The learner's
    one pass over an unroll from its stored state gives those logits too. Returns how many rows were firsts."""
    core, firsts, carried = agent.core, 0, 0
    with torch.no_grad():
        for unrolls in chains.values():
            h = c = torch.zeros(1, core.hidden)
            for u in unrolls:
                torch.testing.assert_close((u["core_h"][None], u["core_c"][None]), (h, c))  # state before the unroll
                carried += bool(h.abs().sum() > 0)
                for t in range(len(u["first"]) - 1):  # row T is the next unroll's row 0
                    if u["first"][t]:
                        h, c, firsts = torch.zeros_like(h), torch.zeros_like(c), firsts + 1
                    action = F.one_hot(u["prev_action"][t], core.num_actions).float()
                    x = torch.cat([agent.torso(u["obs"][t : t + 1]), action[None], u["reward"][t].view(1, 1)], -1)
                    h, c = core.cell(x, (h, c))
                    torch.testing.assert_close(readout(h)[0], u["logits"][t])
                pass_logits = agent(*(u[k][:, None] for k in ("obs", "prev_action", "reward", "first")),
                                    (u["core_h"][None], u["core_c"][None]))[0]  # fmt: skip
                torch.testing.assert_close(pass_logits[:, 0], u["logits"])
                assert torch.equal(u["first"][1:], u["ended"][:-1])  # a row after an episode's end starts the next
    assert carried > 0
    return firsts


def breakout_unrolls(num_envs=8, unroll_length=20, seed=0):
    """Real Breakout-v5 frames of random play as a batch of unrolls (the keys `next_batch` gives, time-major
    `[T+1, B]`), with the training settings of the CPU Atari defaults (a lost life ends the episode)."""

    envs = make_env("Breakout-v5", num_envs, seed, episodic_life=True, reward_clip=False)
    obs, _ = envs.reset()
    rng = np.random.default_rng(seed)
    reward, term, ended = np.zeros(num_envs, np.float32), np.zeros(num_envs, bool), np.zeros(num_envs, bool)
    rows = []
    for _ in range(unroll_length + 1):
        action = rng.integers(0, 4, num_envs)
        rows.append([obs, reward, ended, term, action])
        obs, reward, term, trunc, _ = envs.step(action)
        ended = term | trunc
    obs, reward, ended, term, action = (torch.from_numpy(np.stack(col)) for col in zip(*rows))
    zeros = torch.zeros(unroll_length + 1, num_envs, dtype=torch.long)
    batch = dict(obs=obs, reward=reward.float(), ended=ended, terminated=term, action=action.long())
    return {**batch, "first": zeros.bool(), "prev_action": zeros, "task": zeros, "version": zeros}


HOGWILD_LONG_RUN = "--env-id CartPole-v1 --num-workers 2 --total-timesteps 100000000"  # a3c.py, acer.py: not spent


def learning_rate_logged(run, saved):
    """A `ready` for `kill_resume_stop` in a Hogwild run: worker 0 logs the learning rate, and may start after the
    other has passed the checkpoint's step."""
    return logged_by(run, "charts/learning_rate", saved["global_step"])


def assert_every_steps_return_scaled(agent, work):
    """--scale-rewards on Pendulum-v1, one env: `work()` (a worker's 400 steps in this process, two episodes of 200)
    puts R_t into `agent`'s return statistics at every step, the last of an episode too (R_t shares no memory with
    the array reset after it). Pendulum's rewards are all negative, so is every R_t but at envpool's reset step."""
    seen, update = [], agent.return_norm.update
    agent.return_norm.update = lambda x: (seen.append(x.clone()), update(x))
    work()
    returns = torch.cat([x.flatten() for x in seen])  # steps 0-199, envpool's reset step (reward 0), 201-399
    assert len(returns) == 400 and (returns <= 0).all() and (returns == 0).nonzero().flatten().tolist() == [200]


def assert_logged(run_path, *tags):
    """A run's TensorBoard events hold each of `tags` (strings of space-separated tags); returns all its tags."""
    logged = events_tags(run_path)
    for tag in " ".join(tags).split():
        assert tag in logged, (tag, logged)
    return logged


ENV_IDS_SHARES = [  # impala_vtrace.py, vmpo_atari.py: argv and (actors, envs), None for the script's Args default
    (flags("--env-ids Breakout-v5 Qbert-v5 BeamRider-v5"), (3, 33)),  # one actor per game, 32 envs rounded up
    (flags("--env-ids Breakout-v5 Qbert-v5 BeamRider-v5 --num-actors 6"), (6, 36)),
    (flags("--env-ids Pong-v5 Breakout-v5 --num-envs 8"), (2, 8)),  # a flag given wins
    (flags("--env-ids Pong-v5 Breakout-v5 --preset paper"), (1, None)),
    (flags("--env-id Pong-v5"), (1, 32)),
]


def assert_env_ids_share(script, argv, expected):
    """`--env-ids` alone runs: one actor per game and the family's envs rounded up to a multiple of them (the actors
    must divide evenly over the games); flags given and `--preset paper` keep theirs (`script`: the module)."""
    args = script.parse_args(argv)
    actors, envs = expected
    assert (args.num_actors, args.num_envs) == (actors, script.Args().num_envs if envs is None else envs)
    if args.env_ids and args.preset != "paper":
        script.check_args(args)  # accepted: no UsageError


THREE_GAMES = ["Breakout-v5", "Qbert-v5", "Asterix-v5"]  # 120-340 steps a game with random play


def three_games_run(script, argv, run_dir):
    """`script` (impala_vtrace.py, vmpo_atari.py) on THREE_GAMES, one actor each, with `argv` besides: asserts what
    every multi-game run has (a `3games__` folder; each game's curves, PopArt statistics and evaluation; the full
    action set and the games in model.pt; the per-game evaluation table) and returns the run folder, its TensorBoard
    tags and its model.pt."""
    games = flags("--env-ids", THREE_GAMES, "--num-actors 3 --num-envs 6 --batch-size 6")
    budget = "--total-timesteps 3000 --save-model --eval-episodes 1 --log-interval 1"
    run_path = run_script(script, flags(games, argv, budget), run_dir, timeout=600)
    assert os.path.basename(run_path).startswith("3games__")
    tags = events_tags(run_path)
    for g in THREE_GAMES:
        assert {f"charts/{g}/episodic_return", f"stats/popart_sigma/{g}", f"charts/{g}/eval_return"} <= tags, tags
    checkpoint = torch.load(os.path.join(run_path, "model.pt"), weights_only=False)
    assert checkpoint["full_action_space"] and checkpoint["env_ids"] == THREE_GAMES
    table = json.load(open(os.path.join(run_path, "evaluation.json")))
    assert [r["env_id"] for r in table["games"]] == THREE_GAMES and table["median_human_normalized"] is not None
    return run_path, tags, checkpoint


def assert_lstm_input_in_range_and_torso_gradient(agent, seq, stats):
    """A deep agent with an LSTM after 10 updates: over its inputs `seq`, under 10% of the LSTM cell's input
    pre-activations beyond |4|, and the torso's last layer's gradient in `stats` (the last update's diagnostics)
    above 1e-4."""
    inputs = []  # the LSTM cell's inputs, step by step
    hook = agent.core.cell.register_forward_pre_hook(lambda cell, x: inputs.append(x[0]))
    with torch.no_grad():
        agent(*seq)
        cell = agent.core.cell
        saturated = float(((torch.cat(inputs) @ cell.weight_ih.T + cell.bias_ih).abs() > 4).float().mean())
    hook.remove()
    assert saturated < 0.1, f"{saturated:.0%} of the LSTM's input pre-activations beyond |4| after 10 updates"
    grad = float(stats["grad_norm/torso.fc"])
    assert grad > 1e-4, f"the torso's last layer's gradient {grad:.1e} after 10 updates"
