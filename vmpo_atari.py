"""V-MPO for discrete actions: Song, Abdolmaleki, Springenberg, Clark, Soyer, Rae, Noury, Ahuja, Liu, Tirumala,
Heess, Belov, Riedmiller, Botvinick (2020), "V-MPO: On-Policy Maximum a Posteriori Policy Optimization for
Discrete and Continuous Control".

An approximate policy iteration: a *target* network acts in the environments and stays fixed for T_target
learning steps; the *online* network learns its value from n-step returns and improves its policy in two steps.
The E-step weights the top half of the batch's advantages by exp(A/η), the temperature η a Lagrange multiplier
keeping ψ within ε_η of the data; the M-step fits the policy to ψ by weighted maximum likelihood inside a KL trust
region KL(π_target ‖ π_online) < ε_α kept by a second multiplier α. PopArt keeps the value loss on one scale.

| paper                                                            | here                                     |
|------------------------------------------------------------------|------------------------------------------|
| Algorithm 1: target network, refreshed every T_target steps      | `act`, `pool.publish` in `main`          |
| Eq. (1) n-step returns G^(n) bootstrapped from the online V      | `n_step_returns`, `n_step_targets`       |
| Eq. (1) L_V, advantages A = G − V; Sec. 4.1 PopArt               | `vmpo_loss`, `batch_loss`, common/popart |
| Eq. (12) ψ over the top half of the advantages, L_π              | `vmpo_weights` -> psi, `vmpo_loss`       |
| Eq. (13) temperature loss L_η                                    | `vmpo_weights` -> eta_loss               |
| Eq. (14) KL trust region L_α with stop-gradients                 | `categorical_kl`, `kl_constraint_loss`   |
| Sec. 4.2.2: η, α ≥ η_min = α_min = 1e-8 after every step         | `LagrangeMultipliers` (`--multipliers`)  |
| Fig. 1b, App. F: ResNet (64, 128, 128), LSTM, 256-unit MLP heads | `Agent`                                  |
| Tables 1 and 6: initial η, α; ε_η, ε_α; γ; T_target              | `Args` defaults                          |

Losses are means; values and advantages are taken in PopArt's normalised space; the actors act with the target
network, so the KL of Eq. (14) is taken against the logits they stored. The batch is split into
`--num-minibatches` minibatches (the paper's 8 replicas). envpool's reset step (the step after an episode ends) is
masked out of every loss. What departs from the paper (the softplus multipliers with their own learning rate, the
initialisation, the CPU settings of the Atari family, the LSTM in place of the Transformer-XL) and why:
docs/vmpo_atari.md. Multi-task: `--env-ids` (Table 4's one agent), one PopArt output per game.

    python vmpo_atari.py --env-id Breakout-v5
    torchrun --nproc_per_node 2 vmpo_atari.py --env-id Pong-v5 --num-envs 128
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import multiprocessing
import math
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
from common.evaluation import evaluate, evaluate_games, expand_env_ids, human_normalized_score, recurrent_policy
from common.evaluation import resume_checkpoint
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
    total_timesteps: int = 50_000_000  # environment steps in all (200M frames at action repeat 4)
    num_envs: int = 64  # environments per learner process, split evenly over its actors
    env_batch_size: int = 0  # envs per envpool step (async below envs per actor); 0: half of an actor's envs
    num_actors: int = 1  # actor processes per learner process (with --env-ids: one per game, envs rounded up to match)
    unroll_length: int = 63  # n, unroll length (Appendix F, Atari)
    batch_size: int = 128  # B, unrolls per learning step, over all learner processes (Appendix F, Atari)
    num_minibatches: int = 8  # minibatches, each with its own top half and ψ: the paper's 8 replicas (App. F)
    target_update_period: int = 1000  # T_target, learning steps between target refreshes (Table 6; 100 multi-task)
    learning_rate: float = 1e-4  # Adam learning rate (Sec. 4.3)
    adam_eps: float = 1e-8  # Adam ε (the paper's TensorFlow default)
    max_grad_norm: float = 0.0  # global gradient-norm clipping threshold; 0: none (the paper mentions none)
    gamma: float = 0.997  # γ, agent discount (Table 6, single-task; 0.99 multi-task)
    eps_eta: float = 0.1  # ε_η, bound of the temperature dual: KL of ψ from the data (Table 6)
    eps_alpha: float = 0.007  # ε_α, bound of KL(π_target ‖ π_online) (Table 6: the middle of [0.005, 0.01))
    init_eta: float = 1.0  # initial η, temperature (Table 1)
    init_alpha: float = 5.0  # initial α, KL multiplier (Table 1)
    min_multiplier: float = 1e-8  # η_min = α_min, the projection after every step (Sec. 4.2.2) or softplus's floor
    multipliers: Literal["paper", "softplus"] = "paper"  # paper: projected parameters; softplus: Acme's MPO (docs)
    dual_learning_rate: float = 0.0  # learning rate of η and α; 0: the networks' Adam and learning rate (Sec. 4.3)
    update_epochs: int = 1  # gradient steps on each batch, all against its π_target (1: Algorithm 1's one step)
    top_fraction: float = 0.5  # fraction of the batch's highest advantages in the E-step (Sec. 4.2.1)
    popart_beta: float = 1e-4  # PopArt statistics step size (Sec. 4.1)
    popart_scale_lower: float = 1e-2  # PopArt lower bound of σ (Sec. 4.1)
    popart_scale_upper: float = 1e6  # PopArt upper bound of σ (Sec. 4.1)
    reward_clip: bool = False  # Atari: clip training rewards to [-1, 1] (Table 6: multi-task only)
    episodic_life: bool = False  # Atari: a lost life ends the training episode (Table 6: multi-task only)
    network: Literal["deep", "shallow"] = "deep"  # pixel torso: deep ResNet (App. F) or shallow; vectors: an MLP
    channels: tuple[int, ...] = ()  # conv channels; empty: (64, 128, 128) deep (App. F), (16, 32) shallow
    use_lstm: bool = True  # LSTM core fed the previous action and reward (Fig. 1b)
    lstm_size: int = 256  # LSTM hidden units (App. F)
    head_hidden: int = 256  # hidden units of the policy and value MLP heads (App. F)
    init: Literal["orthogonal", "sonnet", "torch"] = "orthogonal"  # weight initialisation (docs/vmpo_atari.md)
    mlp_hidden: tuple[int, ...] = (64, 64)  # hidden layers of the MLP torso for vector observations
    save_model: bool = False  # write model.pt (weights, PopArt statistics, what evaluation needs) in the run folder
    capture_video: bool = False  # record the first evaluation episode (an animated PNG) in the run folder
    eval_episodes: int = 10  # evaluation episodes at the end of training (0: none)
    run_dir: str = "runs"  # folder of the run folders
    log_interval: float = 5.0  # seconds between console progress lines
    learner_threads: int = 0  # torch threads of a learner process; 0: half the cores (the rest step the envs)
    checkpoint_interval: float = 300.0  # seconds between checkpoints (also at the end and on Ctrl-C); 0: only then
    resume: str = ""  # a run folder to continue from its checkpoint.pt, with its own arguments


# Defaults by task family (a flag the user gives wins; docs/vmpo_atari.md): Atari takes Acme's multipliers; with no
# GPU, settings measured on Breakout-v5 (the paper's ResNet + LSTM runs about 11 steps/s on 2 cores); classic
# control, settings measured on CartPole-v1.
FAMILY_DEFAULTS = {
    "atari": (
        "the paper's Atari settings (Appendix F, Tables 1 and 6) with Acme's multipliers (docs)",
        dict(multipliers="softplus", dual_learning_rate=1e-2),
    ),
    "atari_cpu": (
        "the CPU Atari settings measured on Breakout-v5 (docs)",
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


# ---------------------------------------------------------------------------------------------------------
# The paper's math: pure functions of time-major [T, B] tensors.


@torch.no_grad()
def n_step_returns(rewards, discounts, bootstrap_value):
    """Eq. (1): G_ℓ = Σ_{k=ℓ}^{n-1} (Π_{i=ℓ}^{k-1} γ_i) r_k + (Π_{i=ℓ}^{n-1} γ_i) V(s_n) for every ℓ of an unroll
    of length n, with per-step discounts γ_i = γ (1 − done_i). `[T, B]` inputs, bootstrap_value `[B]`."""
    acc = bootstrap_value
    out = []
    for t in reversed(range(rewards.shape[0])):
        acc = rewards[t] + discounts[t] * acc
        out.append(acc)
    return torch.stack(out[::-1])


def vmpo_weights(advantages, eta, eps_eta, mask=None, top_fraction=0.5):
    """The E-step, Eqs. (12)-(13), on the top `top_fraction` of the advantages of the batch.

    ψ(s, a) = exp(A(s, a)/η) / Σ_{D̃} exp(A/η) on the k highest advantages D̃ (exactly k = ⌊fraction · |D|⌋ ≥ 1
    samples, by `topk`, so ties cannot let more in), 0 elsewhere; `psi` has the advantages' shape, sums to one
    and carries no gradient. L_η = η ε_η + η log( (1/|D̃|) Σ_{D̃} exp(A/η) ), differentiable in η only, on the
    same k samples. `mask` (bool, the advantages' shape) leaves samples out of D.
    """
    adv = advantages.detach().reshape(-1)
    valid = torch.ones_like(adv, dtype=torch.bool) if mask is None else mask.reshape(-1).bool()
    n = int(valid.sum())
    if n == 0:
        return torch.zeros_like(advantages), eta * eps_eta
    k = max(1, int(n * top_fraction))
    top_values, top_index = adv.masked_fill(~valid, -math.inf).topk(k)
    weights = torch.softmax(top_values / eta.detach(), dim=0)
    psi = torch.zeros_like(adv).scatter(0, top_index, weights).view_as(advantages)
    eta_loss = eta * eps_eta + eta * (torch.logsumexp(top_values / eta, dim=0) - math.log(k))
    return psi, eta_loss


def categorical_kl(target_logits, online_logits):
    """KL(π_target ‖ π_online) per state for categorical policies `[..., A] -> [...]`; π_target carries no
    gradient."""
    target_logp = F.log_softmax(target_logits.detach(), dim=-1)
    online_logp = F.log_softmax(online_logits, dim=-1)
    return (target_logp.exp() * (target_logp - online_logp)).sum(-1)


def kl_constraint_loss(kl, alpha, eps_alpha, mask=None):
    """Eq. (14): L_α = (1/|D|) Σ_D [ α (ε_α − sg[KL]) + sg[α] KL ], over the full batch D.

    The first term moves α (up when the KL exceeds ε_α, down when below); the second is the trust region on the
    policy, with α held fixed. Returns (loss, mean KL)."""
    m = torch.ones_like(kl) if mask is None else mask.float()
    kl_mean = (m * kl).sum() / m.sum().clamp(min=1)
    return alpha * (eps_alpha - kl_mean.detach()) + alpha.detach() * kl_mean, kl_mean


def n_step_targets(values, rewards, terminated, ended, gamma):
    """The value targets G_k of Sec. 4.1 for rows 0..T-1 of unrolls `[T+1, B]`: Eq. (1)'s n-step returns
    bootstrapped from V(x_T) (`values` unnormalised), with γ_k = 0 after a termination. Row k holds x_k and the
    reward and end flags that came with it; where x_k ended an episode (`ended`), step k is envpool's reset step:
    G_k = V(x_k) there, so a truncated episode bootstraps from its last observation."""
    reset_step = ended[:-1]
    discounts = torch.where(reset_step, 0.0, gamma * (~terminated[1:]).float())
    rewards = torch.where(reset_step, values[:-1], rewards[1:])
    return n_step_returns(rewards, discounts, values[-1])


class VmpoLoss(NamedTuple):
    """vmpo_loss's result: the loss and its four parts, and diagnostics (means over the real steps)."""

    loss: torch.Tensor
    value_loss: torch.Tensor
    policy_loss: torch.Tensor
    eta_loss: torch.Tensor
    alpha_loss: torch.Tensor
    kl: torch.Tensor  # KL(π_target ‖ π), the batch mean
    kl_psi: torch.Tensor  # KL(ψ ‖ uniform on D̃)
    entropy: torch.Tensor
    advantage_mean: torch.Tensor


def vmpo_loss(logits, target_logits, actions, value_norm, returns_norm, ended, eta, alpha, eps_eta=0.1, eps_alpha=0.007,
              top_fraction=0.5) -> VmpoLoss:  # fmt: skip
    """Eq. (10): L_V + L_π + L_η + L_α on a batch of unrolls, in PopArt's normalised units.

    `logits [T+1, B, A]` from the online network on rows 0..T (row T only bootstraps), `target_logits` π_target's
    (the actors'), `actions` and `ended` `[T+1, B]`; `value_norm` the online network's normalised values and
    `returns_norm` the normalised targets (G − μ)/σ of rows 0..T-1 `[T, B]`; η and α the Lagrange multipliers.
    A reset step (`ended`) takes no part. The advantages are returns_norm − sg[value_norm] = (G − V)/σ."""
    mask = ~ended[:-1]
    n = mask.sum().clamp(min=1)
    value_loss = 0.5 * (mask * (returns_norm - value_norm) ** 2).sum() / n
    advantages = returns_norm - value_norm.detach()
    psi, eta_loss = vmpo_weights(advantages, eta, eps_eta, mask, top_fraction)
    logp_all = F.log_softmax(logits[:-1], dim=-1)
    logp = logp_all.gather(-1, actions[:-1].unsqueeze(-1)).squeeze(-1)
    policy_loss = -(psi * logp).sum()
    kl = categorical_kl(target_logits[:-1], logits[:-1])
    alpha_loss, kl_mean = kl_constraint_loss(kl, alpha, eps_alpha, mask)
    with torch.no_grad():
        selected = psi > 0
        k = selected.sum().clamp(min=1)
        kl_psi = (psi[selected] * (psi[selected] * k).log()).sum()
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return VmpoLoss(
        loss=value_loss + policy_loss + eta_loss + alpha_loss,
        value_loss=value_loss,
        policy_loss=policy_loss,
        eta_loss=eta_loss,
        alpha_loss=alpha_loss,
        kl=kl_mean,
        kl_psi=kl_psi,
        entropy=(mask * entropy).sum() / n,
        advantage_mean=(mask * advantages).sum() / n,
    )


class LagrangeMultipliers(nn.Module):
    """η (temperature, Eq. 13) and α (KL multiplier, Eq. 14) as two scalar parameters `eta`, `alpha`.

    form "paper": the parameters are η and α themselves, projected to at least η_min after every step (Sec. 4.2.2).
    form "softplus": the parameters are unconstrained, η = softplus(eta) + η_min, α = softplus(alpha) + η_min (Acme's
    MPO); near zero a step of the parameter then changes α by a factor rather than by an amount.
    `values()` gives (η, α), differentiable in the parameters."""

    def __init__(self, eta=1.0, alpha=5.0, form="paper", minimum=1e-8):
        super().__init__()
        self.form, self.minimum = form, minimum

        def raw(v):  # the parameter whose image is v
            return float(v) if form == "paper" else math.log(math.expm1(max(float(v) - minimum, 1e-12)))

        self.eta = nn.Parameter(torch.tensor(raw(eta)))
        self.alpha = nn.Parameter(torch.tensor(raw(alpha)))

    def values(self):
        if self.form == "paper":
            return self.eta, self.alpha
        return F.softplus(self.eta) + self.minimum, F.softplus(self.alpha) + self.minimum

    @torch.no_grad()
    def project(self, minimum=None):
        """Sec. 4.2.2 (form "paper"): η ← max(η, η_min), α ← max(α, α_min); the softplus form needs none."""
        if self.form == "paper":
            self.eta.clamp_(min=self.minimum if minimum is None else minimum)
            self.alpha.clamp_(min=self.minimum if minimum is None else minimum)


# ---------------------------------------------------------------------------------------------------------
# The agent (Fig. 1b, Appendix F).


class Agent(nn.Module):
    """Torso (ResNet for pixels, MLP for vectors), optional LSTM core fed the previous action and reward, and
    two 256-unit MLP heads: policy logits (readout initialised to zero: a uniform policy at the start) and a
    PopArt value readout."""

    def __init__(self, obs_shape, num_actions, network="deep", channels=(), use_lstm=True, lstm_size=256,
                 head_hidden=256, mlp_hidden=(64, 64), num_tasks=1, popart_beta=1e-4, popart_scale_lower=1e-2,
                 popart_scale_upper=1e6, init="orthogonal"):  # fmt: skip
        super().__init__()
        self.config = {k: v for k, v in locals().items() if k not in ("self", "__class__")}  # for model.pt
        if network == "deep" and not channels and len(obs_shape) == 3:
            channels = (64, 128, 128)  # four times IMPALA's channels (App. F)
        self.config["channels"] = tuple(channels)
        self.torso = make_torso(obs_shape, network, channels or None, mlp_hidden)
        self.core = LSTMCore(self.torso.out_features, num_actions, lstm_size) if use_lstm else None
        n = self.core.out_features if use_lstm else self.torso.out_features
        self.policy_mlp = nn.Sequential(nn.Linear(n, head_hidden), nn.ReLU())
        self.policy = nn.Linear(head_hidden, num_actions)
        self.value_mlp = nn.Sequential(nn.Linear(n, head_hidden), nn.ReLU())
        self.popart = PopArt(head_hidden, num_tasks, popart_beta, popart_scale_lower, popart_scale_upper)
        init_weights_(self, init)
        if init == "orthogonal":
            init_output_(self.popart.linear, 1.0)
        init_output_(self.policy, 0.0)  # a uniform policy at the start (App. F)

    def initial_state(self, batch_size, device=None):
        return self.core.initial_state(batch_size, device) if self.core is not None else ()

    def forward(self, obs, prev_action, prev_reward, first, state=()):
        """Time-major inputs `[T, B, ...]`; returns logits `[T, B, A]`, the value head's features `[T, B, H]`
        (normalised values are `self.popart(features)`) and the core state."""
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


def act(cfg, link: ActorLink) -> None:
    """Algorithm 1, 'use π_θtarget to act': for each batch of envs that envpool returns, the target network samples
    actions, the envs step while the row is written, and every full unroll goes to the learner."""
    n, device = cfg.num_envs, torch.device(cfg.device)
    envs = make_env(cfg.env_id, n, cfg.seed, cfg.env_batch_size, num_threads=cfg.env_threads, **cfg.env_options)
    agent = link.local_agent(device)
    unrolls = UnrollWriter(link, n, cfg.unroll_length)
    ended, prev_action = np.zeros(n, bool), torch.zeros(n, dtype=torch.long)
    state, tracker = agent.initial_state(n, device), EpisodeTracker(n)
    envs.async_reset()
    while True:
        obs, reward, term, trunc, info = envs.recv()
        ids = info["env_id"]
        version = link.refresh(agent)
        ids_t = torch.from_numpy(ids).long()
        ids_dev, first = ids_t.to(device), torch.from_numpy(ended[ids])
        obs_t, reward_t = torch.from_numpy(obs), torch.from_numpy(reward).float()
        prev = torch.where(first, 0, prev_action[ids_t])
        state_before = tuple(s[ids_dev] for s in state)
        with torch.no_grad():
            inputs = (x.to(device)[None] for x in (obs_t, prev, reward_t, first))
            logits, _, state_after = agent(*inputs, state_before)
            action = torch.distributions.Categorical(logits=logits[0]).sample().cpu()
        envs.send(action.numpy(), ids)  # the envs step while this process does the bookkeeping
        done = term | trunc
        row = dict(obs=obs_t, reward=reward_t, ended=torch.from_numpy(done), terminated=torch.from_numpy(term))
        row.update(first=first, action=action, prev_action=prev, logits=logits[0].cpu())
        row.update(version=torch.full((len(ids),), version), task=torch.full((len(ids),), cfg.task))
        core = None
        if agent.core is not None:
            core = dict(zip(("core_h", "core_c"), (s.cpu() for s in state_before)))
            for s, s_new in zip(state, state_after):
                s[ids_dev] = s_new
        unrolls.write(ids, row, core)
        prev_action[ids_t], ended[ids] = action, done
        for _, score, length in tracker.step(ids, reward, term, trunc, info):
            link.msg_q.put(("episode", score, length, cfg.task))


# ---------------------------------------------------------------------------------------------------------
# Learning: setup, the learner's loop (Algorithm 1), the end.


def learner_step(learner, batch, args, interrupt, update, target_version, diagnose=False):
    """Algorithm 1's update number `update` on a batch of unrolls (`learner`: the agent, the multipliers and their
    optimiser), `--update-epochs` passes against the same π_target (the batch's logits): on each minibatch of
    columns the n-step targets, PopArt's statistics moved toward them (first pass only), the E-step's weights on the
    top half of advantages and the M-step's loss with the temperature and KL multipliers (`minibatch_gradients`);
    the gradient averaged over the learners, clipped, an Adam step, the multipliers kept positive, these last two
    in `interrupt.commit()`. Ctrl-C drops the update whole (the learner's state restored). Returns the last pass's
    stats (with `diagnose`, the per-layer gradient norms too; `target_version`, π_target's, tells the rows acted by
    an older one), logits and observations."""
    (agent, multipliers, optimizer), world = learner.values(), world_size()
    before = copy.deepcopy({k: part.state_dict() for k, part in learner.items()})
    try:
        for epoch in range(args.update_epochs):
            optimizer.zero_grad(set_to_none=False)
            stats, logits, obs = minibatch_gradients(
                agent, multipliers, batch, args, args.num_minibatches // world, epoch == 0
            )
            if world > 1:
                average_gradients(list(agent.parameters()) + list(multipliers.parameters()), world)
            layers = grad_norms_by_layer(agent) if diagnose and epoch == args.update_epochs - 1 else {}  # unclipped
            max_norm = args.max_grad_norm if args.max_grad_norm > 0 else float("inf")
            grad_norm = nn.utils.clip_grad_norm_(agent.parameters(), max_norm)
            check_finite(f"at update {update}", gradient=grad_norm, **{k.split("/")[-1]: v for k, v in stats.items()})
            stats.update({"stats/grad_norm": grad_norm, **{f"grad_norm/{name}": v for name, v in layers.items()}})
            with interrupt.commit():
                optimizer.step()
                multipliers.project()
    except KeyboardInterrupt:  # weights, PopArt and Adam as they were before this update
        for k, state in before.items():
            learner[k].load_state_dict(state)
        raise
    stats["stats/stale_fraction"] = (batch["version"][:-1] != target_version).float().mean()
    return stats, logits, obs


def main(args: Args):
    args, resumed = resume_args(args)
    spec, games = check_args(args)
    multitask = len(games) > 0
    args = dataclasses.replace(args, env_ids=tuple(games))
    rank, world, device = learner_process(args)
    num_actions = 18 if multitask else int(spec.action_space.n)  # the full Atari action set for many games
    atari = is_atari(games[0] if multitask else args.env_id)
    channels = args.channels if len(spec.observation_space.shape) == 3 else ()
    net = (args.network, channels, args.use_lstm, args.lstm_size, args.head_hidden, args.mlp_hidden, max(1, len(games)))
    popart = (args.popart_beta, args.popart_scale_lower, args.popart_scale_upper)
    agent = Agent(spec.observation_space.shape, num_actions, *net, *popart, args.init).to(device)
    multipliers = LagrangeMultipliers(args.init_eta, args.init_alpha, args.multipliers, args.min_multiplier).to(device)
    if world > 1:  # the same initial weights in every learner (rank 0's)
        for p in list(agent.parameters()) + list(multipliers.parameters()):
            torch.distributed.broadcast(p.data, 0)
    optimizer = make_optimizer(args, agent, multipliers)
    start_update, target_state = 0, None
    learner = dict(agent=agent, multipliers=multipliers, optimizer=optimizer)  # what a checkpoint saves and restores
    if resumed is not None:
        for k, part in learner.items():
            part.load_state_dict(resumed[k])
        start_update, target_state = resumed["update"], resumed["target_agent"]
    task_name = f"{len(games)}games" if multitask else args.env_id
    describe = f"device {device}, {world} learner process(es), {args.num_actors * world} actor process(es), "
    describe += f"{args.num_envs * world} envs{', ' + str(len(games)) + ' games' if multitask else ''}"
    log = RunLog(args, task_name, resumed, describe, write=rank == 0)
    steps_per_update = args.batch_size * args.unroll_length
    num_updates = args.total_timesteps // steps_per_update
    global_step, last_checkpoint = log.start_step, time.time()

    def checkpoint(update, timed=False):  # timed: only every --checkpoint-interval seconds
        nonlocal last_checkpoint
        if timed and not 0 < args.checkpoint_interval <= time.time() - last_checkpoint:
            return None
        last_checkpoint = time.time()
        if rank == 0:
            check_finite_parameters(f"at update {update}", agent=agent, multipliers=multipliers)
            if args.save_model:  # a run stopped early can be evaluated too
                model = saved_model(args, agent, multipliers, games, atari, global_step)
                save_atomic(model, os.path.join(log.path, "model.pt"))
            state = {k: part.state_dict() for k, part in learner.items()}
            state.update(target_agent=pool.agent.state_dict(), update=update)
            save_atomic(log.state(global_step, **state), os.path.join(log.path, "checkpoint.pt"))
        return global_step

    # Ctrl-C or SIGTERM: stop at once, dropping the update in progress (on a CPU one update of the default ResNet
    # + LSTM takes minutes), and save the last completed update's state. Only the few lines that change the
    # training state (the optimiser step to the target refresh) finish first.
    interrupt, pool = Interrupt(), None
    done_update = start_update
    try:
        specs = buffer_specs(spec.observation_space, num_actions, args)
        env_options = dict(episodic_life=args.episodic_life, reward_clip=args.reward_clip)
        cfgs = actor_configs(args, rank, device, args.env_ids, **env_options)
        pool = ActorPool(cfgs, agent, specs, args.batch_size // world, device)
        if target_state is not None:  # the target network the run was acting with
            pool.publish(target_state)
        collecting = (pool.batch_size, args.unroll_length)  # a progress line also while a batch is collected
        for update in range(start_update + 1, num_updates + 1):
            batch = pool.next_batch(lambda k: rank == 0 and log.console(global_step, collecting=(k, *collecting)))
            diagnose = rank == 0 and (log.due() or update == num_updates)
            stats, logits, obs = learner_step(learner, batch, args, interrupt, update, pool.version.item(), diagnose)
            with interrupt.commit():
                if update % args.target_update_period == 0:
                    pool.publish(agent.state_dict())  # θ_target ← θ_online
                global_step, done_update = update * steps_per_update, update
            checkpoint(update, timed=True)
            log_update(log, pool, games, global_step, stats if diagnose else None, agent, logits, obs)
    except (WorkerError, NonFiniteError) as e:
        fail(e, log.path, pool)
    except KeyboardInterrupt:
        save = (lambda: checkpoint(done_update)) if done_update > start_update else None
        stop_on_interrupt(pool, interrupt, save, log, world)
    pool.close()
    end_time = time.time()
    checkpoint(num_updates)
    if rank == 0:
        log.end(saved_model(args, agent, multipliers, games, atari, global_step), end_time, device, games)
    if world > 1:
        torch.distributed.destroy_process_group()


def log_update(log, pool, games, step, stats, agent, logits, obs) -> None:
    """Rank 0, after each update: the episodes the actors finished; with `stats` (every --log-interval seconds), the
    learner's diagnostics, π_target's version and the console line."""
    episodes = pool.take_episodes()
    if log.writer is None:
        return
    log.first_update(step)
    for score, length, task in episodes:
        log.episode(score, length, step, *([games[task]] if games else []))
    if stats is not None:
        stats.update({"stats/target_version": pool.version.item(), "charts/learning_rate": log.args.learning_rate})
        log_diagnostics(log, agent, games or [log.args.env_id], stats, logits, {"obs": obs}, step)
        eta, alpha, kl = (stats[f"stats/{k}"].item() for k in ("eta", "alpha", "kl"))
        log.console(step, f"entropy {stats['stats/entropy'].item():.2f} | η {eta:.3f} α {alpha:.3f} KL {kl:.4f}")


def log_diagnostics(log, agent, tasks, stats, logits, batch, step) -> None:
    """The learner's stats, gradient norms per layer, whether the policy depends on the state yet (logits' spread
    across states), the torso's dead units, PopArt's statistics per game, several games' median human-normalised
    score (of their last 10 episodes)."""
    log.scalars(stats, step)
    with torch.no_grad():
        features = agent.torso(batch["obs"][:-1].flatten(0, 1))
        log.scalars({"stats/logits_std_across_states": logits_std_across_states(logits[:-1])}, step)
        log.scalars({"stats/dead_units": dead_units(features)}, step)
    for k, task in enumerate(tasks if agent.popart is not None else []):
        log.scalars(
            {f"stats/popart_sigma/{task}": agent.popart.sigma[k], f"stats/popart_mu/{task}": agent.popart.mu[k]}, step
        )
    hns = [human_normalized_score(g, np.mean(log.groups[g][-10:])) for g in tasks if log.groups.get(g)]
    if len(tasks) > 1 and len(hns) == len(tasks):
        log.scalars({"charts/median_human_normalized": float(np.median(hns))}, step)


def make_eval_policy(checkpoint, num_envs, device="cpu", greedy=False):
    """A callable `policy(obs, rewards, first) -> actions` of a saved model (it keeps the LSTM state and
    the previous action itself); rewards are clipped as in training."""
    agent = Agent(**checkpoint["agent_config"]).to(device)
    agent.load_state_dict(checkpoint["agent"])
    return recurrent_policy(agent, num_envs, device, greedy, checkpoint["reward_clip"])


def buffer_specs(observation_space, num_actions, args) -> dict:
    """The unroll buffers `act` fills: name → (shape of one slot, dtype); with an LSTM its state before each slot."""
    T, obs_dtype = args.unroll_length, torch.uint8 if observation_space.dtype == np.uint8 else torch.float32
    specs = dict(obs=((T + 1, *observation_space.shape), obs_dtype), logits=((T + 1, num_actions), torch.float32))
    specs.update(
        {k: ((T + 1,), torch.bool) for k in ("ended", "terminated", "first")}, reward=((T + 1,), torch.float32)
    )
    specs.update({k: ((T + 1,), torch.long) for k in ("action", "prev_action", "version", "task")})
    if args.use_lstm:
        specs.update(core_h=((args.lstm_size,), torch.float32), core_c=((args.lstm_size,), torch.float32))
    return specs


def check_args(args):
    """Bad input: one clear line before any work (UsageError). Returns the spec of the (first) game and the games
    of a multi-task run (presets expanded; empty for one game)."""
    games = check_actor_args(args)
    spec = env_spec(games[0] if games else args.env_id, discrete=True)
    if args.target_update_period < 1:
        raise UsageError(f"--target-update-period must be at least 1, got {args.target_update_period}")
    require(0 < args.top_fraction <= 1, f"--top-fraction must be in (0, 1], got {args.top_fraction}")
    for name in ("eps_eta", "eps_alpha", "init_eta", "init_alpha", "learning_rate"):
        require(getattr(args, name) > 0, f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    require(0 <= args.gamma <= 1, f"--gamma must be in [0, 1], got {args.gamma}")
    if len(spec.observation_space.shape) == 3:
        check_channels(args.network, args.channels)
    return spec, games


def batch_loss(logits, value_features, batch, agent, multipliers, args, popart_beta=None):
    """vmpo_loss on a batch of unrolls: the n-step targets from the online network's unnormalised values, PopArt's
    statistics moved toward them first (step `popart_beta`, default PopArt's own β; the layer is rescaled so
    that V(s) is unchanged), then the loss in the new normalised units. Returns (VmpoLoss, stats)."""
    popart = agent.popart
    eta, alpha = multipliers.values()
    task = batch.get("task")  # each row's game (multi-task); one task otherwise
    if task is None:
        task = torch.zeros(value_features.shape[:2], dtype=torch.long, device=value_features.device)

    def own(outputs):  # each row's output for its own task
        return outputs.gather(-1, task[: outputs.shape[0]].unsqueeze(-1)).squeeze(-1)

    with torch.no_grad():
        values = popart.unnormalize(own(popart(value_features)), task)  # online V, unnormalised
    returns = n_step_targets(values, batch["reward"], batch["terminated"], batch["ended"], args.gamma)
    real = ~batch["ended"][:-1]
    popart.update(returns[real], task[:-1][real], popart_beta)
    value_norm, returns_norm = own(popart(value_features[:-1])), popart.normalize(returns, task[:-1])
    pi_target, bounds = batch["logits"], (args.eps_eta, args.eps_alpha, args.top_fraction)  # π_target's logits
    out = vmpo_loss(logits, pi_target, batch["action"], value_norm, returns_norm, batch["ended"], eta, alpha, *bounds)
    n = real.sum().clamp(min=1)
    stats = {**loss_stats(out), "stats/eta": eta.detach(), "stats/alpha": alpha.detach()}
    stats.update({"stats/popart_mu": popart.mu[0].clone(), "stats/popart_sigma": popart.sigma[0].clone()})
    return out, {**stats, "stats/value_mean": (real * values[:-1]).sum() / n}


def minibatch_gradients(agent, multipliers, batch, args, chunks, move_popart=True):
    """Accumulates the gradient of vmpo_loss over the batch's `chunks` minibatches of columns, one after the
    other (PopArt's statistics moved by each, or by none: a later pass of `--update-epochs`). Returns the stats
    averaged over them, and the last minibatch's logits and observations."""
    stats = {}
    for cols in torch.arange(batch["obs"].shape[1], device=batch["obs"].device).chunk(chunks):
        mb = {k: v[cols] if k in ("core_h", "core_c") else v[:, cols] for k, v in batch.items()}
        state = (mb["core_h"], mb["core_c"]) if args.use_lstm else ()
        logits, value_features, _ = agent(mb["obs"], mb["prev_action"], mb["reward"], mb["first"], state)
        beta = args.popart_beta / chunks if move_popart else 0.0
        out, mb_stats = batch_loss(logits, value_features, mb, agent, multipliers, args, beta)
        (out.loss / chunks).backward()
        for k, v in mb_stats.items():
            stats[k] = stats.get(k, 0) + v / chunks
    return stats, logits, mb["obs"]


def make_optimizer(args, agent, multipliers):
    """Adam for the networks and the multipliers (Sec. 4.3); with `--dual-learning-rate` the multipliers in a
    parameter group of their own with that learning rate (per-parameter Adam: the same as an Adam of their own)."""
    if args.dual_learning_rate <= 0:
        params = [*agent.parameters(), *multipliers.parameters()]
        return torch.optim.Adam(params, lr=args.learning_rate, eps=args.adam_eps)
    groups = [
        dict(params=list(agent.parameters())),
        dict(params=list(multipliers.parameters()), lr=args.dual_learning_rate),
    ]
    return torch.optim.Adam(groups, lr=args.learning_rate, eps=args.adam_eps)


def saved_model(args, agent, multipliers, games, atari, global_step):
    """What model.pt holds (evaluate.py and `make_eval_policy` play it)."""
    model = dict(script="vmpo_atari", env_id=games[0] if games else args.env_id, env_ids=list(games))
    model.update(full_action_space=bool(games), args=dataclasses.asdict(args), agent_config=agent.config)
    weights = dict(agent=agent.state_dict(), multipliers=multipliers.state_dict())
    model.update({k: {n: v.cpu() for n, v in w.items()} for k, w in weights.items()})
    return {**model, "reward_clip": atari and args.reward_clip, "global_step": global_step}


def average_gradients(params, world: int) -> None:
    """Averages gradients over the learner processes (one all-reduce of a flat buffer), in place of DDP, so that
    PopArt can rescale its layer between the forward pass and the loss."""
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    torch.distributed.all_reduce(flat)
    for g, part in zip(grads, flat.div_(world).split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


# ---------------------------------------------------------------------------------------------------------
# Plumbing: actor processes and their shared-memory unrolls, learner processes, the run folder, checkpoints,
# Ctrl-C and failures, the task family's defaults. No equation below.


def actor_configs(args, rank, device, games=(), **env_options) -> list[SimpleNamespace]:
    """The actors of learner `rank`: actor a plays game a mod G (every game the same share, all 18 actions), its
    envs stepped `--env-batch-size` at a time (0: half of them) by the cores the learner leaves free."""
    n, tasks = args.num_envs // args.num_actors, list(games) or [args.env_id]
    threads = max(1, ((os.cpu_count() or 2) // world_size() - torch.get_num_threads()) // args.num_actors)
    options = {**env_options, "full_action_space": True} if games else env_options
    shared = dict(num_envs=n, unroll_length=args.unroll_length, env_batch_size=args.env_batch_size or max(1, n // 2))
    shared.update(device=str(device), env_threads=threads, env_options=options)
    return [
        SimpleNamespace(env_id=tasks[a % len(tasks)], task=a % len(tasks), seed=args.seed + 1000 * rank + a, **shared)
        for a in range(args.num_actors)
    ]


@dataclass
class ActorLink:
    """What an actor process shares with its learner: the published network and its version, the unroll buffers,
    the free and full slot queues, the message queue."""

    agent: nn.Module
    version: torch.Tensor
    buffers: dict
    free_q: object
    full_q: object
    msg_q: object
    seen: int = -1  # the version the actor's copy holds

    def local_agent(self, device):
        agent, self.seen = copy.deepcopy(self.agent).to(device), -1
        self.refresh(agent)
        return agent

    def refresh(self, agent) -> int:
        """Loads the published network into `agent` if the learner has published since; returns its version."""
        latest = int(self.version.item())
        if latest != self.seen:
            agent.load_state_dict(self.agent.state_dict())
            self.seen = latest
        return latest


class UnrollWriter:
    """The actor's side of the slots: `write(ids, row, core_state)` stores a row for each env in `ids` (any subset:
    envpool's async mode); a slot that reaches T+1 rows goes to the learner and its env goes on in a free slot whose
    row 0 is the full one's row T. `core_state` (the LSTM state before the row) is kept where a row opens a slot."""

    def __init__(self, link: ActorLink, num_envs: int, unroll_length: int):
        self.link, self.T = link, unroll_length
        self.slot, self.pos = np.array([self.link.free_q.get() for _ in range(num_envs)]), np.zeros(num_envs, np.int64)

    def write(self, ids, row, core_state=None):
        buffers, T, core_state = self.link.buffers, self.T, core_state or {}
        sl, p = torch.from_numpy(self.slot[ids]), torch.from_numpy(self.pos[ids])
        for k, v in row.items():
            buffers[k][sl, p] = v
        start = p == 0  # rows that open a slot: the LSTM state before them is kept
        for k, v in core_state.items():
            buffers[k][sl[start]] = v[start]
        self.pos[ids] += 1
        for i in np.flatnonzero(self.pos[ids] == T + 1):
            e, new = ids[i], self.link.free_q.get()
            for k in row:
                buffers[k][new, 0] = buffers[k][self.slot[e], T]
            for k, v in core_state.items():  # row T's state opens the next slot
                buffers[k][new] = v[i]
            self.link.full_q.put(int(self.slot[e]))
            self.slot[e], self.pos[e] = new, 1


class ActorPool:
    """The learner's side: one process per config running `act`, batches of full unrolls (`next_batch`), the
    learner's weights published to the actors (`publish`), their finished episodes (`episodes`), `close`."""

    def __init__(self, cfgs, agent, specs, batch_size, device):
        ctx = torch.multiprocessing.get_context("spawn")
        self.batch_size, self.device, self.episodes = batch_size, device, []
        num_slots = sum(cfg.num_envs for cfg in cfgs) + 4 * batch_size
        buffers = {k: torch.zeros((num_slots, *shape), dtype=dt).share_memory_() for k, (shape, dt) in specs.items()}
        shared, version = copy.deepcopy(agent).cpu().share_memory(), torch.zeros(1, dtype=torch.long).share_memory_()
        self.link = ActorLink(shared, version, buffers, ctx.Queue(), ctx.Queue(), ctx.Queue())
        self.agent, self.version = shared, version  # the network the actors act with, and how often it was published
        for i in range(num_slots):
            self.link.free_q.put(i)
        self.workers = start_workers(act, cfgs, self.link)

    def next_batch(self, on_wait=None):
        """`batch_size` unrolls on the learner's device, `[T+1, B, ...]` (`core_*`: `[B, ...]`); `on_wait(ready)`
        while they are collected. Raises WorkerError (with its traceback) if an actor died."""
        idx = []
        while len(idx) < self.batch_size:
            try:
                idx.append(self.link.full_q.get(timeout=1.0))
            except queue.Empty:
                check_workers(self.workers, "actor", must_live=True)
            if on_wait is not None:
                on_wait(len(idx))
        while not self.link.msg_q.empty():
            self.episodes.append(self.link.msg_q.get()[1:])
        check_workers(self.workers, "actor", must_live=True)
        idx_t = torch.tensor(idx)
        batch = {k: v[idx_t] for k, v in self.link.buffers.items()}
        for i in idx:
            self.link.free_q.put(i)
        pin = self.device.type == "cuda"
        batch = {k: v if k.startswith("core_") else v.transpose(0, 1) for k, v in batch.items()}
        return {k: (v.pin_memory() if pin else v).to(self.device, non_blocking=True) for k, v in batch.items()}

    def publish(self, state):
        """Copies `state` (a state_dict) into the network the actors act with; they load it at their next step."""
        with torch.no_grad():
            for dst, src in zip(self.agent.state_dict().values(), state.values()):
                dst.copy_(src)
        self.version += 1

    def take_episodes(self) -> list:
        episodes, self.episodes = self.episodes, []
        return episodes

    def close(self):
        stop_workers(self.workers)


def check_actor_args(args) -> list[str]:
    """The actors' options, checked before any work (UsageError): a multi-task run's games (Atari, the same share of
    the actors each), the unroll, the batch over the learners and its minibatches, the envs per actor and their
    async batch, a run of at least one batch. Returns the games of a multi-task run (none for one task)."""
    games, world = expand_env_ids(getattr(args, "env_ids", ())), world_size()
    steps = args.batch_size * args.unroll_length
    per_actor, mb = args.num_envs // max(args.num_actors, 1), getattr(args, "num_minibatches", world)
    for game in games:
        env_spec(game, discrete=True)
        require(
            is_atari(game),
            f"--env-ids takes Atari games (e.g. Pong-v5 Breakout-v5, or a preset: atari57, atari5); {game} is not one",
        )
    require(
        not games or args.num_actors % len(games) == 0,
        f"--num-actors {args.num_actors} must be a multiple "
        f"of the number of games ({len(games)}) so that every game gets the same share of the actors",
    )
    require(args.unroll_length >= 1, f"--unroll-length must be at least 1, got {args.unroll_length}")
    require(
        args.batch_size >= 1 and args.batch_size % world == 0,
        f"--batch-size {args.batch_size} must be a positive multiple of the number of learner processes ({world})",
    )
    require(
        1 <= args.num_actors <= args.num_envs and args.num_envs % args.num_actors == 0,
        f"--num-envs {args.num_envs} must be a positive multiple of --num-actors {args.num_actors}"
        + (" (with --env-ids: one actor per game unless given)" if games else ""),
    )
    require(
        0 <= args.env_batch_size <= per_actor,
        f"--env-batch-size {args.env_batch_size} must be between 1 "
        f"and the envs per actor ({per_actor}), or 0 for half of them",
    )
    require(
        args.total_timesteps >= steps,
        f"--total-timesteps {args.total_timesteps} is less than one batch (batch-size x unroll-length = {steps} steps)",
    )
    require(
        mb >= 1 and mb % world == 0 and args.batch_size % mb == 0,
        f"--num-minibatches {mb} must divide "
        f"--batch-size {args.batch_size} and be a multiple of the number of learner processes ({world})",
    )
    return games


class WorkerError(RuntimeError):
    """A worker process raised (its traceback) or died (its exit code)."""


def run_worker(i, target, per_worker, *args):
    """Worker process i, started by torch's `start_processes` (whose `join` brings an exception's traceback back):
    Ctrl-C is its learner's to handle, it dies with its learner, one torch thread."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.multiprocessing._prctl_pr_set_pdeathsig(signal.SIGKILL)  # torch asks for SIGINT, ignored here
    if multiprocessing.parent_process().is_alive():  # else the parent died before the line above
        torch.set_num_threads(1)
        target(per_worker[i], *args)


def start_workers(target, per_worker, *args):
    """One process per item of `per_worker`, running `target(item, *args)`."""
    run = (target, per_worker, *args)
    return torch.multiprocessing.start_processes(run_worker, run, len(per_worker), join=False, start_method="spawn")


def check_workers(workers, what, must_live=False) -> None:
    """WorkerError if a worker raised (with its traceback) or died (`must_live`: ended at all); torch's `join` has
    then stopped the others."""
    try:
        workers.join(timeout=0, grace_period=2.0)
    except torch.multiprocessing.ProcessRaisedException as e:  # a header line, then the traceback
        raise WorkerError(f"{what} {e.error_index} failed:" + str(e).partition("following error:")[2]) from None
    except torch.multiprocessing.ProcessExitedException as e:
        raise WorkerError(f"{what} {e.error_index} died with exit code {e.exit_code}") from None
    if must_live and any(p.exitcode == 0 for p in workers.processes):
        raise WorkerError(f"{what} ended before its learner")


def stop_workers(workers) -> None:
    for p in (p for p in workers.processes if p.is_alive()):
        p.terminate()
    for p in workers.processes:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def learner_process(args):
    """(rank, world, device) of this learner: the process group under torchrun, the seeds (seed + rank), cudnn's
    determinism and torch's threads (`--learner-threads`, or the cores shared among the learners)."""
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


class Interrupt:
    """Ctrl-C and SIGTERM: stop at once, dropping the update in progress, except inside `with commit():` (the lines
    that change the training state), which finishes first; a second Ctrl-C stops at once wherever it is. Once it
    has raised, later signals change nothing (the shutdown under way must not be cut short)."""

    def __init__(self):
        self.signals, self.committing, self.raised = [], False, False
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum, frame):
        self.signals.append(signum)
        if not self.raised and (len(self.signals) > 1 or not self.committing):
            self.raised = True
            raise KeyboardInterrupt

    @property
    def once(self) -> bool:
        return len(self.signals) <= 1

    @contextlib.contextmanager
    def commit(self):
        self.committing = True
        try:
            yield
        finally:
            self.committing = False
        if self.signals and not self.raised:
            self.raised = True
            raise KeyboardInterrupt


def fail(error: Exception, run_path: str, pool) -> None:
    """A failed actor or a non-finite value: the error line (and where the last good checkpoint is), the actors
    stopped, exit 1 (torchrun stops the other learners)."""
    print(f"error: {error}", file=sys.stderr, flush=True)
    path = os.path.join(run_path, "checkpoint.pt")
    if "NonFiniteError" in f"{type(error).__name__} {error}":
        advice = "no checkpoint was written before it; try a lower --learning-rate"
        if os.path.isfile(path):
            step = torch.load(path, weights_only=False)["global_step"]
            advice = f"the last good checkpoint (step {step}) is kept: continue with --resume {run_path}, or start "
            advice += "again with a lower --learning-rate"
        print(advice, file=sys.stderr, flush=True)
    if pool is not None:
        pool.close()
    os._exit(1)


def stop_on_interrupt(pool, interrupt: Interrupt, save, log, world: int) -> None:
    """Ctrl-C or SIGTERM: the actors stopped; after one signal `save()` (the last completed update; None where
    there is none yet) and how to continue; exit 130."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the shutdown short
    print("interrupted: stopping actors", file=sys.stderr, flush=True)
    if pool is not None:
        pool.close()
        if interrupt.once and save is not None:
            step, script = save(), os.path.basename(__file__)
            again = f"torchrun --standalone --nproc_per_node {world} {script}" if world > 1 else f"python {script}"
            if log.writer is not None:
                print(f"checkpoint at step {step}: continue with {again} --resume {log.path}", file=sys.stderr)
    sys.exit(130)


class NonFiniteError(RuntimeError):
    """A loss, gradient or parameter became NaN or infinite: the run stops before it spoils its checkpoint."""


def check_finite(where: str, **named) -> None:
    """NonFiniteError naming the first of `named` (tensors or numbers) with a NaN or an infinity (one host sync)."""
    flags = [torch.isfinite(torch.as_tensor(v).detach()).all() for v in named.values()]
    ok = torch.stack([f.to(flags[0].device) for f in flags])
    if not bool(ok.all()):
        raise NonFiniteError(f"non-finite {list(named)[int((~ok).int().argmax())]} {where}")


def check_finite_parameters(where: str, **modules) -> None:
    """check_finite over every parameter and buffer of the given modules, named `<module>.<parameter>`."""
    named = {f"{n}.{k}": v for n, m in modules.items() for k, v in m.state_dict().items() if v.is_floating_point()}
    check_finite(where, **named)


def save_atomic(obj, path: str) -> None:
    """torch.save through a temporary file and a rename: a run killed while saving keeps its last good file."""
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


def loss_stats(result) -> dict:
    """The TensorBoard tags of a loss's named tuple: `losses/<name>` for its parts, `stats/<name>` for the other
    scalars (the total and what is not a scalar left out)."""
    items = [(k, v.detach()) for k, v in result._asdict().items() if k != "loss" and v.dim() == 0]
    return {(f"losses/{k}" if k.endswith("loss") else f"stats/{k}"): v for k, v in items}


# Defaults by task family: `--env-id` alone picks its family's settings; a flag the user gives wins.
PAPER, FAMILY_NAMES = (
    "the paper's settings (the Args defaults)",
    dict(atari="Atari", mujoco="MuJoCo / dm_control", classic="classic control"),
)


def family_key(args, table) -> str:
    """The run's entry of `table`: its family, or `<family>_cpu` where there is one and no GPU is used."""
    family = "atari" if getattr(args, "env_ids", ()) else task_family(args.env_id)
    gpu = getattr(args, "cuda", False) and torch.cuda.is_available()
    return f"{family}_cpu" if f"{family}_cpu" in table and not gpu else family


def parse_args(argv=None, table=FAMILY_DEFAULTS, cls=None):
    """tyro's flags over the family's defaults: a flag given wins, `--help` shows the values a run would take;
    none under `--preset paper`, nor on `--resume` (the run keeps its own arguments)."""
    import tyro

    argv, cls = sys.argv[1:] if argv is None else list(argv), cls or Args
    first, _ = tyro.cli(cls, args=argv, add_help=False, return_unknown_args=True)  # --env-id, --preset, ...
    family = first.preset != "paper" and not first.resume
    overrides = table.get(family_key(first, table), (PAPER, {}))[1] if family else {}
    if family and getattr(first, "env_ids", ()):
        overrides = {**overrides, **multi_task_defaults(first, dataclasses.replace(cls(), **overrides), argv)}
    return tyro.cli(cls, args=argv, default=dataclasses.replace(cls(), **overrides))


def multi_task_defaults(first, family, argv) -> dict:
    """With --env-ids: one actor per game, unless --num-actors is given, and the family's envs rounded up to a
    multiple of the actors, unless --num-envs is given (every game the same share of both). `first`: the flags as
    given; `family`: the family's defaults."""
    given = {a.split("=")[0].replace("_", "-") for a in argv if a.startswith("--")}
    actors = first.num_actors if "--num-actors" in given else len(expand_env_ids(first.env_ids))
    envs = first.num_envs if "--num-envs" in given else -(-family.num_envs // actors) * actors
    return dict(num_actors=actors, num_envs=envs)


def describe_defaults(args, table=FAMILY_DEFAULTS) -> tuple[str, str]:
    """(family, where the defaults came from), for the start-up line and args.json."""
    key = family_key(args, table)
    source, overrides = table.get(key, (PAPER, {}))
    if args.preset == "paper":
        return key.removesuffix("_cpu"), PAPER + ", forced by --preset paper"
    source = f"no GPU: {source}; --preset paper for the paper's" if key.endswith("_cpu") else source
    show = [
        f"{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in overrides.items()
    ]
    many = ""
    if getattr(args, "env_ids", ()):
        many = f"; --env-ids: {args.num_actors} actors, {args.num_envs} envs (one actor per game unless given)"
    return key.removesuffix("_cpu"), source + (": " + ", ".join(show) if show else "") + many


def resume_args(args):
    """With `--resume`: the run's own arguments and its checkpoint (loaded into the objects once they exist)."""
    return resume_checkpoint(args.resume, os.path.basename(__file__), Args) if args.resume else (args, None)


def new_run_folder(path: str) -> str:
    """Creates the run folder `path`, or `path_2`, `path_3`, ... where a run that started in the same second took
    the name (`os.mkdir` is atomic: two runs never share a folder)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    name, k = path, 1
    while True:
        try:
            os.mkdir(name)
            return name
        except FileExistsError:
            k += 1
            name = f"{path}_{k}"


class RunLog:
    """The run folder: args.json, TensorBoard curves, the console line, summary.json. `resumed` (a checkpoint or
    None) gives the step, returns and wall time to go on from. Only rank 0 (`write`) writes."""

    def __init__(self, args, task_name, resumed, describe, write=True):
        self.args, self.writer, self.first, resumed = args, None, None, resumed or {}
        self.path = args.resume or os.path.join(
            args.run_dir, f"{task_name}__{args.exp_name}__{args.seed}__{int(time.time())}"
        )
        self.returns, self.groups = list(resumed.get("returns", [])), dict(resumed.get("groups", {}))  # groups: games
        self.start_step, self.previous_wall = resumed.get("global_step", 0), resumed.get("wall_time_s", 0.0)
        self.start = self.last_log = self.last_line = time.time()  # last_line: also the lines while collecting
        if write:
            from torch.utils.tensorboard import SummaryWriter

            self.path = self.path if args.resume else new_run_folder(self.path)
            os.makedirs(self.path, exist_ok=True)
            family, source = describe_defaults(args)
            print(f"task family: {FAMILY_NAMES[family]}; defaults: {source}", flush=True)
            with open(os.path.join(self.path, "args.json"), "w") as f:
                json.dump({**dataclasses.asdict(args), "task_family": family, "defaults_from": source}, f, indent=2)
            self.writer = SummaryWriter(self.path, purge_step=self.start_step + 1 if resumed else None)
            print(f"run folder: {self.path}  ({describe})", flush=True)

    def scalars(self, values: dict, step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, float(value), step)

    def episode(self, score, length, step, *groups) -> None:
        self.returns.append(score)
        self.scalars({"charts/episodic_return": score, "charts/episodic_length": length}, step)
        for group in groups:
            self.groups.setdefault(group, []).append(score)
            self.writer.add_scalar(f"charts/{group}/episodic_return", score, step)

    def first_update(self, step: int) -> None:
        self.first = self.first or (time.time(), step)  # the steady SPS leaves out the start-up

    def state(self, step: int, **script_state) -> dict:
        """A checkpoint: the script's state, what this log goes on from, the run's arguments."""
        groups, wall = {g: r[-10:] for g, r in self.groups.items()}, self.previous_wall + time.time() - self.start
        log = dict(global_step=step, returns=self.returns[-100:], groups=groups, wall_time_s=wall)
        return {**script_state, **log, "args": dataclasses.asdict(self.args), "script": os.path.basename(__file__)}

    def due(self) -> bool:
        return time.time() - self.last_log >= self.args.log_interval

    def console(self, step: int, extra: str = "", collecting=None) -> None:
        """The progress line (and charts/SPS); with `collecting` (unrolls ready, needed, steps per unroll) the line
        printed while a batch is collected, at most every --log-interval seconds (at least 1 s)."""
        now = time.time()
        if collecting is not None:
            if now - self.last_line < max(self.args.log_interval, 1.0):
                return
            ready, needed, T = collecting
            sps = (step - self.start_step + ready * T) / max(now - self.start, 1e-9)
            line = f"step {step:>10d}/{self.args.total_timesteps} | SPS {sps:7.0f} | collecting a batch: "
            print(f"{line}{ready}/{needed} unrolls of {T} steps", flush=True)
            self.last_line = now
            return
        sps = (step - self.start_step) / max(now - self.start, 1e-9)
        self.writer.add_scalar("charts/SPS", sps, step)
        recent = f"{np.mean(self.returns[-100:]):.1f}" if self.returns else "n/a"
        left = f"{max(self.args.total_timesteps - step, 0) / sps / 60:.1f} min" if sps > 0 else "n/a"
        print(
            f"step {step:>10d}/{self.args.total_timesteps} | SPS {sps:7.0f} | return(100) {recent:>8} "
            f"| episodes {len(self.returns)}{' | ' + extra if extra else ''} | ETA {left}",
            flush=True,
        )
        self.last_log = self.last_line = now

    def end(self, model: dict, end_time: float, device, games=()) -> dict:
        """model.pt (with `--save-model`), the evaluation (each game's, with a table, for a multi-task model; the
        first game's first episode filmed with `--capture-video`), summary.json."""
        if self.args.save_model:
            torch.save(model, os.path.join(self.path, "model.pt"))
        step, summary, eval_mean, n = model["global_step"], {}, None, self.args.eval_episodes
        if n > 0:
            film, seed = self.path if self.args.capture_video else None, self.args.seed + 10_000
            policy = lambda k: make_eval_policy(model, k, str(device))  # noqa: E731
            if games:
                _, table = evaluate_games(policy, games, n, seed, os.path.join(self.path, "evaluation"), film)
                eval_mean = float(np.mean([r["mean"] for r in table["games"]]))
                self.scalars({f"charts/{r['env_id']}/eval_return": r["mean"] for r in table["games"]}, step)
                self.scalars({"charts/eval_median_human_normalized": table["median_human_normalized"]}, step)
                summary = {f"eval_{k}": table[k] for k in ("median_human_normalized", "mean_human_normalized")}
                summary["eval_per_game"] = table["games"]
            else:
                eval_mean = float(np.mean(evaluate(policy, model["env_id"], n, None, seed, film)))
                self.scalars({"charts/eval_return": eval_mean}, step)
                print(f"evaluation over {n} episodes: mean {eval_mean:.1f}", flush=True)
        if games:
            last10 = {g: float(np.mean(self.groups[g][-10:])) if self.groups.get(g) else None for g in games}
            summary.update(env_ids=list(games), mean_episodic_return_last_10_per_game=last10)
        steady = None
        if self.first is not None and end_time > self.first[0] and step > self.first[1]:
            steady = (step - self.first[1]) / (end_time - self.first[0])
        summary = {
            "env_id": f"{len(games)}games" if games else self.args.env_id,
            "total_timesteps": step,
            "wall_time_s": self.previous_wall + end_time - self.start,
            "sps": (step - self.start_step) / max(end_time - self.start, 1e-9),
            "sps_after_first_update": steady,
            "mean_episodic_return_last_100": float(np.mean(self.returns[-100:])) if self.returns else None,
            "eval_mean_return": eval_mean,
            **summary,
        }
        with open(os.path.join(self.path, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        self.writer.close()
        return summary


def cli():
    """tyro's flags, the family's defaults for the flags not given, bad input as one line (exit status 2)."""
    try:
        main(parse_args())
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    cli()
