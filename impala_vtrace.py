"""IMPALA with V-trace: Espeholt, Soyer, Munos, Simonyan, Mnih, Ward, Doron, Firoiu, Harley, Dunning, Legg,
Kavukcuoglu (2018), "IMPALA: Scalable Distributed Deep-RL with Importance Weighted Actor-Learner Architectures".

Actors step many environments with a copy of the policy μ that may be several updates old and send whole unrolls,
with μ's logits, to a learner that trains on batches of them. V-trace corrects for the lag: its value targets use
truncated importance weights ρ_t = min(ρ̄, π/μ) and c_t = λ min(c̄, π/μ), and the policy gradient uses
ρ_t (r_t + γ v_{t+1} − V(x_t)). Losses are summed over time and batch, as in the paper (Table D.1 note).

| paper                                                          | here                                    |
|----------------------------------------------------------------|-----------------------------------------|
| Eq. (1) V-trace target v_s; Remark 1 (recursion); Remark 2 (λ) | `vtrace` -> vs                          |
| Sec. 4.2 policy gradient ρ_s ∇log π (r_s + γ v_{s+1} − V(x_s)) | `vtrace` -> pg_advantages, `learner_loss` |
| Sec. 4.2 value loss (v_s − V(x_s))², entropy bonus             | `learner_loss`                          |
| Fig. 1, Sec. 3: actors send unrolls + μ, learner batches       | `act`, `main`                           |
| Fig. 3: shallow / deep (ResNet) agent, optional LSTM           | `Agent` (parts in common/networks.py)   |
| Table G.1 Atari hyperparameters                                | `Args` defaults                         |
| Sec. 5.3 multi-task Atari; PopArt-IMPALA (Hessel et al. 2019)  | `--env-ids`, `--popart`                 |

Each learner (one, or K under torchrun, gradients summed in one all-reduce) starts `--num-actors` actor processes
that write unrolls into shared-memory slots, and publishes its weights after every update. The paper's headline
agent is the deep one (Fig. 3, Table 4), `--network deep`; the defaults run the shallow one, about 20x cheaper on a CPU.
Departures from the paper (initialisation, optimiser, learning rate and its horizon), measured: docs/impala_vtrace.md.

    python impala_vtrace.py --env-id Breakout-v5
    torchrun --nproc_per_node 2 impala_vtrace.py --env-id Pong-v5 --network deep --use-lstm
"""

import contextlib
import copy
import dataclasses
import hashlib
import itertools
import json
import os
import queue
import signal
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Literal, NamedTuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from common.envs import EpisodeTracker, UsageError, env_spec, is_atari, make_env, require, task_family
from common.evaluation import atari_games, evaluate_games_model, expand_env_ids, median_human_normalized
from common.evaluation import recurrent_policy, resume_checkpoint
from common.networks import LSTMCore, check_channels, dead_units, grad_norms_by_layer, init_output_, init_weights_
from common.networks import logits_std_across_states, make_torso
from common.popart import PopArt


@dataclass
class Args:
    env_id: str = "Breakout-v5"  # envpool task id (any discrete-action task: Atari *-v5, CartPole-v1, ...)
    env_ids: tuple[str, ...] = ()  # several Atari games, one agent (Sec. 5.3), or a preset (atari57, atari5)
    preset: Literal["family", "paper"] = "family"  # family: the env id's family defaults; paper: Table G.1 everywhere
    popart: Literal["auto", "on", "off"] = "auto"  # PopArt per game (Hessel et al. 2019); auto: on with --env-ids
    exp_name: str = "impala_vtrace"  # name of this experiment, part of the run folder's name
    seed: int = 1  # seed of torch, numpy and the envs (actor a of learner r: seed + 1000 r + a)
    torch_deterministic: bool = True  # torch.backends.cudnn.deterministic
    cuda: bool = True  # learner and actors' inference on the GPU when there is one
    cuda_actors: bool = True  # with --cuda, the actors act on the GPU too (--no-cuda-actors: on the CPU, no context)
    total_timesteps: int = 50_000_000  # environment steps in all (200M frames, Sec. 5.3)
    num_envs: int = 32  # environments per learner process, split evenly over its actors
    env_batch_size: int = 0  # envs per envpool step (async below envs per actor); 0: half of an actor's envs
    num_actors: int = 1  # actor processes per learner process (with --env-ids: one per game, envs rounded up to match)
    unroll_length: int = 20  # n, unroll length (Table G.1)
    batch_size: int = 32  # unrolls per learner batch, over all learner processes (Table G.1)
    learning_rate: float = 6e-4  # learning rate (Table G.1)
    lr_anneal_steps: int = 50_000_000  # steps to anneal over: 200M frames (Table G.1); 0: the run's length
    rmsprop_decay: float = 0.99  # RMSProp decay (the paper's code default)
    rmsprop_eps: float = 0.01  # RMSProp ε (Table G.1; its momentum: 0)
    max_grad_norm: float = 40.0  # global gradient-norm clipping threshold (Table G.1)
    gamma: float = 0.99  # γ, discount (Table G.1)
    baseline_cost: float = 0.5  # baseline loss scaling (Table G.1)
    entropy_cost: float = 0.01  # entropy regulariser (Table G.1)
    clip_rho_threshold: float = 1.0  # ρ̄, truncation of ρ_t in the V-trace target (Sec. 5.2.2)
    clip_pg_rho_threshold: float = 1.0  # ρ̄ of the policy-gradient importance weight (Sec. 4.2)
    clip_c_threshold: float = 1.0  # c̄, truncation of the trace coefficients c_i (Sec. 5.2.2)
    vtrace_lambda: float = 1.0  # λ of Remark 2 (1: plain V-trace)
    network: Literal["shallow", "deep"] = "shallow"  # pixel torso: shallow or deep ResNet (Fig. 3); vectors: an MLP
    channels: tuple[int, ...] = ()  # conv channels; empty: (16, 32) shallow, (16, 32, 32) deep (Fig. 3)
    use_lstm: bool = False  # LSTM core fed the previous action and reward (Fig. 3)
    lstm_size: int = 256  # LSTM hidden units (Fig. 3)
    save_model: bool = False  # write model.pt (weights and what evaluation needs) in the run folder
    capture_video: bool = False  # record the first evaluation episode (an animated PNG) in the run folder
    eval_episodes: int = 10  # evaluation episodes at the end of training (0: none)
    run_dir: str = "runs"  # folder of the run folders
    log_interval: float = 5.0  # seconds between console progress lines
    learner_threads: int = 0  # torch threads of a learner; 0: half the cores (the rest step the envs), the deep net all
    checkpoint_interval: float = 300.0  # seconds between checkpoints (also at the end and on Ctrl-C); 0: only then
    resume: str = ""  # a run folder to continue from its checkpoint.pt, with its own arguments


# Defaults by task family, the same on every device (a flag the user gives wins; `--preset paper`: Table G.1 as it is).
FAMILY_DEFAULTS = {
    "atari": (
        "Table G.1; 4x its learning rate for the shallow agent, measured on Breakout-v5 (docs)",
        dict(learning_rate=2.4e-3),
    ),
    "classic": (
        "settings measured on CartPole-v1 (docs)",
        dict(total_timesteps=300_000, num_envs=16, batch_size=8, learning_rate=3e-3, baseline_cost=0.1)
        | dict(lr_anneal_steps=0),
    ),
}
PAPER = "the paper's settings (the Args defaults)"  # the defaults' source without a family entry


def defaults_for(args, given=()) -> tuple[str, str, dict]:
    """(task family, the defaults' source, their values) of a run of `args`: its family's, none with `--preset paper`;
    with --env-ids one actor per game and the envs rounded up to match, unless `given`."""
    family = task_family(args.env_id)
    if args.preset == "paper":
        return family, PAPER + ", forced by --preset paper", {}
    source, values = FAMILY_DEFAULTS.get(family, (PAPER, {}))
    if family == "atari" and args.network == "deep":  # Table G.1's: at 4x the deep agent's policy turns deterministic
        values = {k: v for k, v in values.items() if k != "learning_rate"}
    if args.env_ids:
        actors = args.num_actors if "--num-actors" in given else len(expand_env_ids(args.env_ids))
        envs = args.num_envs if "--num-envs" in given else -(-values.get("num_envs", Args.num_envs) // actors) * actors
        source, values = source + "; --env-ids: an actor per game", {**values, "num_actors": actors, "num_envs": envs}
    return family, source, values


# ---------------------------------------------------------------------------------------------------------
# The paper's math: pure functions of time-major [T, B] tensors.


@torch.no_grad()
def vtrace(log_rhos, discounts, rewards, values, bootstrap_value, clip_rho_threshold=1.0, clip_pg_rho_threshold=1.0,
           clip_c_threshold=1.0, lambda_=1.0):  # fmt: skip
    """V-trace targets v_s (Eq. 1 via Remark 1, with λ of Remark 2) and policy-gradient advantages
    ρ_s (r_s + γ_s v_{s+1} − V(x_s)) (Sec. 4.2).

    log_rhos = log π(a_t|x_t) − log μ(a_t|x_t), discounts = γ (1 − done_t), rewards and values `[T, B]`;
    bootstrap_value = V(x_T) `[B]`. Returns (vs, pg_advantages).
    """
    rhos = torch.exp(log_rhos)
    clipped_rhos = rhos.clamp(max=clip_rho_threshold)
    cs = lambda_ * rhos.clamp(max=clip_c_threshold)
    values_tp1 = torch.cat([values[1:], bootstrap_value.unsqueeze(0)])
    deltas = clipped_rhos * (rewards + discounts * values_tp1 - values)
    vs, acc = values.clone(), torch.zeros_like(bootstrap_value)
    for t in reversed(range(values.shape[0])):  # v_s − V(x_s) = δ_s + γ_s c_s (v_{s+1} − V(x_{s+1}))
        acc = deltas[t] + discounts[t] * cs[t] * acc
        vs[t] += acc
    vs_tp1 = torch.cat([vs[1:], bootstrap_value.unsqueeze(0)])
    return vs, rhos.clamp(max=clip_pg_rho_threshold) * (rewards + discounts * vs_tp1 - values)


class VtraceLoss(NamedTuple):
    """learner_loss's result: the loss, its parts, diagnostics and the unnormalised V-trace targets v_s `[T, B]`."""

    loss: torch.Tensor
    policy_loss: torch.Tensor
    value_loss: torch.Tensor
    entropy_loss: torch.Tensor
    entropy: torch.Tensor
    rho_mean: torch.Tensor
    rho_clipped_fraction: torch.Tensor
    value_mean: torch.Tensor
    vs: torch.Tensor


def learner_loss(
    logits, values, batch, gamma, baseline_cost, entropy_cost, clips=(1.0, 1.0, 1.0), lambda_=1.0, popart=None
):
    """The V-trace actor-critic loss (Sec. 4.2), summed over time and batch; diagnostics are means over real steps.

    Rows 0..T of a batch of unrolls (row T only bootstraps): `logits` `[T+1, B, A]`, `values` `[T+1, B]`, and from
    `batch` the `action` taken at x_k, μ's `logits` there, and the `reward`, `terminated` and `ended` flags that came
    with x_k (`ended`: step k is envpool's reset step, no transition). `clips` = (ρ̄, ρ̄ of the policy gradient, c̄).
    With `popart`, `values` are its normalised outputs `[T+1, B, tasks]`: each row reads its task's output n, V =
    σ n + μ enters V-trace, the value loss is ½((v_s − μ)/σ − n)² and the policy-gradient advantage is divided by σ.
    """
    if popart is not None:
        task = batch["task"]
        values, mu, sigma = values.gather(-1, task.unsqueeze(-1)).squeeze(-1), popart.mu[task], popart.sigma[task]
    else:
        mu, sigma = torch.zeros_like(values), torch.ones_like(values)
    logp_all = F.log_softmax(logits[:-1], dim=-1)
    actions = batch["action"][:-1].unsqueeze(-1)
    logp = logp_all.gather(-1, actions).squeeze(-1)
    behaviour_logp = F.log_softmax(batch["logits"][:-1], dim=-1).gather(-1, actions).squeeze(-1)
    log_rhos = logp.detach() - behaviour_logp

    v = values.detach() * sigma + mu  # unnormalised values
    reset_step = batch["ended"][:-1]  # row k ended an episode: step k is envpool's reset step
    discounts = torch.where(reset_step, 0.0, gamma * (~batch["terminated"][1:]).float())
    rewards = torch.where(reset_step, v[:-1], batch["reward"][1:])  # zero TD error there: v_k = V(x_k)
    vs, pg_adv = vtrace(log_rhos, discounts, rewards, v[:-1], v[-1], *clips, lambda_)
    mask = (~reset_step).float()
    pg_loss = -(mask * pg_adv / sigma[:-1] * logp).sum()
    baseline_loss = baseline_cost * 0.5 * (mask * ((vs - mu[:-1]) / sigma[:-1] - values[:-1]) ** 2).sum()
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    entropy_loss = -entropy_cost * (mask * entropy).sum()
    n, rhos = mask.sum().clamp(min=1), log_rhos.exp()
    means = dict(entropy=entropy, rho_mean=rhos, rho_clipped_fraction=rhos > clips[0], value_mean=v[:-1])
    means = {k: (mask * x).sum() / n for k, x in means.items()}  # over the real steps
    parts = dict(policy_loss=pg_loss, value_loss=baseline_loss, entropy_loss=entropy_loss)
    return VtraceLoss(loss=sum(parts.values()), **parts, **means, vs=vs)


# ---------------------------------------------------------------------------------------------------------
# The agent (Fig. 3).


class Agent(nn.Module):
    """Torso, optional LSTM, linear policy logits and a linear value (with `popart`: PopArt's, one per task)."""

    def __init__(self, obs_shape, num_actions, network="shallow", channels=(), use_lstm=False, lstm_size=256,
                 num_tasks=1, popart=False):  # fmt: skip
        super().__init__()
        self.config = {k: v for k, v in locals().items() if k not in ("self", "__class__")}  # for model.pt
        self.torso = make_torso(obs_shape, network, channels or None)  # vectors: an MLP of 64, 64
        self.core = LSTMCore(self.torso.out_features, num_actions, lstm_size) if use_lstm else None
        features = self.core.out_features if use_lstm else self.torso.out_features
        self.policy = nn.Linear(features, num_actions)
        self.popart = PopArt(features, num_tasks, beta=3e-4) if popart else None  # β of Hessel et al. 2019
        self.value = None if popart else nn.Linear(features, 1)
        init_weights_(self)  # orthogonal, residual blocks at identity; PyTorch's default is state-blind on Atari
        init_output_(self.policy, 0.01)
        init_output_(self.popart.linear if popart else self.value, 1.0)

    def initial_state(self, batch_size, device=None):
        return self.core.initial_state(batch_size, device) if self.core is not None else ()

    def forward(self, obs, prev_action, prev_reward, first, state=()):
        """Time-major inputs `[T, B, ...]`; returns logits `[T, B, A]`, values `[T, B]` (with PopArt: normalised,
        `[T, B, num_tasks]`) and the core state."""
        T, B = first.shape
        x = self.torso(obs.reshape(T * B, *obs.shape[2:]))
        if self.core is not None:
            x, state = self.core(x.view(T, B, -1), prev_action, prev_reward, first, state)
        values = self.value(x).view(T, B) if self.popart is None else self.popart(x).view(T, B, -1)
        return self.policy(x).view(T, B, -1), values, state


# ---------------------------------------------------------------------------------------------------------
# Acting (Fig. 1). Row t of an unroll holds obs_t, the reward and end flags that came with obs_t, the action taken
# at obs_t and μ's logits there. An unroll has T+1 rows; its last row is also the first row of the env's next one.


def act(cfg, link: "ActorChannel") -> None:
    """An actor: the latest published policy μ acts in each batch of envs envpool returns and sends full unrolls."""
    n, device = cfg.num_envs, torch.device(cfg.device)
    envs = make_env(cfg.env_id, n, cfg.seed, cfg.env_batch_size, num_threads=cfg.env_threads, **cfg.env_options)
    agent = link.local_agent(n, cfg.unroll_length, device)
    ended, prev_action = np.zeros(n, bool), np.zeros(n, np.int64)
    state, tracker = agent.initial_state(n, device), EpisodeTracker(n)
    envs.async_reset()
    while True:
        obs, reward, term, trunc, info = envs.recv()
        ids = info["env_id"]
        version = link.refresh(agent)
        ids_dev, first = torch.from_numpy(ids).long().to(device, non_blocking=True), torch.from_numpy(ended[ids])
        obs_t, reward_t = torch.from_numpy(obs), torch.from_numpy(reward).float()
        prev = torch.from_numpy(np.where(ended[ids], 0, prev_action[ids]))
        state_before = tuple(s[ids_dev] for s in state)
        with torch.no_grad():
            inputs = (x.to(device, non_blocking=True)[None] for x in (obs_t, prev, reward_t, first))  # no stream sync
            logits, _, state_after = agent(*inputs, state_before)
            action = torch.distributions.Categorical(logits=logits[0], validate_args=False).sample().cpu()  # one sync
        envs.send(action.numpy(), ids)  # the envs step while this process does the bookkeeping
        done = term | trunc
        row = dict(obs=obs_t, reward=reward_t, ended=torch.from_numpy(done), terminated=torch.from_numpy(term))
        row.update(first=first, action=action, prev_action=prev, logits=logits[0].cpu())
        row.update(version=torch.full((len(ids),), version), task=torch.full((len(ids),), cfg.task))
        core = dict(zip(("core_h", "core_c"), (s.cpu() for s in state_before)))  # empty without an LSTM
        for s, s_new in zip(state, state_after):
            s[ids_dev] = s_new
        link.write(ids, row, core)
        prev_action[ids], ended[ids] = action.numpy(), done
        for _, score, length in tracker.step(ids, reward, term, trunc, info):
            link.episode_q.put((score, length, cfg.task))


# ---------------------------------------------------------------------------------------------------------
# Learning: the learner's step, then setup, the learner's loop (Fig. 1's learner), the end.


def learner_step(state, batch, args, diagnose=False):
    """One update on a batch of unrolls (Sec. 3, 4.2), the training state's `update`-th. Returns the logits and the
    stats (`diagnose`: each layer's gradient norm too, before clipping)."""
    agent, optimizer = state["agent"], state["optimizer"]
    state["update"] += 1
    core = (batch["core_h"], batch["core_c"]) if args.use_lstm else ()
    logits, values, _ = agent(batch["obs"], batch["prev_action"], batch["reward"], batch["first"], core)
    clips = (args.clip_rho_threshold, args.clip_pg_rho_threshold, args.clip_c_threshold)
    costs = dict(baseline_cost=args.baseline_cost, entropy_cost=args.entropy_cost)
    vtrace_settings = dict(clips=clips, lambda_=args.vtrace_lambda, popart=agent.popart)
    out = learner_loss(logits, values, batch, args.gamma, **costs, **vtrace_settings)
    optimizer.zero_grad(set_to_none=False)
    out.loss.backward()
    reduce_gradients(agent.parameters(), mean=False)  # the loss sums over the batch: the global batch's sum
    layers = {f"grad_norm/{name}": v for name, v in grad_norms_by_layer(agent).items()} if diagnose else {}
    grad_norm, stats = nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm), loss_stats(out)
    check_finite("in an update", loss=out.loss, gradient=grad_norm, **{k.split("/")[1]: v for k, v in stats.items()})
    stats |= {"stats/grad_norm": grad_norm, "charts/learning_rate": optimizer.param_groups[0]["lr"], **layers}
    optimizer.step()
    state["schedule"].step()
    if agent.popart is not None:
        real = ~batch["ended"][:-1]
        agent.popart.update(out.vs[real], batch["task"][:-1][real])
    return logits, stats


def main(args: Args):
    args, resumed = resume_checkpoint(args.resume, os.path.basename(__file__), Args) if args.resume else (args, None)
    spec, games = check_args(args)
    use_popart = args.popart == "on" or (args.popart == "auto" and len(games) > 0)
    args = dataclasses.replace(args, env_ids=tuple(games), popart="on" if use_popart else "off")
    rank, world, device = learner_process(args)
    num_actions = 18 if games else int(spec.action_space.n)  # the full Atari action set for many games
    net = dict(network=args.network, channels=args.channels, use_lstm=args.use_lstm, lstm_size=args.lstm_size)
    agent = Agent(spec.observation_space.shape, num_actions, **net, num_tasks=max(1, len(games)), popart=use_popart)
    agent = agent.to(device)
    same_start(agent)
    steps_per_update = args.batch_size * args.unroll_length
    num_updates = args.total_timesteps // steps_per_update
    state = load_state(dict(agent=agent, **make_optimizer(args, agent, num_updates), update=0), resumed)
    describe = f"device {device}, {world} learner process(es), {args.num_actors * world} actor process(es), "
    describe += f"{args.num_envs * world} envs" + (f", {len(games)} games" if games else "") + ", PopArt" * use_popart
    log = RunLog(args, resumed, describe, f"{len(games)}games" if games else None, write=rank == 0)
    specs, cfgs = buffer_specs(spec.observation_space, num_actions, args), actor_configs(args, rank, device, games)
    pool, stop = ActorPool(cfgs, agent, specs, args.batch_size // world, device), Stop()
    try:
        while state["update"] < num_updates:
            batch = pool.next_batch(stop, log if rank == 0 else None, state["update"] * steps_per_update)
            if any_learner(batch is None, device):  # a stop: every learner after the same update
                break
            diagnose = rank == 0 and (log.due() or state["update"] + 1 == num_updates)
            logits, stats = learner_step(state, batch, args, diagnose)
            pool.publish(agent.state_dict())
            log_update(log, pool, agent, state["update"] * steps_per_update, stats if diagnose else None, logits, batch)
            if rank == 0 and log.save_due():
                save(log, state)
        if rank == 0:  # the last update (after a stop: the one in hand)
            save(log, state)
    except (WorkerError, NonFiniteError) as e:
        exit_failed(e, log.path)
    finally:
        pool.close()
    step = state["update"] * steps_per_update
    if rank == 0 and state["update"] == num_updates:
        eval_mean, extra = evaluate_games_model(log, saved_model(args, agent, step), make_eval_policy, device)
        log.end(step, eval_mean, **extra)
    if world > 1:
        torch.distributed.destroy_process_group()
    if state["update"] < num_updates:
        exit_stopped(log if rank == 0 else None, step, world)


def make_optimizer(args, agent, num_updates) -> dict:
    """RMSProp (Table G.1) with its mean square bias-corrected, i.e. Adam without momentum: PyTorch's RMSprop starts
    it at 0, so that its first steps are up to 10x the steady ones, and they turned the deep agent's policy
    deterministic (docs). The learning rate anneals linearly to 0 over the paper's 50M steps, or the run if longer."""
    optimizer = torch.optim.Adam(agent.parameters(), args.learning_rate, (0.0, args.rmsprop_decay), args.rmsprop_eps)
    anneal_updates = max(num_updates, args.lr_anneal_steps // (args.batch_size * args.unroll_length))
    return dict(
        optimizer=optimizer, schedule=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1 - k / anneal_updates)
    )


def save(log, state) -> None:
    """checkpoint.pt: the training state, once found finite; model.pt with --save-model."""
    step, saved = state["update"] * log.args.batch_size * log.args.unroll_length, state_dicts(state)
    check_finite("in the weights", **{f"agent.{k}": v for k, v in saved["agent"].items() if v.is_floating_point()})
    log.save(step, saved, saved_model(log.args, state["agent"], step) if log.args.save_model else None)


def log_update(log, pool, agent, step, stats, logits, batch) -> None:
    """Rank 0, after each update: the episodes the actors finished; with `stats` (every --log-interval seconds), the
    learner's diagnostics (docs/impala_vtrace.md, "Logged metrics") and the console line."""
    episodes = pool.take_episodes()
    if log.writer is None:
        return
    games = log.args.env_ids
    for score, length, task in episodes:
        log.episode(score, length, step, games[task] if games else None)
    if stats is None:
        return
    lag = pool.version.item() - 1 - batch["version"][:-1].float().mean()  # updates behind, of the acting policy
    with torch.no_grad():
        stats["stats/dead_units"] = dead_units(agent.torso(batch["obs"][:-1].flatten(0, 1)))
    stats.update({"stats/logits_std_across_states": logits_std_across_states(logits[:-1]), "stats/policy_lag": lag})
    for k, game in enumerate(games if agent.popart is not None else ()):
        stats |= {f"stats/popart_sigma/{game}": agent.popart.sigma[k], f"stats/popart_mu/{game}": agent.popart.mu[k]}
    stats.update(median_human_normalized(log.groups, games))
    log.scalars(stats, step)
    log.console(step, f"entropy {stats['stats/entropy']:.2f} | lag {lag:.1f}")


def make_eval_policy(checkpoint, num_envs, device="cpu", greedy=False):
    """`policy(obs, rewards, first) -> actions` of a saved model (LSTM state kept, rewards clipped as in training)."""
    agent = Agent(**checkpoint["agent_config"]).to(device)
    agent.load_state_dict(checkpoint["agent"])
    return recurrent_policy(agent, num_envs, device, greedy, checkpoint["reward_clip"])


def saved_model(args, agent, global_step):
    """What model.pt holds (evaluate.py and `make_eval_policy` play it)."""
    games, weights = args.env_ids, {k: v.cpu() for k, v in agent.state_dict().items()}
    model = dict(script="impala_vtrace", env_id=games[0] if games else args.env_id, env_ids=list(games))
    model.update(full_action_space=bool(games), args=dataclasses.asdict(args), agent_config=agent.config)
    return dict(model, agent=weights, reward_clip=bool(games) or is_atari(args.env_id), global_step=global_step)


def buffer_specs(observation_space, num_actions, args) -> dict:
    """The unroll buffers `act` fills: name → (shape of one slot, dtype); with an LSTM its state before each slot."""
    T, obs_dtype = args.unroll_length, torch.uint8 if observation_space.dtype == np.uint8 else torch.float32
    specs = dict(obs=((T + 1, *observation_space.shape), obs_dtype), logits=((T + 1, num_actions), torch.float32))
    specs.update({k: ((T + 1,), torch.bool) for k in ("ended", "terminated", "first")}, reward=((T + 1,), torch.float))
    specs.update({k: ((T + 1,), torch.long) for k in ("action", "prev_action", "version", "task")})
    specs.update({k: ((args.lstm_size,), torch.float32) for k in ("core_h", "core_c") if args.use_lstm})
    return specs


def check_args(args):
    """Bad input: one clear line before any work (UsageError). Returns the (first) game's spec and the games."""
    games, world, steps = atari_games(args.env_ids, args.env_id), world_size(), args.batch_size * args.unroll_length
    spec = env_spec(games[0] if games else args.env_id, discrete=True)
    per_actor = args.num_envs // max(args.num_actors, 1)
    actors = f"--num-actors {args.num_actors}" + " (with --env-ids: one per game unless given)" * bool(games)
    require(not games or args.num_actors % len(games) == 0, f"{actors} must be a multiple of the number of games")
    require(args.unroll_length >= 1, f"--unroll-length must be at least 1, got {args.unroll_length}")
    require(args.batch_size % world == 0, f"--batch-size {args.batch_size}: not a multiple of the learners ({world})")
    fits = 0 < args.num_actors <= args.num_envs and per_actor * args.num_actors == args.num_envs
    require(fits, f"--num-envs {args.num_envs} must be a positive multiple of {actors}")
    require(0 <= args.env_batch_size <= per_actor, f"--env-batch-size: 0 (half) to the envs per actor ({per_actor})")
    require(args.total_timesteps >= steps, f"--total-timesteps is less than one batch (batch x unroll = {steps} steps)")
    require(args.lr_anneal_steps >= 0, f"--lr-anneal-steps must be steps, or 0 (the run's), not {args.lr_anneal_steps}")
    check_channels(args.network, args.channels)
    return spec, games


# ---------------------------------------------------------------------------------------------------------
# The run machinery: one text, copied verbatim into every script that needs it (tests/test_common.py checks that
# the copies are identical). Besides its arguments it reads the script's own `Args` (and `args.network` where there
# is one), `defaults_for`, `main`, `act` and `__file__`, by name.


class Stop:
    """Ctrl-C or SIGTERM: `requested`, and the run stops after the update in hand; a second Ctrl-C exits at once (130).
    A SIGTERM after the first signal (torchrun's, after the terminal's Ctrl-C) waits."""

    def __init__(self):
        self.requested = False
        signal.signal(signal.SIGINT, self.on_signal)
        signal.signal(signal.SIGTERM, self.on_signal)

    def on_signal(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            os._exit(130)
        self.requested = True
        print("stopping after the update in hand (Ctrl-C again: at once)", file=sys.stderr, flush=True)


class NonFiniteError(RuntimeError):
    """A loss, gradient or parameter became NaN or infinite: the run stops before it spoils its checkpoint."""


def check_finite(where: str, **named) -> None:
    """NonFiniteError naming the first of `named` (tensors or numbers) with a NaN or an infinity (one host sync)."""
    flags = [torch.isfinite(torch.as_tensor(v).detach()).all() for v in named.values()]
    ok = torch.stack([f.to(flags[0].device) for f in flags])
    if not bool(ok.all()):
        raise NonFiniteError(f"non-finite {list(named)[int((~ok).int().argmax())]} {where}")


class WorkerError(RuntimeError):
    """A worker process raised (its traceback), died (its exit code) or ended before its learner."""


def exit_failed(error: Exception, run_path: str) -> None:
    """A failed worker or a non-finite value: the error line, where the last good checkpoint is, exit status 1 (the
    caller's `finally` ends the workers first; torchrun stops the other learners)."""
    print(f"error: {error}", file=sys.stderr)
    if "NonFiniteError" in f"{type(error).__name__} {error}":  # here, or in a worker's traceback
        path = os.path.join(run_path, "checkpoint.pt")
        step = torch.load(path, map_location="cpu", weights_only=False)["global_step"] if os.path.isfile(path) else None
        kept = f"the last good checkpoint (step {step}) is kept: continue with --resume {run_path}, or start again"
        advice = kept if step is not None else "no checkpoint was written before it"
        print(f"{advice}: try a lower --learning-rate", file=sys.stderr, flush=True)
    sys.exit(1)


def exit_stopped(log, step: int, world: int = 1) -> None:
    """The end of a stopped run whose last update is saved: how to continue, then exit status 130 (a second Ctrl-C is
    ignored from here: the interpreter's shutdown releases the queues' semaphores)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if log is not None:  # rank 0
        log.writer.close()
        again = f"torchrun --standalone --nproc_per_node {world}" if world > 1 else "python"
        hint = f"continue with {again} {os.path.basename(__file__)} --resume {log.path}"
        print(f"checkpoint at step {step}: {hint}", file=sys.stderr, flush=True)
    sys.exit(130)


def load_state(state: dict, resumed) -> dict:
    """The training state (modules, optimisers, generators, counters) set to `--resume`'s checkpoint, if any; a
    generator whose saved state was written on another device (a CPU's is 5,056 bytes, CUDA's 16) is seeded from it."""
    for k, part in state.items() if resumed else ():
        if isinstance(part, torch.Generator) and resumed[k].numel() != part.get_state().numel():
            part.manual_seed(int.from_bytes(hashlib.sha256(resumed[k].numpy().tobytes()).digest()[:8], "little"))
        elif isinstance(part, torch.Generator):
            part.set_state(resumed[k])
        elif hasattr(part, "load_state_dict"):
            part.load_state_dict(resumed[k])
        else:
            state[k] = resumed[k]
    return state


def state_dicts(state: dict) -> dict:
    """The training state as a checkpoint holds it: each part's state_dict or a generator's state, counters as is."""
    saved = {k: part.state_dict() if hasattr(part, "state_dict") else part for k, part in state.items()}
    return {k: part.get_state() if isinstance(part, torch.Generator) else saved[k] for k, part in state.items()}


def loss_stats(result) -> dict:
    """A loss's named tuple as TensorBoard tags: `losses/<name>` for its parts, `stats/<name>` for other scalars."""
    items = [(k, v.detach()) for k, v in result._asdict().items() if k != "loss" and v.dim() == 0]
    return {(f"losses/{k}" if k.endswith("loss") else f"stats/{k}"): v for k, v in items}


def world_size(local: bool = False) -> int:  # local: the learners on this machine
    return int(os.environ.get("LOCAL_WORLD_SIZE" if local else "WORLD_SIZE", "1"))


def learner_process(args):
    """(rank, world, device) of this learner: its device and threads, the process group under torchrun, seeds,
    determinism."""
    rank, world, local_rank = int(os.environ.get("RANK", "0")), world_size(), int(os.environ.get("LOCAL_RANK", "0"))
    gpus = torch.cuda.device_count() if args.cuda else 0
    device, backend, threads = placement(args, local_rank, world_size(local=True), gpus, os.cpu_count() or 2)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before the process group: NCCL, pinned memory and streams use it
    if world > 1:
        torch.distributed.init_process_group(backend)
    torch.manual_seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    torch.set_num_threads(threads)
    return rank, world, device


def placement(args, local_rank: int, local_world: int, gpus: int, cores: int):
    """(device, process-group backend, torch threads) of learner `local_rank` of `local_world` on a machine with
    `gpus` GPUs and `cores` cores. GPU `local_rank` mod `gpus` (learners may share one); NCCL where each learner has
    a GPU of its own, else gloo (NCCL refuses two ranks on one GPU; gloo all-reduces CUDA tensors too). Threads: one
    where the work is on a GPU (it launches the kernels: the cores step the envs); on a CPU, of the learner's share
    of the cores, all with the deep ResNet (its actors need a fifth of its time: benchmarks), else half."""
    if args.cuda and gpus > 0:
        device, backend = torch.device("cuda", local_rank % gpus), "nccl" if local_world <= gpus else "gloo"
    else:
        device, backend = torch.device("cpu"), "gloo"
    share = max(1, cores // local_world)
    threads = 1 if device.type == "cuda" else share if getattr(args, "network", "") == "deep" else share // 2
    return device, backend, args.learner_threads or max(1, threads)


def same_start(*modules) -> None:
    """Under torchrun: every learner starts from rank 0's parameters."""
    for p in [p for m in modules for p in m.parameters()] if world_size() > 1 else ():
        torch.distributed.broadcast(p.data, 0)


def reduce_gradients(params, mean: bool) -> None:
    """Under torchrun: the gradients summed over the learners (`mean`: averaged) in one all-reduce (not DDP's: a
    loss that moves PopArt's layer runs outside it)."""
    if world_size() > 1:
        params = list(params)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        torch.distributed.all_reduce(flat)
        for p, g in zip(params, flat.div_(world_size() if mean else 1).split([p.numel() for p in params])):
            p.grad.copy_(g.view_as(p))


def any_learner(flag: bool, device) -> bool:
    """Whether `flag` holds in any learner process: under torchrun every learner stops after the same update."""
    if world_size() == 1:
        return flag
    flag = torch.tensor([float(flag)], device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


def start_workers(target, per_worker, *args):
    """A process per item of `per_worker` running `target(item, *args)`, deaf to Ctrl-C and SIGTERM from the start."""
    ignored = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}  # inherited by them
    run = (target, per_worker, *args)
    workers = torch.multiprocessing.start_processes(run_worker, run, len(per_worker), join=False, start_method="spawn")
    for s, handler in ignored.items():
        signal.signal(s, handler)
    return workers


def run_worker(i, target, per_worker, *args):
    """Worker process i of torch's `start_processes` (its `join` brings a traceback back): it dies with the process
    that started it, one torch thread."""
    torch.multiprocessing._prctl_pr_set_pdeathsig(signal.SIGKILL)  # torch asks for SIGINT, which workers ignore
    if torch.multiprocessing.parent_process().is_alive():  # else the parent died before the line above
        torch.set_num_threads(1)
        target(per_worker[i], *args)


def check_workers(workers, what: str = "worker") -> int:
    """WorkerError if a worker raised (its traceback) or died, torch's `join` having stopped the others; else the
    number of workers that have ended."""
    try:
        workers.join(timeout=0, grace_period=2.0)
    except torch.multiprocessing.ProcessRaisedException as e:  # a header line, then the traceback
        raise WorkerError(f"{what} {e.error_index} failed:" + str(e).partition("following error:")[2]) from None
    except torch.multiprocessing.ProcessExitedException as e:
        raise WorkerError(f"{what} {e.error_index} died with exit code {e.exit_code}") from None
    return sum(p.exitcode == 0 for p in workers.processes)


def end_workers(workers) -> None:
    """Kills the worker processes and waits for each: none is left running, and the exit has none to wait for."""
    for p in workers.processes:
        p.kill()
        p.join()


def actor_configs(args, rank, device, games=(), **env_options) -> list[SimpleNamespace]:
    """The actors of learner `rank`: actor a plays game a mod G (every game the same share, all 18 actions), its
    envs stepped `--env-batch-size` at a time (0: half of them) by the cores the learner leaves free."""
    n, tasks = args.num_envs // args.num_actors, list(games) or [args.env_id]
    threads = max(1, ((os.cpu_count() or 2) // world_size(local=True) - torch.get_num_threads()) // args.num_actors)
    options = {**env_options, "full_action_space": True} if games else env_options
    shared = dict(num_envs=n, unroll_length=args.unroll_length, env_batch_size=args.env_batch_size or max(1, n // 2))
    shared.update(device=str(device) if args.cuda_actors else "cpu", env_threads=threads, env_options=options)
    return [
        SimpleNamespace(env_id=tasks[a % len(tasks)], task=a % len(tasks), seed=args.seed + 1000 * rank + a, **shared)
        for a in range(args.num_actors)
    ]


@dataclass
class ActorChannel:
    """What an actor shares with its learner (the published network, its version, the unroll slots and queues), and
    the actor's side of the slots: `write(ids, row, core_state)` stores a row for each env in `ids` (any subset:
    envpool's async mode); a slot that reaches T+1 rows goes to the learner and its env goes on in a free slot whose
    row 0 is the full one's row T. `core_state` (the LSTM state before the row) is kept where a row opens a slot."""

    agent: nn.Module
    version: torch.Tensor
    buffers: dict
    free_q: object
    full_q: object
    episode_q: object

    def local_agent(self, num_envs: int, unroll_length: int, device):
        """In the actor: its copy of the published network; a free slot for each of its envs."""
        self.T, self.seen, agent = unroll_length, -1, copy.deepcopy(self.agent).to(device)
        self.slot, self.pos = np.array([self.free_q.get() for _ in range(num_envs)]), np.zeros(num_envs, np.int64)
        self.refresh(agent)
        return agent

    def refresh(self, agent) -> int:
        """Loads the published network into `agent` if the learner has published since; returns its version."""
        latest = int(self.version.item())
        if latest != self.seen:
            agent.load_state_dict(self.agent.state_dict())
            self.seen = latest
        return latest

    def write(self, ids, row, core_state=None):
        buffers, T, core_state = self.buffers, self.T, core_state or {}
        slots, pos = torch.from_numpy(self.slot[ids]), torch.from_numpy(self.pos[ids])
        for k, v in row.items():
            buffers[k][slots, pos] = v
        start = pos == 0  # rows that open a slot: the LSTM state before them is kept
        for k, v in core_state.items():
            buffers[k][slots[start]] = v[start]
        self.pos[ids] += 1
        for i in np.flatnonzero(self.pos[ids] == T + 1):
            e, new = ids[i], self.free_q.get()
            for k in row:
                buffers[k][new, 0] = buffers[k][self.slot[e], T]
            for k, v in core_state.items():  # row T's state opens the next slot
                buffers[k][new] = v[i]
            self.full_q.put(int(self.slot[e]))
            self.slot[e], self.pos[e] = new, 1


class ActorPool:
    """The learner's side: one process per config running `act`, batches of full unrolls, publication, episodes."""

    def __init__(self, cfgs, agent, specs, batch_size, device):
        ctx = torch.multiprocessing.get_context("spawn")
        self.batch_size, self.device = batch_size, device
        num_slots = sum(cfg.num_envs for cfg in cfgs) + 4 * batch_size
        buffers = {k: torch.zeros((num_slots, *shape), dtype=dt).share_memory_() for k, (shape, dt) in specs.items()}
        shared, version = copy.deepcopy(agent).cpu().share_memory(), torch.zeros(1, dtype=torch.long).share_memory_()
        self.link = ActorChannel(shared, version, buffers, ctx.Queue(), ctx.Queue(), ctx.Queue())
        self.agent, self.version = shared, version  # the network the actors act with, and how often it was published
        for i in range(num_slots):
            self.link.free_q.put(i)
        self.link.free_q.cancel_join_thread()  # an exit does not wait to flush it to actors that are gone
        self.workers = start_workers(act, cfgs, self.link)

    def next_batch(self, stop, log=None, step=0):
        """`batch_size` unrolls `[T+1, B, ...]` on the learner's device (`core_*`: `[B, ...]`), or None once a stop is
        requested; progress lines while they are collected (`log`); WorkerError if an actor died or ended."""
        idx = []
        while len(idx) < self.batch_size and not stop.requested:
            with contextlib.suppress(queue.Empty):
                idx.append(self.link.full_q.get(timeout=1.0))
            if check_workers(self.workers, "actor"):
                raise WorkerError("an actor ended before its learner")
            if log is not None:
                log.console(step, f"collecting a batch: {len(idx)}/{self.batch_size} unrolls", waiting=True)
        if stop.requested:
            return None
        batch = {k: v[torch.tensor(idx)] for k, v in self.link.buffers.items()}
        for i in idx:
            self.link.free_q.put(i)
        batch = {k: v if k.startswith("core_") else v.transpose(0, 1) for k, v in batch.items()}
        pin = self.device.type == "cuda"
        return {k: (v.pin_memory() if pin else v).to(self.device, non_blocking=True) for k, v in batch.items()}

    def publish(self, weights):
        """Copies `weights` (a state_dict) into the network the actors act with; they load it at their next step."""
        self.agent.load_state_dict(weights)
        self.version += 1

    def take_episodes(self) -> list:
        """What the actors put on `episode_q` (an episode's score and length, ...) since the last call."""
        episodes = []
        while not self.link.episode_q.empty():
            episodes.append(self.link.episode_q.get())
        return episodes

    def close(self):
        end_workers(self.workers)


def parse_args(argv=None):
    """tyro's flags over the defaults `defaults_for` gives the run (none on `--resume`: the run keeps its own
    arguments): a flag given wins, and `--help` shows the values a run would take."""
    import tyro

    argv = sys.argv[1:] if argv is None else list(argv)
    first, _ = tyro.cli(Args, args=argv, add_help=False, return_unknown_args=True)  # --env-id, --preset, ...
    given = {a.split("=")[0].replace("_", "-") for a in argv if a.startswith("--")}
    overrides = {} if first.resume else defaults_for(first, given)[2]
    return tyro.cli(Args, args=argv, default=dataclasses.replace(Args(), **overrides))


class RunLog:
    """The run folder (new, or `--resume`'s, whose checkpoint `resumed` gives the step, returns and wall time to go on
    from): args.json, TensorBoard, the console line, checkpoint.pt, summary.json; `write`: False in ranks above 0."""

    def __init__(self, args, resumed, describe, name=None, write=True):
        resumed, self.args, self.writer = resumed or {}, args, None
        self.returns, self.groups = list(resumed.get("returns", [])), dict(resumed.get("groups", {}))
        self.episodes = resumed.get("episodes", len(self.returns))
        self.start_step, self.previous_wall = resumed.get("global_step", 0), resumed.get("wall_time_s", 0.0)
        self.start = self.last_line = self.last_wait = self.last_save = time.time()
        self.name = name or args.env_id
        name = os.path.join(args.run_dir, f"{self.name}__{args.exp_name}__{args.seed}__{int(self.start)}")
        self.path = args.resume or name
        if not write:
            return
        for k in itertools.count(2):  # a run started in the same second takes `<name>_2`, ...
            try:
                os.makedirs(self.path, exist_ok=bool(args.resume))  # atomic: two runs never share a folder
                break
            except FileExistsError:
                self.path = f"{name}_{k}"
        family, source, values = defaults_for(args)
        values = {k.replace("_", "-"): " ".join(map(str, v)) if isinstance(v, tuple) else v for k, v in values.items()}
        source += ": " + ", ".join(f"{k} {v}" for k, v in values.items()) if values else ""
        with open(os.path.join(self.path, "args.json"), "w") as f:
            json.dump({**dataclasses.asdict(args), "task_family": family, "defaults_from": source}, f, indent=2)
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(self.path, purge_step=self.start_step + 1 if resumed else None)
        print(f"task family: {family}; defaults: {source}\nrun folder: {self.path}  ({describe})")

    def scalars(self, values: dict, step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, float(value), step)

    def episode(self, score, length, step, group=None) -> None:
        self.returns.append(score)
        self.episodes += 1
        self.scalars({"charts/episodic_return": score, "charts/episodic_length": length}, step)
        if group is not None:
            self.groups.setdefault(group, []).append(score)
            self.scalars({f"charts/{group}/episodic_return": score}, step)

    def due(self) -> bool:
        """Time for the console line (and the diagnostics that go with it): every --log-interval seconds."""
        return time.time() - self.last_line >= self.args.log_interval

    def console(self, step: int, extra: str = "", waiting=False) -> None:
        """The progress line (step, SPS, recent return, episodes so far, ETA) and charts/SPS; `waiting` (for a batch,
        say): a line at most every --log-interval seconds (and 5 s) since any other, leaving `due` to the update's."""
        now, recent = time.time(), f"{np.mean(self.returns[-100:]):.1f}" if self.returns else "n/a"
        if waiting and now - max(self.last_line, self.last_wait) < max(self.args.log_interval, 5.0):
            return
        sps = (step - self.start_step) / max(now - self.start, 1e-9)
        left = f"{max(self.args.total_timesteps - step, 0) / sps / 60:.1f} min" if sps > 0 else "n/a"
        line = f"step {step:>10d}/{self.args.total_timesteps} | SPS {sps:7.0f} | return(100) {recent:>8} "
        print(line + f"| episodes {self.episodes}{' | ' + extra if extra else ''} | ETA {left}", flush=True)
        if waiting:
            self.last_wait = now
        elif self.writer is not None:
            self.scalars({"charts/SPS": sps}, step)
            self.last_line = now

    def save(self, step: int, state: dict, model: dict = None) -> None:
        """checkpoint.pt: the training `state`, the log's own and the arguments (and model.pt with --save-model, first:
        a checkpoint on disk has its model), each through a temporary file and a rename: a killed run keeps its last."""
        wall = self.previous_wall + time.time() - self.start
        log = dict(global_step=step, returns=self.returns[-100:], groups={g: r[-10:] for g, r in self.groups.items()})
        log.update(episodes=self.episodes, wall_time_s=wall, args=dataclasses.asdict(self.args))
        log["script"] = os.path.basename(__file__)
        self.writer.flush()  # first too: a checkpoint on disk has the curves up to it, which a resumed run continues
        for name, obj in (("model.pt", model), ("checkpoint.pt", {**state, **log})):
            if obj is not None:
                torch.save(obj, os.path.join(self.path, name + ".tmp"))
                os.replace(os.path.join(self.path, name + ".tmp"), os.path.join(self.path, name))
        self.last_save = time.time()

    def save_due(self) -> bool:
        return 0 < self.args.checkpoint_interval <= time.time() - self.last_save

    def end(self, step: int, eval_mean=None, **extra) -> dict:
        """summary.json (the house keys and the script's `extra`; the wall time and SPS up to the final checkpoint, not
        through the evaluation); closes the TensorBoard writer."""
        end = self.last_save  # the final checkpoint, saved after the last update
        summary = dict(env_id=self.name, total_timesteps=step, wall_time_s=self.previous_wall + end - self.start)
        summary.update(sps=(step - self.start_step) / max(end - self.start, 1e-9), eval_mean_return=eval_mean)
        summary.update(mean_episodic_return_last_100=float(np.mean(self.returns[-100:])) if self.returns else None)
        with open(os.path.join(self.path, "summary.json"), "w") as f:
            json.dump({**summary, **extra}, f, indent=2)
        self.writer.close()
        return {**summary, **extra}


def cli():
    """tyro's flags, the run's defaults for the flags not given, bad input as one line (exit status 2)."""
    try:
        main(parse_args())
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    cli()
