"""Training throughput against raw envpool stepping, measured in one run on one machine.

    python benchmarks/throughput.py --env-id Breakout-v5 --num-envs 32 --timesteps 100000

Four figures, in environment steps per second (SPS; frames are 4x that on Atari):
1. raw envpool: random actions, the same env, number of envs and async batch as the training run;
2. a synchronous loop with the same network and batch: step all envs with the policy for an unroll, then one
   learner update (one pass over the batch), then the next unroll: no overlap of acting and learning;
3. the same loop with a PPO-style learner (4 epochs of 4 minibatches per batch, CleanRL's Atari settings);
4. `impala_vtrace.py` itself, from the `summary.json` of a run of `--timesteps` steps: steady state (after
   the first update) and with start-up (process spawn, first batch) included.
Prints a Markdown table and writes it as JSON next to this file (or to --out).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common.envs import make_env  # noqa: E402


def raw_envpool_sps(env_id, num_envs, batch_size, seconds):
    envs = make_env(env_id, num_envs, seed=0, batch_size=batch_size)
    n_actions = envs.action_space.n
    envs.async_reset()
    steps, t0 = 0, None
    while True:
        _, _, _, _, info = envs.recv()
        ids = info["env_id"]
        envs.send(np.random.randint(0, n_actions, len(ids)), ids)
        steps += len(ids)
        if t0 is None and steps >= 4 * num_envs:  # warm-up
            t0, steps = time.time(), 0
        if t0 is not None and time.time() - t0 >= seconds:
            return steps / (time.time() - t0)


def sync_loop_sps(env_id, num_envs, unroll, network, seconds, device, epochs=1, minibatches=1):
    """Acting then learning, in turn, with IMPALA's agent and loss (on-policy); with epochs=4, minibatches=4
    the learner does the work of PPO's Atari settings (4 epochs of 4 minibatches over each batch)."""
    import impala_vtrace as iv

    envs = make_env(env_id, num_envs, seed=0)
    spec = envs.spec
    agent = iv.Agent(spec.observation_space.shape, envs.action_space.n, network).to(device)
    opt = torch.optim.RMSprop(agent.parameters(), lr=1e-4, alpha=0.99, eps=0.01)
    args = iv.Args()
    obs, _ = envs.reset()
    zeros = torch.zeros(1, num_envs, device=device)
    steps, t0 = 0, None
    while True:
        rows = {k: [] for k in ("obs", "action", "logits", "reward", "ended", "terminated")}
        reward = np.zeros(num_envs, np.float32)
        ended = np.zeros(num_envs, bool)
        term = np.zeros(num_envs, bool)
        for _ in range(unroll + 1):
            o = torch.as_tensor(obs, device=device)
            with torch.no_grad():
                logits, _, _ = agent(o[None], zeros.long(), zeros, zeros.bool())
            a = torch.distributions.Categorical(logits=logits[0]).sample()
            for k, v in (("obs", o), ("action", a), ("logits", logits[0]),
                         ("reward", torch.as_tensor(reward, device=device)),
                         ("ended", torch.as_tensor(ended, device=device)),
                         ("terminated", torch.as_tensor(term, device=device))):
                rows[k].append(v)
            obs, reward, term, trunc, _ = envs.step(a.cpu().numpy())
            ended = term | trunc
            steps += num_envs
        batch = {k: torch.stack(v) for k, v in rows.items()}
        T1, B = batch["action"].shape
        for _ in range(epochs):
            for cols in torch.randperm(B).chunk(minibatches):
                mb = {k: v[:, cols] for k, v in batch.items()}
                z = torch.zeros(T1, len(cols), device=device)
                logits, values, _ = agent(mb["obs"], z.long(), mb["reward"], z.bool())
                loss, _ = iv.learner_loss(logits, values, mb, args)
                opt.zero_grad()
                loss.backward()
                opt.step()
        if t0 is None:
            t0, steps = time.time(), 0
        elif time.time() - t0 >= seconds:
            return steps / (time.time() - t0)


def impala_sps(env_id, num_envs, timesteps, network, extra):
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, os.path.join(ROOT, "impala_vtrace.py"), "--env-id", env_id, "--num-envs",
               str(num_envs), "--total-timesteps", str(timesteps), "--network", network, "--eval-episodes", "0",
               "--run-dir", d, *extra]
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        summary = json.load(open(glob.glob(os.path.join(d, "*", "summary.json"))[0]))
        return summary["sps"], summary["sps_after_first_update"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env-id", default="Breakout-v5")
    p.add_argument("--num-envs", type=int, default=32)
    p.add_argument("--network", default="shallow")
    p.add_argument("--unroll-length", type=int, default=20)
    p.add_argument("--seconds", type=float, default=20.0, help="length of the raw and synchronous measurements")
    p.add_argument("--timesteps", type=int, default=100_000, help="length of the impala_vtrace.py run")
    p.add_argument("--cuda", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("extra", nargs="*", help="more impala_vtrace.py arguments, after --")
    a = p.parse_args()
    device = torch.device("cuda" if a.cuda and torch.cuda.is_available() else "cpu")
    raw = raw_envpool_sps(a.env_id, a.num_envs, max(1, a.num_envs // 2), a.seconds)
    sync = sync_loop_sps(a.env_id, a.num_envs, a.unroll_length, a.network, a.seconds, device)
    ppo = sync_loop_sps(a.env_id, a.num_envs, a.unroll_length, a.network, a.seconds, device, 4, 4)
    extra = list(a.extra) + ([] if a.cuda else ["--no-cuda"])
    impala_total, impala = impala_sps(a.env_id, a.num_envs, a.timesteps, a.network, extra)
    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
               + (f", {torch.cuda.get_device_name()}" if device.type == "cuda" else ""))
    result = {"env_id": a.env_id, "num_envs": a.num_envs, "network": a.network, "machine": machine,
              "raw_envpool_sps": raw, "sync_loop_sps": sync, "sync_ppo_style_sps": ppo,
              "impala_vtrace_sps": impala, "impala_vtrace_sps_with_startup": impala_total,
              "impala_over_raw": impala / raw, "impala_over_sync": impala / sync, "impala_over_ppo_style": impala / ppo}
    print(f"| env | envs | network | machine | raw envpool | sync 1 pass | sync PPO-style | impala_vtrace | "
          f"impala / raw | impala / sync | impala / PPO-style |\n|---|---|---|---|---|---|---|---|---|---|---|\n"
          f"| {a.env_id} | {a.num_envs} | {a.network} | {machine} | {raw:.0f} | {sync:.0f} | {ppo:.0f} | "
          f"{impala:.0f} ({impala_total:.0f} with start-up) | {impala / raw:.2f} | {impala / sync:.2f} | "
          f"{impala / ppo:.2f} |")
    out = a.out or os.path.join(ROOT, "benchmarks", f"throughput_{a.env_id}_{a.network}_{device.type}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
