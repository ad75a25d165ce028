"""V-MPO for discrete actions: Song, Abdolmaleki, Springenberg, Clark, Soyer, Rae, Noury, Ahuja, Liu, Tirumala,
Heess, Belov, Riedmiller, Botvinick (2020), "V-MPO: On-Policy Maximum a Posteriori Policy Optimization for
Discrete and Continuous Control".

An approximate policy iteration: a *target* network acts in the environments and stays fixed for T_target
learning steps; the *online* network learns its value from n-step returns and improves its policy in two steps.
The E-step weights the top half of the batch's advantages by exp(A/η), the temperature η a Lagrange multiplier
keeping ψ within ε_η of the data; the M-step fits the policy to ψ by weighted maximum likelihood inside a KL trust
region KL(π_target ‖ π_online) < ε_α kept by a second multiplier α. PopArt keeps the value loss on one scale.

| paper                                                                  | here                                        |
|------------------------------------------------------------------------|---------------------------------------------|
| Algorithm 1: target network, refreshed every T_target steps            | `act`, `pool.publish` in `main`             |
| Eq. (1) n-step returns G^(n) from the online V, L_V, A = G − V; PopArt | `n_step_returns`, `vmpo_loss`; `batch_loss` |
| Eqs. (10), (12)-(13) ψ on the top half of A, L_π; L_η; their sum       | `vmpo_weights`, `vmpo_loss`                 |
| Eq. (14) KL trust region L_α with stop-gradients                       | `categorical_kl`, `kl_constraint_loss`      |
| Sec. 4.2.2: η, α ≥ η_min = α_min = 1e-8 after every step               | `LagrangeMultipliers` (`--multipliers`)     |
| Fig. 1b, App. F: ResNet (64, 128, 128), LSTM, 256-unit MLP heads       | `Agent`                                     |
| Tables 1 and 6: initial η, α; ε_η, ε_α; γ; T_target                    | `Args` defaults                             |

Multi-task: `--env-ids` (Table 4), one PopArt output per game. `--preset paper` runs the paper's ResNet + LSTM agent;
Atari's defaults run a shallow one without an LSTM, 20x cheaper on a CPU. What departs from the paper (softplus
multipliers, initialisation, Atari's settings, an LSTM for the Transformer-XL): docs/vmpo_atari.md.

    python vmpo_atari.py --env-id Breakout-v5
    torchrun --nproc_per_node 2 vmpo_atari.py --env-id Pong-v5 --num-envs 128
"""

import collections
import contextlib
import copy
import dataclasses
import hashlib
import itertools
import json
import math
import os
import queue
import signal
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Literal

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from common.envs import EpisodeTracker, UsageError, env_spec, is_atari, make_env, require, require_in, task_family
from common.evaluation import atari_games, evaluate_games_model, expand_env_ids, median_human_normalized
from common.evaluation import recurrent_policy, resume_checkpoint
from common.networks import LSTMCore, check_channels, dead_units, grad_norms_by_layer, init_output_, init_weights_
from common.networks import logits_std_across_states, make_torso
from common.popart import PopArt


@dataclass
class Args:
    env_id: str = "Breakout-v5"  # envpool task id (any discrete-action task: Atari *-v5, CartPole-v1, ...)
    env_ids: tuple[str, ...] = ()  # several Atari games, one agent (Table 4), or a preset (atari57, atari5)
    preset: Literal["family", "paper"] = "family"  # family: the env id's family defaults; paper: the paper's everywhere
    exp_name: str = "vmpo_atari"  # name of this experiment, part of the run folder's name
    seed: int = 1  # seed of torch, numpy and the envs (actor a of learner r: seed + 1000 r + a)
    torch_deterministic: bool = True  # torch.backends.cudnn.deterministic
    cuda: bool = True  # learner and actors' inference on the GPU when there is one
    cuda_actors: bool = True  # with --cuda, the actors act on the GPU too (--no-cuda-actors: on the CPU, no context)
    total_timesteps: int = 50_000_000  # environment steps in all (200M frames at action repeat 4)
    num_envs: int = 64  # environments per learner process, split evenly over its actors
    env_batch_size: int = 0  # envs per envpool step (async below envs per actor); 0: half of an actor's envs
    num_actors: int = 1  # actor processes per learner process (with --env-ids: one per game, envs rounded up to match)
    unroll_length: int = 63  # n, unroll length (Appendix F, Atari)
    batch_size: int = 128  # B, unrolls per learning step, over all learner processes (Appendix F, Atari)
    num_minibatches: int = 8  # minibatches, each with its own top half and ψ: the paper's 8 replicas (App. F)
    target_update_period: int = 1000  # T_target, learning steps between target refreshes (Table 6; 100 multi-task)
    learning_rate: float = 1e-4  # Adam learning rate (Sec. 4.3)
    gamma: float = 0.997  # γ, agent discount (Table 6, single-task; 0.99 multi-task)
    eps_eta: float = 0.1  # ε_η, bound of the temperature dual: KL of ψ from the data (Table 6)
    eps_alpha: float = 0.007  # ε_α, bound of KL(π_target ‖ π_online) (Table 6: the middle of [0.005, 0.01))
    init_eta: float = 1.0  # initial η, temperature (Table 1)
    init_alpha: float = 5.0  # initial α, KL multiplier (Table 1)
    multipliers: Literal["paper", "softplus"] = "paper"  # paper: projected parameters; softplus: Acme's MPO (docs)
    dual_learning_rate: float = 0.0  # learning rate of η and α; 0: the networks' Adam and learning rate (Sec. 4.3)
    update_epochs: int = 1  # gradient steps on each batch, all against its π_target (1: Algorithm 1's one step)
    popart_beta: float = 1e-4  # PopArt statistics step size (Sec. 4.1)
    reward_clip: bool = False  # Atari: clip training rewards to [-1, 1] (Table 6: multi-task only)
    episodic_life: bool = False  # Atari: a lost life ends the training episode (Table 6: multi-task only)
    network: Literal["deep", "shallow"] = "deep"  # pixel torso: deep ResNet (App. F) or shallow; vectors: an MLP
    channels: tuple[int, ...] = ()  # conv channels; empty: (64, 128, 128) deep (App. F), (16, 32) shallow
    use_lstm: bool = True  # LSTM core fed the previous action and reward (Fig. 1b)
    lstm_size: int = 256  # LSTM hidden units (App. F)
    head_hidden: int = 256  # hidden units of the policy and value MLP heads (App. F)
    save_model: bool = False  # write model.pt (weights, PopArt statistics, what evaluation needs) in the run folder
    capture_video: bool = False  # record the first evaluation episode (an animated PNG) in the run folder
    eval_episodes: int = 10  # evaluation episodes at the end of training (0: none)
    run_dir: str = "runs"  # folder of the run folders
    log_interval: float = 5.0  # seconds between console progress lines
    learner_threads: int = 0  # torch threads of a learner; 0: half the cores (the rest step the envs), the deep net all
    checkpoint_interval: float = 300.0  # seconds between checkpoints (also at the end and on Ctrl-C); 0: only then
    resume: str = ""  # a run folder to continue from its checkpoint.pt, with its own arguments


# Defaults by task family, the same on every device (a flag given wins; `--preset paper`: the Args defaults).
FAMILY_DEFAULTS = {
    "atari": (
        "settings measured on Breakout-v5 on 2 CPU cores (docs; --preset paper: the paper's agent and batch)",
        dict(network="shallow", use_lstm=False, num_envs=32, batch_size=32, num_minibatches=1, unroll_length=20)
        | dict(target_update_period=10, learning_rate=1e-3, multipliers="softplus", dual_learning_rate=1e-2)
        | dict(episodic_life=True, gamma=0.99, update_epochs=4),
    ),
    "classic": (
        "settings measured on CartPole-v1 (docs)",
        dict(total_timesteps=300_000, num_envs=16, batch_size=16, num_minibatches=1, unroll_length=20)
        | dict(use_lstm=False, gamma=0.99, target_update_period=10, learning_rate=1e-3),
    ),
}
PAPER = "the paper's settings (the Args defaults)"  # the defaults' source without a family entry


def defaults_for(args, given=()) -> tuple[str, str, dict]:
    """(task family, the defaults' source, their values) of `args`; --env-ids: an actor per game unless `given`."""
    family = task_family(args.env_id)
    if args.preset == "paper":
        return family, PAPER + ", forced by --preset paper", {}
    source, values = FAMILY_DEFAULTS.get(family, (PAPER, {}))
    network = args.network if "--network" in given or not given else values.get("network")  # `given`: args not final
    if family == "atari" and network == "deep":  # the deep torso froze at the shallow agent's 1e-3 (docs)
        source, values = source + "; --network deep: learning-rate 3e-4", {**values, "learning_rate": 3e-4}
    if args.env_ids:
        actors = args.num_actors if "--num-actors" in given else len(expand_env_ids(args.env_ids))
        envs = args.num_envs if "--num-envs" in given else -(-values.get("num_envs", Args.num_envs) // actors) * actors
        source, values = source + "; --env-ids: an actor per game", {**values, "num_actors": actors, "num_envs": envs}
    return family, source, values


# ---------------------------------------------------------------------------------------------------------
# The paper's math: pure functions of time-major [T, B] tensors.


@torch.no_grad()
def n_step_returns(rewards, discounts, bootstrap_value):
    """Eq. (1): G_ℓ = Σ_{k=ℓ}^{n-1} (Π_{i=ℓ}^{k-1} γ_i) r_k + (Π_{i=ℓ}^{n-1} γ_i) V(s_n) for every ℓ of an unroll
    of length n, with per-step discounts γ_i = γ (1 − done_i). `[T, B]` inputs, bootstrap_value `[B]`."""
    acc, out = bootstrap_value, []
    for t in reversed(range(rewards.shape[0])):
        acc = rewards[t] + discounts[t] * acc
        out.append(acc)
    return torch.stack(out[::-1])


def vmpo_weights(advantages, eta, eps_eta, mask=None):
    """The E-step, Eqs. (12)-(13): ψ(s, a) = exp(A(s, a)/η) / Σ_{D̃} exp(A/η) on the k = ⌊|D|/2⌋ ≥ 1
    highest advantages D̃ (`topk`: ties cannot let more in), 0 elsewhere, with no gradient; L_η = η ε_η +
    η log((1/|D̃|) Σ_{D̃} exp(A/η)), differentiable in η only. `mask` (bool) leaves samples out of D."""
    adv = advantages.detach().reshape(-1)
    valid = torch.ones_like(adv, dtype=torch.bool) if mask is None else mask.reshape(-1).bool()
    n = int(valid.sum())
    if n == 0:
        return torch.zeros_like(advantages), eta * eps_eta
    k = max(1, n // 2)
    top_values, top_index = adv.masked_fill(~valid, -math.inf).topk(k)
    weights = torch.softmax(top_values / eta.detach(), dim=0)
    psi = torch.zeros_like(adv).scatter(0, top_index, weights).view_as(advantages)
    eta_loss = eta * eps_eta + eta * (torch.logsumexp(top_values / eta, dim=0) - math.log(k))
    return psi, eta_loss


def categorical_kl(target_logits, online_logits):
    """KL(π_target ‖ π_online) per state, `[..., A] -> [...]`; π_target carries no gradient."""
    target_logp = F.log_softmax(target_logits.detach(), dim=-1)
    online_logp = F.log_softmax(online_logits, dim=-1)
    return (target_logp.exp() * (target_logp - online_logp)).sum(-1)


def kl_constraint_loss(kl, alpha, eps_alpha, mask=None):
    """Eq. (14): L_α = (1/|D|) Σ_D [ α (ε_α − sg[KL]) + sg[α] KL ] over the full batch D: the first term moves α, the
    second is the trust region on the policy with α held fixed. Returns (loss, mean KL)."""
    m = torch.ones_like(kl) if mask is None else mask.float()
    kl_mean = (m * kl).sum() / m.sum().clamp(min=1)
    return alpha * (eps_alpha - kl_mean.detach()) + alpha.detach() * kl_mean, kl_mean


# vmpo_loss's result: the loss, its four parts and diagnostics, KL(π_target ‖ π), KL(ψ ‖ uniform on D̃), the entropy.
VmpoLoss = collections.namedtuple("VmpoLoss", "loss value_loss policy_loss eta_loss alpha_loss kl kl_psi entropy")


class LagrangeMultipliers(nn.Module):
    """η (Eq. 13) and α (Eq. 14) as `values()`: form "paper", the parameters themselves, projected to at least η_min
    after every step (Sec. 4.2.2); "softplus" (Acme's MPO), softplus(parameter) + η_min, which needs no projection."""

    def __init__(self, eta=1.0, alpha=5.0, form="paper", minimum=1e-8):
        super().__init__()
        self.form, self.minimum = form, minimum
        inverse = (lambda v: math.log(math.expm1(max(v - minimum, 1e-12)))) if form == "softplus" else float
        self.eta, self.alpha = (nn.Parameter(torch.tensor(inverse(float(v)))) for v in (eta, alpha))

    def values(self):
        raw = (self.eta, self.alpha)
        return raw if self.form == "paper" else tuple(F.softplus(p) + self.minimum for p in raw)

    @torch.no_grad()
    def project(self):
        for p in self.parameters() if self.form == "paper" else ():
            p.clamp_(min=self.minimum)


class Agent(nn.Module):
    """Fig. 1b: a torso (ResNet for pixels, MLP for vectors), an LSTM fed the previous action and reward, MLP heads."""

    def __init__(self, obs_shape, num_actions, network="deep", channels=(), use_lstm=True, lstm_size=256,
                 head_hidden=256, num_tasks=1, popart_beta=1e-4, mlp_hidden=(64, 64)):  # fmt: skip
        super().__init__()
        channels = tuple(channels) or ((64, 128, 128) if network == "deep" else ())  # deep: 4x IMPALA's (App. F)
        self.config = {k: v for k, v in locals().items() if k not in ("self", "__class__")}  # for model.pt
        self.torso = make_torso(obs_shape, network, channels or None, mlp_hidden)
        self.core = LSTMCore(self.torso.out_features, num_actions, lstm_size) if use_lstm else None
        n = self.core.out_features if use_lstm else self.torso.out_features
        self.policy_mlp = nn.Sequential(nn.Linear(n, head_hidden), nn.ReLU())
        self.policy = nn.Linear(head_hidden, num_actions)
        self.value_mlp = nn.Sequential(nn.Linear(n, head_hidden), nn.ReLU())
        self.popart = PopArt(head_hidden, num_tasks, popart_beta)  # σ in [1e-2, 1e6] (Sec. 4.1)
        init_weights_(self)  # orthogonal, gain √2, zero biases, residual blocks at identity (not in the paper)
        init_output_(self.popart.linear, 1.0)
        init_output_(self.policy, 0.0)  # a uniform policy at the start (App. F)

    def initial_state(self, batch_size, device=None):
        return self.core.initial_state(batch_size, device) if self.core is not None else ()

    def forward(self, obs, prev_action, prev_reward, first, state=()):
        """Time-major `[T, B, ...]`: logits, the value head's features (`self.popart` reads them) and the core state."""
        T, B = first.shape
        x = self.torso(obs.reshape(T * B, *obs.shape[2:]))
        if self.core is not None:
            x, state = self.core(x.view(T, B, -1), prev_action, prev_reward, first, state)
        x = x.reshape(T, B, -1)
        return self.policy(self.policy_mlp(x)), self.value_mlp(x), state


# ---------------------------------------------------------------------------------------------------------
# Acting (Algorithm 1: the target network acts). Row t of an unroll holds obs_t, the reward and end flags that came
# with obs_t, the action taken at obs_t and the target policy's logits there. An unroll has T+1 rows; its last row
# is also the first row of the env's next one.


def act(cfg, link: "ActorChannel") -> None:
    """Algorithm 1, 'use π_θtarget to act': the target network acts in each batch of envs that envpool returns."""
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


def learner_step(state, batch, args, diagnose=False):
    """Algorithm 1's update, the state's `update`-th: Adam steps on the gradient averaged over minibatches (PopArt
    moved by each on the first pass), the multipliers kept positive. Returns the last step's stats (and diagnostics)."""
    agent, multipliers, optimizer, world = state["agent"], state["multipliers"], state["optimizer"], world_size()
    state["update"] += 1
    chunks = args.num_minibatches // world
    for epoch in range(args.update_epochs):
        optimizer.zero_grad(set_to_none=False)
        stats = {}
        for cols in torch.arange(batch["obs"].shape[1], device=batch["obs"].device).chunk(chunks):
            mb = {k: v[cols] if k in ("core_h", "core_c") else v[:, cols] for k, v in batch.items()}
            core = (mb["core_h"], mb["core_c"]) if args.use_lstm else ()
            logits, value_features, _ = agent(mb["obs"], mb["prev_action"], mb["reward"], mb["first"], core)
            beta = args.popart_beta / chunks if epoch == 0 else 0.0
            out, mb_stats = batch_loss(logits, value_features, mb, agent, multipliers, args, beta)
            (out.loss / chunks).backward()
            stats = {k: stats.get(k, 0) + v / chunks for k, v in mb_stats.items()}
        reduce_gradients([*agent.parameters(), *multipliers.parameters()], mean=True)
        stats["stats/grad_norm"] = nn.utils.clip_grad_norm_(agent.parameters(), float("inf"))  # the paper clips none
        check_finite(f"at update {state['update']}", **stats)
        optimizer.step()
        multipliers.project()
    if diagnose:  # the last pass's gradients by layer; its last minibatch: does π see the state, are units alive
        stats |= {f"grad_norm/{name}": v for name, v in grad_norms_by_layer(agent).items()}
        with torch.no_grad():
            stats["stats/dead_units"] = dead_units(agent.torso(mb["obs"][:-1].flatten(0, 1)))
        stats["stats/logits_std_across_states"] = logits_std_across_states(logits[:-1])
    return stats


def vmpo_loss(logits, target_logits, actions, value_norm, returns_norm, mask, eta, alpha, eps_eta=0.1, eps_alpha=0.007):
    """Eq. (10), L_V + L_π + L_η + L_α, in PopArt's normalised units on states `[T, B]`: `logits` and π_target's
    `target_logits` `[T, B, A]`, the `actions` taken, `value_norm` V and `returns_norm` the targets (G − μ)/σ, `mask`
    the real steps (a reset step takes no part); A = (G − V)/σ, ψ on its top half (Sec. 4.2.1). Means over the real
    steps but L_π, whose ψ sums to 1."""
    n = mask.sum().clamp(min=1)
    value_loss = 0.5 * (mask * (returns_norm - value_norm) ** 2).sum() / n
    psi, eta_loss = vmpo_weights(returns_norm - value_norm.detach(), eta, eps_eta, mask)
    logp_all = F.log_softmax(logits, dim=-1)
    policy_loss = -(psi * logp_all.gather(-1, actions.unsqueeze(-1)).squeeze(-1)).sum()
    alpha_loss, kl_mean = kl_constraint_loss(categorical_kl(target_logits, logits), alpha, eps_alpha, mask)
    with torch.no_grad():
        selected = psi > 0
        kl_psi = (psi[selected] * (psi[selected] * selected.sum().clamp(min=1)).log()).sum()
        entropy = (mask * -(logp_all.exp() * logp_all).sum(-1)).sum() / n
    parts = (value_loss, policy_loss, eta_loss, alpha_loss)
    return VmpoLoss(sum(parts), *parts, kl_mean, kl_psi, entropy)


def batch_loss(logits, value_features, batch, agent, multipliers, args, popart_beta=None):
    """`vmpo_loss` on unrolls `[T+1, B]`: Sec. 4.1's targets G from the online V, PopArt's statistics moved toward
    them first (step `popart_beta`; outputs preserved), π_target's logits as the actors stored them. Row T only
    bootstraps, a reset step takes no part. Returns (VmpoLoss, stats)."""
    popart, task, (eta, alpha) = agent.popart, batch["task"], multipliers.values()  # task: each row's game
    own = task.unsqueeze(-1)  # each row reads its own game's output
    with torch.no_grad():
        values = popart.unnormalize(popart(value_features).gather(-1, own).squeeze(-1), task)  # online V
    # G_k, Eq. (1) bootstrapped from V(x_T), γ_k = 0 after a termination; where x_k ended an episode, step k is
    # envpool's reset step: G_k = V(x_k) there, so a truncated episode bootstraps from its last observation.
    real = ~batch["ended"][:-1]
    discounts = torch.where(real, args.gamma * (~batch["terminated"][1:]).float(), 0.0)
    returns = n_step_returns(torch.where(real, batch["reward"][1:], values[:-1]), discounts, values[-1])
    popart.update(returns[real], task[:-1][real], popart_beta)
    value_norm = popart(value_features[:-1]).gather(-1, own[:-1]).squeeze(-1)
    normalised = (value_norm, popart.normalize(returns, task[:-1]), real)
    out = vmpo_loss(logits[:-1], batch["logits"][:-1], batch["action"][:-1], *normalised, eta, alpha, args.eps_eta,
                    args.eps_alpha)  # fmt: skip
    stats = {**loss_stats(out), "stats/eta": eta.detach(), "stats/alpha": alpha.detach()}
    return out, {**stats, "stats/value_mean": (real * values[:-1]).sum() / real.sum().clamp(min=1)}


def main(args: Args):
    args, resumed = resume_checkpoint(args.resume, os.path.basename(__file__), Args) if args.resume else (args, None)
    spec, games = check_args(args)
    args = dataclasses.replace(args, env_ids=tuple(games))
    rank, world, device = learner_process(args)
    num_actions = 18 if games else int(spec.action_space.n)  # the full Atari action set for many games
    net = {k: getattr(args, k) for k in ("network", "channels", "use_lstm", "lstm_size", "head_hidden", "popart_beta")}
    agent = Agent(spec.observation_space.shape, num_actions, num_tasks=max(1, len(games)), **net).to(device)
    multipliers = LagrangeMultipliers(args.init_eta, args.init_alpha, args.multipliers).to(device)
    same_start(agent, multipliers)
    steps_per_update = args.batch_size * args.unroll_length
    num_updates = args.total_timesteps // steps_per_update
    describe = f"device {device}, {world} learner process(es), {args.num_actors * world} actor process(es), "
    describe += f"{args.num_envs * world} envs" + (f", {len(games)} games" if games else "")
    log = RunLog(args, resumed, describe, f"{len(games)}games" if games else None, write=rank == 0)
    specs = buffer_specs(spec.observation_space, num_actions, args)
    cfgs = actor_configs(args, rank, device, games, episodic_life=args.episodic_life, reward_clip=args.reward_clip)
    pool, stop = ActorPool(cfgs, agent, specs, args.batch_size // world, device), Stop()
    optimizer = make_optimizer(args, agent, multipliers)
    state = dict(agent=agent, target_agent=pool.agent, multipliers=multipliers, optimizer=optimizer, update=0)
    load_state(state, resumed)
    pool.version += resumed is not None  # the actors load the θ_target resumed
    try:
        while state["update"] < num_updates:
            batch = pool.next_batch(stop, log if rank == 0 else None, state["update"] * steps_per_update)
            if any_learner(batch is None, device):  # a stop: every learner after the same update
                break
            diagnose = rank == 0 and (log.due() or state["update"] + 1 == num_updates)
            stats, update = learner_step(state, batch, args, diagnose), state["update"]
            if update % args.target_update_period == 0:
                pool.publish(agent.state_dict())  # θ_target ← θ_online
            log_update(log, pool, agent, update, stats if diagnose else None, batch)
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
        eval_mean, extra = evaluate_games_model(log, saved_model(args, state, step), make_eval_policy, device)
        log.end(step, eval_mean, **extra)
    if world > 1:
        torch.distributed.destroy_process_group()
    if state["update"] < num_updates:
        exit_stopped(log if rank == 0 else None, step, world)


def save(log, state) -> None:
    """checkpoint.pt: the training state, once found finite; model.pt with --save-model."""
    step, saved = state["update"] * log.args.batch_size * log.args.unroll_length, state_dicts(state)
    weights = {f"{k}.{n}": v for k in ("agent", "multipliers") for n, v in saved[k].items() if v.is_floating_point()}
    check_finite(f"at update {state['update']}", **weights)
    log.save(step, saved, saved_model(log.args, state, step) if log.args.save_model else None)


def log_update(log, pool, agent, update, stats, batch) -> None:
    """After each update: the actors' episodes; with `stats` (the learner's diagnostics), π_target's, the console."""
    episodes, step = pool.take_episodes(), update * log.args.batch_size * log.args.unroll_length
    games = log.args.env_ids
    for score, length, task in episodes if log.writer else ():
        log.episode(score, length, step, games[task] if games else None)
    if log.writer is None or stats is None:
        return
    target = pool.version.item() - (update % log.args.target_update_period == 0)  # the one before this update's refresh
    stats["stats/stale_fraction"] = (batch["version"][:-1] != target).float().mean()
    stats.update({"stats/target_version": pool.version.item(), "charts/learning_rate": log.args.learning_rate})
    names = [f"/{game}" for game in games] or [""]  # PopArt's statistics per game (one game: stats/popart_mu, ...)
    stats |= {f"stats/popart_{x}{g}": getattr(agent.popart, x)[k] for k, g in enumerate(names) for x in ("mu", "sigma")}
    stats.update(median_human_normalized(log.groups, games))
    log.scalars(stats, step)
    eta, alpha, kl = (float(stats[f"stats/{k}"]) for k in ("eta", "alpha", "kl"))
    log.console(step, f"entropy {float(stats['stats/entropy']):.2f} | η {eta:.3f} α {alpha:.3f} KL {kl:.4f}")


def make_eval_policy(checkpoint, num_envs, device="cpu", greedy=False):
    """`policy(obs, rewards, first) -> actions` of a saved model, its rewards clipped as in training (evaluate.py)."""
    agent = Agent(**checkpoint["agent_config"]).to(device)
    agent.load_state_dict(checkpoint["agent"])
    return recurrent_policy(agent, num_envs, device, greedy, checkpoint["reward_clip"])


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
    per_actor, minibatches = args.num_envs // max(args.num_actors, 1), args.num_minibatches
    actors = f"--num-actors {args.num_actors}" + " (with --env-ids: one per game unless given)" * bool(games)
    require(not games or args.num_actors % len(games) == 0, f"{actors} must be a multiple of the number of games")
    fits = 0 < args.num_actors <= args.num_envs and per_actor * args.num_actors == args.num_envs
    require(fits, f"--num-envs {args.num_envs} must be a positive multiple of {actors}")
    require(0 <= args.env_batch_size <= per_actor, f"--env-batch-size: 0 (half) to the envs per actor ({per_actor})")
    require(args.total_timesteps >= steps, f"--total-timesteps is less than one batch (batch x unroll = {steps} steps)")
    split = 0 < minibatches and minibatches % world == 0 and args.batch_size % minibatches == 0
    require(split, f"--num-minibatches {minibatches}: must divide --batch-size, a multiple of the learners ({world})")
    require_in("[0, 1]", args, "gamma")
    positive = "batch_size unroll_length target_update_period update_epochs eps_eta eps_alpha init_eta init_alpha"
    require_in("(0, inf)", args, positive + " learning_rate")
    check_channels(args.network, args.channels)
    return spec, games


def make_optimizer(args, agent, multipliers):
    """Adam (Sec. 4.3; torch's ε 1e-8, the paper's) for the networks and the multipliers (`--dual-learning-rate`)."""
    dual = dict(params=list(multipliers.parameters()), lr=args.dual_learning_rate or args.learning_rate)
    return torch.optim.Adam([dict(params=list(agent.parameters())), dual], lr=args.learning_rate)


def saved_model(args, state, global_step):
    """What model.pt holds (evaluate.py and `make_eval_policy` play it)."""
    games = args.env_ids
    model = dict(script="vmpo_atari", env_id=games[0] if games else args.env_id, env_ids=list(games))
    model.update(full_action_space=bool(games), args=dataclasses.asdict(args), agent_config=state["agent"].config)
    model.update({k: {n: v.cpu() for n, v in state[k].state_dict().items()} for k in ("agent", "multipliers")})
    clip = args.reward_clip and (bool(games) or is_atari(args.env_id))
    return {**model, "reward_clip": clip, "global_step": global_step}


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
