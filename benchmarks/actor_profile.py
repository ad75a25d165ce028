"""Where an actor's step goes: the real actor loop of impala_vtrace, vmpo_atari or vmpo_mujoco (the script's `act`)
run in this process for a few seconds, its parts timed.

    python benchmarks/actor_profile.py --script impala_vtrace --env-id Breakout-v5 --num-envs 32 --seconds 20
    python benchmarks/actor_profile.py --script vmpo_atari --cuda -- --network shallow --no-use-lstm
    python benchmarks/actor_profile.py --script vmpo_mujoco --env-id HalfCheetah-v4 --num-envs 64 --unroll-length 39

One actor process as the scripts start it (`--num-envs` envs, envpool's async batches of half of them, the
script's network on `--cuda` or the CPU), with a learner that takes nothing: full unroll slots go straight back
to the free ones. Per envpool batch, the mean time of:
- `recv`: waiting for envpool to return the next batch (the emulators' share the actor cannot hide);
- `refresh`: checking for (and loading) a newer network from the learner;
- `inference`: the network's forward pass (the copies to and from the device and the sampling fall in the rest);
- `send`: handing the actions to envpool;
- `unroll write`: the row copied into the shared unroll buffers;
- the rest: Python bookkeeping of the loop (the row's tensors, the episode tracker).
The sum is the actor's time per batch; steps/s = batch size / that. Then the learner's side: one update of the
script's loss on a batch of `--num-envs` of the unrolls just written (the learner's torch threads: half the cores,
as the scripts set them), in ms per environment step; and raw envpool stepping the same envs with random actions.

On a CPU every part runs on the same cores, so the script cannot go faster than
cores / (emulator + actor + learner CPU-seconds per step), the budget printed at the end (the emulator's share
taken as cores / raw envpool SPS: its threads keep every core busy). On a GPU machine the learner's and the
inference's time are the device's, and the budget says where the CPU goes. Prints Markdown, and writes JSON to
`--out` if given.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import time
from collections import defaultdict

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from throughput import machine_name, raw_envpool_sps  # noqa: E402

from common.envs import env_spec, flat_obs_dim  # noqa: E402


class Timer:
    """Sums the seconds spent in each named part."""

    def __init__(self):
        self.total = defaultdict(float)
        self.count = defaultdict(int)

    def wrap(self, name, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[name] += time.perf_counter() - t0
                self.count[name] += 1

        return timed


class Done(Exception):
    pass


class Recycle:
    """A full-slot queue whose learner takes nothing: each full slot is free again at once."""

    def __init__(self, free_q):
        self.free_q = free_q

    def put(self, slot):
        self.free_q.put(slot)


class Messages:
    def put(self, msg):
        pass


def profile(script, env_id, num_envs, unroll_length, seconds, device, script_flags):
    import importlib

    torch.set_num_threads(1)  # as in an actor process
    m = importlib.import_module(script)
    args = m.Args(env_id=env_id, num_envs=num_envs, num_actors=1, unroll_length=unroll_length)
    if "--no-use-lstm" in script_flags:
        args.use_lstm = False
    if "--network" in script_flags:
        args.network = script_flags[script_flags.index("--network") + 1]
    if script == "vmpo_mujoco":
        spec = env_spec(env_id, discrete=False)
        obs_dim, action_dim = flat_obs_dim(spec), int(spec.action_space.shape[0])
        agent = m.Agent(obs_dim, action_dim, args.hidden)
        specs = m.buffer_specs(obs_dim, action_dim, args.unroll_length)
    else:
        spec = env_spec(env_id, discrete=True)
        obs_shape, num_actions = spec.observation_space.shape, spec.action_space.n
        agent = m.Agent(obs_shape, num_actions, args.network, args.channels, args.use_lstm)
        specs = m.buffer_specs(spec.observation_space, num_actions, args)
    num_slots = num_envs + 8
    buffers = {k: torch.zeros((num_slots, *shape), dtype=dt) for k, (shape, dt) in specs.items()}
    free_q = queue.Queue()
    for i in range(num_slots):
        free_q.put(i)
    link = m.ActorChannel(agent, torch.zeros(1, dtype=torch.long), buffers, free_q, Recycle(free_q), Messages())
    cfg = m.actor_configs(args, 0, device)[0]
    timer = Timer()
    deadline = [None]
    batches = [0]
    make_env = m.make_env

    def timed_envs(*a, **kw):
        envs = make_env(*a, **kw)
        recv, send = timer.wrap("recv", envs.recv), timer.wrap("send", envs.send)

        class Envs:
            def __getattr__(self, name):
                return getattr(envs, name)

            def recv(self):
                now = time.perf_counter()
                if deadline[0] is None and batches[0] == 20:  # warm-up: start the clock after 20 batches
                    timer.total.clear()
                    timer.count.clear()
                    deadline[0] = now + seconds
                    timer.start = now
                if deadline[0] is not None and now >= deadline[0]:
                    timer.end = now
                    raise Done
                batches[0] += 1
                return recv()

            def send(self, *a):
                return send(*a)

        return Envs()

    m.make_env = timed_envs
    link.refresh = timer.wrap("refresh", link.refresh)
    link.write = timer.wrap("unroll write", link.write)
    local_agent = link.local_agent

    def timed_agent(*args):  # the forward pass timed; the sampling and copies back fall in "rest"
        agent = local_agent(*args)
        agent.forward = timer.wrap("inference", agent.forward)
        return agent

    link.local_agent = timed_agent
    try:
        m.act(cfg, link)
    except Done:
        pass
    finally:
        m.make_env = make_env
    wall = timer.end - timer.start
    n = timer.count["recv"]
    parts = {k: timer.total[k] / n for k in ("recv", "refresh", "inference", "send", "unroll write")}
    parts["rest (Python bookkeeping)"] = wall / n - sum(parts.values())
    learner = learner_ms_per_step(script, spec, args, buffers, num_envs, device, seconds)
    raw = raw_envpool_sps(env_id, num_envs, cfg.env_batch_size, seconds)
    return {
        "script": script,
        "env_id": env_id,
        "num_envs": num_envs,
        "env_batch_size": cfg.env_batch_size,
        "network": getattr(args, "network", "mlp"),
        "use_lstm": getattr(args, "use_lstm", False),
        "device": str(device),
        "batches": n,
        "steps_per_second": n * cfg.env_batch_size / wall,
        "ms_per_batch": {k: 1e3 * v for k, v in parts.items()},
        "learner_ms_per_step": learner,
        "raw_envpool_sps": raw,
    }


def learner_ms_per_step(script, spec, args, buffers, batch_size, device, seconds):
    """One update of the script's loss (benchmarks/throughput.py's learner) on `batch_size` unrolls from the actor's
    buffers, in ms per environment step of the batch, with the scripts' default learner threads."""
    from types import SimpleNamespace

    from throughput import make_learner

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    envs = SimpleNamespace(spec=spec, action_space=spec.action_space)
    flags = {"use_lstm": getattr(args, "use_lstm", False), "channels": getattr(args, "channels", ())}
    opt, _, loss_fn = make_learner(script, envs, getattr(args, "network", None), flags, device)
    mb = {k: v[:batch_size].transpose(0, 1).to(device) for k, v in buffers.items() if not k.startswith("core_")}
    steps, t0, n = mb["action"].shape[0] - 1, None, 0
    while True:
        loss = loss_fn(mb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        n += 1
        if t0 is None and n == 3:
            t0, n = time.perf_counter(), 0
        elif t0 is not None and time.perf_counter() - t0 >= seconds / 2:
            return 1e3 * (time.perf_counter() - t0) / n / (steps * batch_size)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--script", default="impala_vtrace", choices=["impala_vtrace", "vmpo_atari", "vmpo_mujoco"])
    p.add_argument("--env-id", default="Breakout-v5")
    p.add_argument("--num-envs", type=int, default=32)
    p.add_argument("--unroll-length", type=int, default=20)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--cuda", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("extra", nargs="*", help="--network NAME, --no-use-lstm (after --)")
    a = p.parse_args()
    device = torch.device("cuda" if a.cuda and torch.cuda.is_available() else "cpu")
    r = profile(a.script, a.env_id, a.num_envs, a.unroll_length, a.seconds, device, a.extra)
    machine = machine_name(device.type)
    r["machine"] = machine
    total = sum(r["ms_per_batch"].values())
    print(
        f"{r['script']} actor on {r['env_id']}, {r['num_envs']} envs in batches of {r['env_batch_size']}, "
        f"{r['network']} network{' + LSTM' if r['use_lstm'] else ''} on {r['device']}, {machine}: "
        f"{r['steps_per_second']:.0f} steps/s over {r['batches']} batches\n\n"
        "| part | ms per batch | share |\n|---|---|---|"
    )
    for k, v in r["ms_per_batch"].items():
        print(f"| {k} | {v:.3f} | {v / total:.0%} |")
    cores = os.cpu_count() or 1
    emulator = 1e3 * cores / r["raw_envpool_sps"]
    actor = (total - r["ms_per_batch"]["recv"]) / r["env_batch_size"]  # the actor's own CPU time, not its waiting
    learner = r["learner_ms_per_step"]
    print(
        f"\nCPU-ms per environment step: emulators {emulator:.3f} (raw envpool {r['raw_envpool_sps']:.0f} SPS on "
        f"{cores} cores), actor {actor:.3f}, learner {learner:.3f} (one update per step of the batch)"
    )
    if device.type == "cpu":
        print(f"budget on {cores} cores: at most {cores / ((emulator + actor + learner) / 1e3):.0f} SPS")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
