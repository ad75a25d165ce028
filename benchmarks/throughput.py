"""Training throughput against raw envpool stepping, measured in one run on one machine.

    python benchmarks/throughput.py --env-id Breakout-v5 --num-envs 32 --timesteps 100000

    python benchmarks/throughput.py --script vmpo_atari --env-id Breakout-v5 --num-envs 32 --timesteps 100000 \
        -- --network shallow --no-use-lstm --batch-size 32 --unroll-length 20

Four figures, in environment steps per second (SPS; frames are 4x that on Atari):
1. raw envpool: random actions, the same env, number of envs and async batch as the training run;
2. a synchronous loop with the script's own agent and loss and the same batch: step all envs with the policy
   for an unroll, then one learner update (one pass over the batch), then the next unroll: no overlap of
   acting and learning;
3. the same loop with a PPO-style learner (4 epochs of 4 minibatches per batch, CleanRL's Atari settings);
4. the script itself (`--script`), from the `summary.json` of a run of `--timesteps` steps: steady state
   (after the first update) and with start-up (process spawn, first batch) included.
The script's network arguments after `--` (`--network`, `--no-use-lstm`, `--channels`) are given to the
synchronous loops too. Prints a Markdown table and writes it as JSON next to this file (or to --out).
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


def make_learner(script, obs_shape, num_actions, network, script_args, device):
    """The script's agent, optimiser and loss as `(agent, optimizer, loss_fn(batch) -> loss)`."""
    if script == "impala_vtrace":
        import impala_vtrace as m

        args = m.Args(network=network, use_lstm=script_args.get("use_lstm", False))
        agent = m.Agent(obs_shape, num_actions, network, args.channels, args.use_lstm).to(device)
        opt = torch.optim.RMSprop(agent.parameters(), lr=1e-4, alpha=0.99, eps=0.01)

        def loss_fn(mb, T1, B):
            z = torch.zeros(T1, B, device=device)
            state = agent.initial_state(B, device)
            logits, values, _ = agent(mb["obs"], z.long(), mb["reward"], z.bool(), state)
            return m.learner_loss(logits, values, mb, args)[0]
    elif script == "vmpo_atari":
        import vmpo_atari as m

        args = m.Args(network=network, use_lstm=script_args.get("use_lstm", True),
                      channels=script_args.get("channels", ()))
        agent = m.Agent(obs_shape, num_actions, network, args.channels, args.use_lstm).to(device)
        multipliers = m.LagrangeMultipliers().to(device)
        opt = torch.optim.Adam([*agent.parameters(), *multipliers.parameters()], lr=1e-4)

        def loss_fn(mb, T1, B):
            z = torch.zeros(T1, B, device=device)
            state = agent.initial_state(B, device)
            logits, features, _ = agent(mb["obs"], z.long(), mb["reward"], z.bool(), state)
            return m.vmpo_loss(logits, features, mb, agent, multipliers, args)[0]
    else:
        raise SystemExit(f"error: unknown --script {script!r}")
    return agent, opt, loss_fn


def sync_loop_sps(script, env_id, num_envs, unroll, network, script_args, seconds, device, epochs=1,
                  minibatches=1):
    """Acting then learning, in turn, with the script's agent and loss (on-policy); with epochs=4,
    minibatches=4 the learner does the work of PPO's Atari settings (4 epochs of 4 minibatches per batch)."""
    envs = make_env(env_id, num_envs, seed=0)
    agent, opt, loss_fn = make_learner(script, envs.spec.observation_space.shape, envs.action_space.n, network,
                                       script_args, device)
    obs, _ = envs.reset()
    zeros = torch.zeros(1, num_envs, device=device)
    state = agent.initial_state(num_envs, device)
    steps, t0 = 0, None
    while True:
        rows = {k: [] for k in ("obs", "action", "logits", "reward", "ended", "terminated")}
        reward = np.zeros(num_envs, np.float32)
        ended = np.zeros(num_envs, bool)
        term = np.zeros(num_envs, bool)
        for _ in range(unroll + 1):
            o = torch.as_tensor(obs, device=device)
            with torch.no_grad():
                logits, _, state = agent(o[None], zeros.long(), zeros, zeros.bool(), state)
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
                loss = loss_fn(mb, T1, len(cols))
                opt.zero_grad()
                loss.backward()
                opt.step()
        if t0 is None:
            t0, steps = time.time(), 0
        elif time.time() - t0 >= seconds:
            return steps / (time.time() - t0)


def script_sps(script, env_id, num_envs, timesteps, network, extra):
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, os.path.join(ROOT, f"{script}.py"), "--env-id", env_id, "--num-envs",
               str(num_envs), "--total-timesteps", str(timesteps), "--network", network, "--eval-episodes", "0",
               "--run-dir", d, *extra]
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        summary = json.load(open(glob.glob(os.path.join(d, "*", "summary.json"))[0]))
        return summary["sps"], summary["sps_after_first_update"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--script", default="impala_vtrace", choices=["impala_vtrace", "vmpo_atari"])
    p.add_argument("--env-id", default="Breakout-v5")
    p.add_argument("--num-envs", type=int, default=32)
    p.add_argument("--network", default="shallow")
    p.add_argument("--unroll-length", type=int, default=20)
    p.add_argument("--seconds", type=float, default=20.0, help="length of the raw and synchronous measurements")
    p.add_argument("--timesteps", type=int, default=100_000, help="length of the script's run")
    p.add_argument("--cuda", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("extra", nargs="*", help="more arguments of the script, after --")
    a = p.parse_args()
    device = torch.device("cuda" if a.cuda and torch.cuda.is_available() else "cpu")
    script_args = {}
    if "--no-use-lstm" in a.extra or "--use-lstm" in a.extra:
        script_args["use_lstm"] = "--use-lstm" in a.extra
    if "--channels" in a.extra:
        rest = a.extra[a.extra.index("--channels") + 1:]
        script_args["channels"] = tuple(int(c) for c in rest[:next((i for i, c in enumerate(rest)
                                                                     if c.startswith("--")), len(rest))])
    raw = raw_envpool_sps(a.env_id, a.num_envs, max(1, a.num_envs // 2), a.seconds)
    sync = sync_loop_sps(a.script, a.env_id, a.num_envs, a.unroll_length, a.network, script_args, a.seconds, device)
    ppo = sync_loop_sps(a.script, a.env_id, a.num_envs, a.unroll_length, a.network, script_args, a.seconds, device,
                        4, 4)
    extra = ["--unroll-length", str(a.unroll_length), *a.extra] + ([] if a.cuda else ["--no-cuda"])
    total, steady = script_sps(a.script, a.env_id, a.num_envs, a.timesteps, a.network, extra)
    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
               + (f", {torch.cuda.get_device_name()}" if device.type == "cuda" else ""))
    result = {"script": a.script, "env_id": a.env_id, "num_envs": a.num_envs, "network": a.network,
              "script_args": a.extra, "machine": machine, "raw_envpool_sps": raw, "sync_loop_sps": sync,
              "sync_ppo_style_sps": ppo, "script_sps": steady, "script_sps_with_startup": total,
              "script_over_raw": steady / raw, "script_over_sync": steady / sync, "script_over_ppo_style": steady / ppo}
    print(f"| script | env | envs | network | machine | raw envpool | sync 1 pass | sync PPO-style | script | "
          f"script / raw | script / sync | script / PPO-style |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n"
          f"| {a.script} | {a.env_id} | {a.num_envs} | {a.network} | {machine} | {raw:.0f} | {sync:.0f} | {ppo:.0f} | "
          f"{steady:.0f} ({total:.0f} with start-up) | {steady / raw:.2f} | {steady / sync:.2f} | {steady / ppo:.2f} |")
    out = a.out or os.path.join(ROOT, "benchmarks",
                                f"throughput_{a.script}_{a.env_id}_{a.network}_{device.type}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
