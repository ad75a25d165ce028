"""Training throughput against raw envpool stepping, measured in one run on one machine.

    python benchmarks/throughput.py --env-id Breakout-v5 --num-envs 32 --timesteps 100000

    python benchmarks/throughput.py --script vmpo_atari --env-id Breakout-v5 --num-envs 32 --timesteps 100000 \
        -- --network shallow --no-use-lstm --batch-size 32 --unroll-length 20
    python benchmarks/throughput.py --script vmpo_mujoco --env-id HalfCheetah-v4 --num-envs 64 --unroll-length 39 \
        --timesteps 500000 -- --batch-size 64 --preset paper

Four figures, in environment steps per second (SPS; frames are 4x that on Atari):
1. raw envpool: random actions, the same env, number of envs and async batch as the training run;
2. a synchronous loop with the script's own agent and loss and the same batch: step all envs with the policy
   for an unroll, then one learner update (one pass over the batch), then the next unroll: no overlap of
   acting and learning;
3. the same loop with a PPO-style learner (4 epochs of 4 minibatches per batch, CleanRL's Atari settings);
4. the script itself (`--script`), from a run of `--timesteps` steps: steady state (`steady_sps`: from its
   `charts/SPS` curve, after the start-up) and with start-up (process spawn, first batch) included (summary.json).
The script's network arguments after `--` (`--network`, `--no-use-lstm`, `--channels`) are given to the
synchronous loops too. Prints a Markdown table and writes it as JSON next to this file (or to --out).

A3C and ACER have no learner to batch: `--script a3c --workers 1 2 4` (or `--script acer`) measures how their
Hogwild workers scale with cores
instead, each count against raw envpool stepping the same number of environments (`--num-envs` per worker):

    python benchmarks/throughput.py --script a3c --env-id CartPole-v1 --num-envs 4 --workers 1 2 --timesteps 300000

P3S-TD3 the same way, the whole population against `--num-learners 1` (plain TD3), `--timesteps` per learner:

    python benchmarks/throughput.py --script p3s_td3 --env-id HalfCheetah-v4 --num-envs 1 --learners 1 2 4 \
        --timesteps 6000 -- --t-initial 1000

Every script in one run, each with the settings of `all_settings` (the throughput table of benchmarks/README.md):

    python benchmarks/throughput.py --script all [--cuda]
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
    space = envs.action_space
    envs.async_reset()
    steps, t0 = 0, None
    while True:
        _, _, _, _, info = envs.recv()
        ids = info["env_id"]
        if hasattr(space, "n"):
            envs.send(np.random.randint(0, space.n, len(ids)), ids)
        else:
            envs.send(np.random.uniform(space.low, space.high, (len(ids), *space.shape)).astype(np.float32), ids)
        steps += len(ids)
        if t0 is None and steps >= 4 * num_envs:  # warm-up
            t0, steps = time.time(), 0
        if t0 is not None and time.time() - t0 >= seconds:
            return steps / (time.time() - t0)


def make_learner(script, envs, network, script_args, device):
    """The script's agent and optimiser as `(optimizer, policy_step, loss_fn)`: `policy_step(obs, state)` gives
    `(env_actions, row, state)` with what the script stores per step, `loss_fn(batch)` the script's loss."""
    spec = envs.spec
    if script in ("impala_vtrace", "vmpo_atari"):
        obs_shape, num_actions = spec.observation_space.shape, envs.action_space.n
        if script == "impala_vtrace":
            import impala_vtrace as m

            args = m.Args(network=network, use_lstm=script_args.get("use_lstm", False))
            agent = m.Agent(obs_shape, num_actions, network, args.channels, args.use_lstm).to(device)
            opt = torch.optim.Adam(agent.parameters(), lr=1e-4, betas=(0.0, 0.99), eps=0.01)  # its RMSProp
            costs = (args.gamma, args.baseline_cost, args.entropy_cost)
            loss = lambda logits, values, mb: m.learner_loss(logits, values, mb, *costs).loss  # noqa: E731
        else:
            import vmpo_atari as m

            args = m.Args(
                network=network, use_lstm=script_args.get("use_lstm", True), channels=script_args.get("channels", ())
            )
            agent = m.Agent(obs_shape, num_actions, network, args.channels, args.use_lstm).to(device)
            multipliers = m.LagrangeMultipliers().to(device)
            opt = torch.optim.Adam([*agent.parameters(), *multipliers.parameters()], lr=1e-4)
            loss = lambda logits, feats, mb: m.batch_loss(logits, feats, mb, agent, multipliers, args)[0].loss  # noqa: E731

        def policy_step(obs, state):
            z = torch.zeros(1, obs.shape[0], device=device)
            state = agent.initial_state(obs.shape[0], device) if state is None else state
            with torch.no_grad():
                logits, _, state = agent(torch.as_tensor(obs, device=device)[None], z.long(), z, z.bool(), state)
            a = torch.distributions.Categorical(logits=logits[0]).sample()
            return (
                a.cpu().numpy(),
                {"obs": torch.as_tensor(obs, device=device), "action": a, "logits": logits[0]},
                state,
            )

        def loss_fn(mb):
            T1, B = mb["action"].shape
            z = torch.zeros(T1, B, device=device)
            logits, out, _ = agent(mb["obs"], z.long(), mb["reward"], z.bool(), agent.initial_state(B, device))
            return loss(logits, out, mb)
    elif script == "vmpo_mujoco":
        import copy

        import vmpo_mujoco as m
        from common.envs import flat_obs_dim, flatten_obs

        args = m.Args()
        agent = m.Agent(flat_obs_dim(spec), envs.action_space.shape[0], args.hidden, squash=args.squash).to(device)
        target = copy.deepcopy(agent)  # θ_target: acts, and gives π_target's Gaussian on the batch
        multipliers = m.LagrangeMultipliers().to(device)
        opt = torch.optim.Adam([*agent.parameters(), *multipliers.parameters()], lr=1e-4)
        low, high = envs.action_space.low, envs.action_space.high
        updates = [0]

        def policy_step(obs, state):
            o = torch.as_tensor(flatten_obs(obs), device=device)
            with torch.no_grad():
                mean, std, _ = target(o)
            a = mean + std * torch.randn_like(mean)
            return m.to_env_action(target.box_action(a).cpu().numpy(), low, high), {"obs": o, "action": a}, state

        def loss_fn(mb):
            """learner_step's loss on a minibatch of unrolls: λ-returns from the online V (PopArt moved), then
            vmpo_loss on the flattened states against θ_target, refreshed every T_target calls."""
            multipliers.project()  # after the previous Adam step, as learner_step does
            if updates[0] % args.target_update_period == 0:
                target.load_state_dict(agent.state_dict())
            updates[0] += 1
            agent.obs_norm.update(mb["obs"][:-1])
            returns, _ = m.value_targets(agent, mb, args, move_popart=True)
            flat = lambda x: x[:-1].transpose(0, 1).reshape(-1, *x.shape[2:])  # noqa: E731  [T+1, B] -> [B·T]
            obs = flat(mb["obs"])
            with torch.no_grad():
                target_mean, target_std, _ = target(obs)
            mean, std, feats = agent(obs)
            value_norm = agent.popart(feats)[..., 0]
            returns_norm = agent.popart.normalize(returns.transpose(0, 1).reshape(-1), 0)
            B = mb["obs"].shape[1]
            groups = args.num_minibatches if B % args.num_minibatches == 0 else 1
            gaussians = (mean, std, target_mean, target_std, flat(mb["action"]))
            duals = (*multipliers.parameters(), args.eps_eta, args.eps_alpha_mu, args.eps_alpha_sigma)
            settings = dict(num_minibatches=groups, projection=args.projection, regression_coef=args.regression_coef)
            return m.vmpo_loss(*gaussians, value_norm, returns_norm, ~flat(mb["ended"]), *duals, **settings).loss
    else:
        raise SystemExit(f"error: unknown --script {script!r}")
    return opt, policy_step, loss_fn


def sync_loop_sps(script, env_id, num_envs, unroll, network, script_args, seconds, device, epochs=1, minibatches=1):
    """Acting then learning, in turn, with the script's agent and loss (on-policy); with epochs=4,
    minibatches=4 the learner does the work of PPO's Atari settings (4 epochs of 4 minibatches per batch)."""
    envs = make_env(env_id, num_envs, seed=0)
    opt, policy_step, loss_fn = make_learner(script, envs, network, script_args, device)
    obs, _ = envs.reset()
    state = None
    steps, t0 = 0, None
    while True:
        rows = {}
        reward = np.zeros(num_envs, np.float32)
        ended = np.zeros(num_envs, bool)
        term = np.zeros(num_envs, bool)
        for _ in range(unroll + 1):
            actions, row, state = policy_step(obs, state)
            row.update(
                reward=torch.as_tensor(reward, device=device),
                ended=torch.as_tensor(ended, device=device),
                terminated=torch.as_tensor(term, device=device),
            )
            for k, v in row.items():
                rows.setdefault(k, []).append(v)
            obs, reward, term, trunc, _ = envs.step(actions)
            reward = reward.astype(np.float32)
            ended = term | trunc
            steps += num_envs
        batch = {k: torch.stack(v) for k, v in rows.items()}
        B = num_envs
        batch["task"] = torch.zeros(unroll + 1, B, dtype=torch.long, device=device)  # one game (PopArt's output 0)
        for _ in range(epochs):
            for cols in torch.randperm(B).chunk(minibatches):
                mb = {k: v[:, cols] for k, v in batch.items()}
                loss = loss_fn(mb)
                opt.zero_grad()
                loss.backward()
                opt.step()
        if t0 is None:
            t0, steps = time.time(), 0
        elif time.time() - t0 >= seconds:
            return steps / (time.time() - t0)


def script_command(script, env_id, num_envs, timesteps, network, extra, run_dir):
    """The command line of the script's run: `--timesteps` steps, no evaluation, its run folder in `run_dir`."""
    net = ["--network", network] if script in ("impala_vtrace", "vmpo_atari") else []
    return [
        sys.executable,
        os.path.join(ROOT, f"{script}.py"),
        "--env-id",
        env_id,
        "--num-envs",
        str(num_envs),
        "--total-timesteps",
        str(timesteps),
        *net,
        "--eval-episodes",
        "0",
        "--run-dir",
        run_dir,
        *extra,
    ]


def script_extra(a, count=None):
    """The script's own flags: the benchmark's `extra`, the unroll length (actor/learner scripts) or the process
    count (`--num-workers`, `--num-learners`), and `--no-cuda` without `--cuda` (a3c and acer have no GPU)."""
    if a.script in ("a3c", "acer"):
        return ["--num-workers", str(count), *a.extra]
    cuda = [] if a.cuda else ["--no-cuda"]
    if a.script == "p3s_td3":
        return ["--num-learners", str(count), *a.extra, *cuda]
    return ["--unroll-length", str(a.unroll_length), *a.extra, *cuda]


def script_sps(script, env_id, num_envs, timesteps, network, extra):
    """(SPS with the start-up, steady SPS) of a run of the script: summary.json's, and `steady_sps`."""
    with tempfile.TemporaryDirectory() as d:
        cmd = script_command(script, env_id, num_envs, timesteps, network, extra, d)
        subprocess.run([*cmd, "--log-interval", "1"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        run = os.path.dirname(glob.glob(os.path.join(d, "*", "summary.json"))[0])
        return json.load(open(os.path.join(run, "summary.json")))["sps"], steady_sps(run)


def steady_sps(run):
    """Steps per second between the first and the last point of a run's `charts/SPS` curve (its console lines): after
    the start-up (process spawn, the first batch), up to the end of training."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    curves = EventAccumulator(run, size_guidance={"scalars": 0})
    curves.Reload()
    first, last = curves.Scalars("charts/SPS")[0], curves.Scalars("charts/SPS")[-1]
    return (last.step - first.step) / (last.wall_time - first.wall_time)


def process_scaling(a):
    """SPS of a3c.py against its number of workers, or of p3s_td3.py against its number of learners, each count
    next to raw envpool stepping as many environments (`--num-envs` per process)."""
    unit, counts = ("workers", a.workers) if a.script in ("a3c", "acer") else ("learners", a.learners)
    rows = []
    for w in counts:
        envs = w * a.num_envs
        raw = raw_envpool_sps(a.env_id, envs, max(1, envs // 2), a.seconds)
        total, steady = script_sps(
            a.script,
            a.env_id,
            a.num_envs,
            a.timesteps * w,
            None,
            script_extra(a, w),
        )
        rows.append(
            {
                unit: w,
                "envs_per_process": a.num_envs,
                "raw_envpool_sps": raw,
                "script_sps": steady,
                "script_sps_with_startup": total,
                "script_over_raw": steady / raw,
            }
        )
    device = "cuda" if a.cuda and torch.cuda.is_available() else "cpu"
    print(
        f"| {unit} | envs per process | raw envpool (same envs) | {a.script}.py | script / raw | "
        f"speed-up over {counts[0]} |\n|---|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r[unit]} | {r['envs_per_process']} | {r['raw_envpool_sps']:.0f} | {r['script_sps']:.0f} "
            f"({r['script_sps_with_startup']:.0f} with start-up) | {r['script_over_raw']:.3f} | "
            f"{r['script_sps'] / rows[0]['script_sps']:.2f} |"
        )
    result = {"script": a.script, "env_id": a.env_id, "machine": machine_name(device), "script_args": a.extra}
    result["rows"] = rows
    out = a.out or os.path.join(ROOT, "benchmarks", f"throughput_{a.script}_{a.env_id}_{a.num_envs}envs_{device}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    return result


def machine_name(device):
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores" + (
        f", {torch.cuda.get_device_name()}" if device == "cuda" else ""
    )


# `--script all`: one setting per script, the task of its paper (Atari, MuJoCo), sized for a short run. On the GPU
# machine the actor/learner scripts get 64 envs and the Hogwild scripts one worker per core (a3c, acer: CPU only).
def all_settings(cuda):
    cores = os.cpu_count() or 1
    envs = 64 if cuda else 32
    atari = dict(env_id="Breakout-v5", num_envs=envs, network="shallow", unroll_length=20, timesteps=64_000)
    return [
        dict(script="impala_vtrace", **atari, extra=[]),
        dict(
            script="vmpo_atari",
            **atari,
            extra=["--no-use-lstm", "--batch-size", str(envs), "--num-minibatches", "1"],
        ),
        # the papers' own agents: IMPALA's deep ResNet (Fig. 3), with its LSTM, and V-MPO's ResNet + LSTM (App. F) at
        # IMPALA's channels; learning-bound on a CPU, so a short run
        dict(script="impala_vtrace", **{**atari, "network": "deep", "timesteps": 6_400}, extra=[]),
        dict(script="impala_vtrace", **{**atari, "network": "deep", "timesteps": 6_400}, extra=["--use-lstm"]),
        dict(
            script="vmpo_atari",
            **{**atari, "network": "deep", "timesteps": 3_200},
            extra=["--use-lstm", "--channels", "16", "32", "32", "--batch-size", str(envs), "--num-minibatches", "1"],
        ),
        dict(
            script="vmpo_mujoco",
            env_id="HalfCheetah-v4",
            num_envs=64,
            network="mlp",
            unroll_length=39,
            timesteps=300_000,
            extra=["--batch-size", "64"],
        ),
        dict(script="a3c", env_id="Breakout-v5", num_envs=1, workers=sorted({1, cores}), timesteps=20_000, extra=[]),
        dict(script="acer", env_id="Breakout-v5", num_envs=1, workers=sorted({1, cores}), timesteps=10_000, extra=[]),
        dict(
            script="p3s_td3",
            env_id="HalfCheetah-v4",
            num_envs=1,
            learners=[1, 4],
            timesteps=3_000,
            extra=["--t-initial", "1000", "--learning-starts", "1000"],  # updates from 1,000 rows (default 10,000)
        ),
    ]


def measure_all(a):
    """Every script of `all_settings`, one after the other, each against raw envpool measured in the same run; one
    table with the ratio of each script (and of each process count of the Hogwild and population scripts)."""
    device = "cuda" if a.cuda and torch.cuda.is_available() else "cpu"
    table = []
    for setting in all_settings(a.cuda):
        b = argparse.Namespace(**{**vars(a), "out": os.path.join(tempfile.gettempdir(), "throughput_one.json")})
        b.__dict__.update(setting)
        print(f"\n## {b.script} on {b.env_id}", flush=True)
        result = process_scaling(b) if b.script in ("a3c", "acer", "p3s_td3") else actor_learner(b)
        for r in result.get("rows", [result]):
            count = next((f"{r[k]} {k}" for k in ("workers", "learners") if k in r), f"{b.num_envs} envs")
            table.append(
                {
                    "script": b.script,
                    "env_id": b.env_id,
                    "setting": f"{count}, {r.get('envs_per_process', b.num_envs)} env(s) each"
                    if "envs_per_process" in r
                    else f"{count}, {result['network']}",
                    "script_args": b.extra,
                    "raw_envpool_sps": r["raw_envpool_sps"],
                    "script_sps": r["script_sps"],
                    "script_over_raw": r["script_over_raw"],
                    "script_over_sync": r.get("script_over_sync"),
                }
            )
    print(
        "\n| script | env | setting | raw envpool | script | script / raw | script / sync |\n"
        "|---|---|---|---|---|---|---|"
    )
    for r in table:
        sync = f"{r['script_over_sync']:.2f}" if r["script_over_sync"] is not None else "–"
        print(
            f"| {r['script']} | {r['env_id']} | {r['setting']} | {r['raw_envpool_sps']:.0f} | {r['script_sps']:.0f} | "
            f"{r['script_over_raw']:.3f} | {sync} |"
        )
    out = a.out or os.path.join(ROOT, "benchmarks", f"throughput_all_{device}.json")
    with open(out, "w") as f:
        json.dump({"machine": machine_name(device), "rows": table}, f, indent=2)


def actor_learner(a):
    """The actor/learner scripts (impala_vtrace, vmpo_atari, vmpo_mujoco): raw envpool, the two synchronous loops
    and the script, one after the other."""
    device = torch.device("cuda" if a.cuda and torch.cuda.is_available() else "cpu")
    script_args = {}
    if "--no-use-lstm" in a.extra or "--use-lstm" in a.extra:
        script_args["use_lstm"] = "--use-lstm" in a.extra
    if "--channels" in a.extra:
        rest = a.extra[a.extra.index("--channels") + 1 :]
        script_args["channels"] = tuple(
            int(c) for c in rest[: next((i for i, c in enumerate(rest) if c.startswith("--")), len(rest))]
        )
    raw = raw_envpool_sps(a.env_id, a.num_envs, max(1, a.num_envs // 2), a.seconds)
    sync = sync_loop_sps(a.script, a.env_id, a.num_envs, a.unroll_length, a.network, script_args, a.seconds, device)
    ppo = sync_loop_sps(
        a.script, a.env_id, a.num_envs, a.unroll_length, a.network, script_args, a.seconds, device, 4, 4
    )
    total, steady = script_sps(a.script, a.env_id, a.num_envs, a.timesteps, a.network, script_extra(a))
    network = a.network if a.script in ("impala_vtrace", "vmpo_atari") else "mlp"
    machine = machine_name(device.type)
    result = {
        "script": a.script,
        "env_id": a.env_id,
        "num_envs": a.num_envs,
        "network": network,
        "script_args": a.extra,
        "machine": machine,
        "raw_envpool_sps": raw,
        "sync_loop_sps": sync,
        "sync_ppo_style_sps": ppo,
        "script_sps": steady,
        "script_sps_with_startup": total,
        "script_over_raw": steady / raw,
        "script_over_sync": steady / sync,
        "script_over_ppo_style": steady / ppo,
    }
    print(
        f"| script | env | envs | network | machine | raw envpool | sync 1 pass | sync PPO-style | script | "
        f"script / raw | script / sync | script / PPO-style |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n"
        f"| {a.script} | {a.env_id} | {a.num_envs} | {network} | {machine} | {raw:.0f} | {sync:.0f} | {ppo:.0f} | "
        f"{steady:.0f} ({total:.0f} with start-up) | {steady / raw:.2f} | {steady / sync:.2f} | {steady / ppo:.2f} |"
    )
    out = a.out or os.path.join(ROOT, "benchmarks", f"throughput_{a.script}_{a.env_id}_{network}_{device.type}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--script",
        default="impala_vtrace",
        choices=["impala_vtrace", "vmpo_atari", "vmpo_mujoco", "a3c", "acer", "p3s_td3", "all"],
    )
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="a3c, acer: worker counts to measure")
    p.add_argument("--learners", type=int, nargs="+", default=[1, 2, 4], help="p3s_td3: learner counts to measure")
    p.add_argument("--env-id", default="Breakout-v5")
    p.add_argument("--num-envs", type=int, default=32)
    p.add_argument("--network", default="shallow", help="Atari scripts' torso (vmpo_mujoco has its MLP)")
    p.add_argument("--unroll-length", type=int, default=20)
    p.add_argument("--seconds", type=float, default=20.0, help="length of the raw and synchronous measurements")
    p.add_argument("--timesteps", type=int, default=100_000, help="length of the script's run (a3c: per worker)")
    p.add_argument("--cuda", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("extra", nargs="*", help="more arguments of the script, after --")
    a = p.parse_args()
    if a.script == "all":
        return measure_all(a)
    if a.script in ("a3c", "acer", "p3s_td3"):
        return process_scaling(a)
    return actor_learner(a)


if __name__ == "__main__":
    main()
