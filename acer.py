"""ACER, actor-critic with experience replay, discrete (Atari, any envpool discrete task) and continuous actions: Wang,
Bapst, Heess, Mnih, Munos, Kavukcuoglu, de Freitas (2017), "Sample Efficient Actor-Critic with Experience Replay".

The off-policy counterpart of A3C. Hogwild workers (processes sharing one network and RMSProp's statistics) act for
k steps, learn from that segment, store it with the behaviour policy μ(·|x) in their own replay memory, then learn
from Poisson(r) segments sampled from it. The critic Q learns from Retrace targets (traces min(1, π/μ)); the policy
gradient truncates its importance weight at c and corrects the bias with Q; an efficient trust region keeps the
policy within a linearised KL δ of a running average of past policies.

| paper                                                           | here                                   |
|-----------------------------------------------------------------|----------------------------------------|
| Eq. (5) Retrace target Q^ret (Algorithm 2: ρ̄ = min(1, ρ))       | `retrace`                              |
| Eqs. (7)-(10) truncated importance weight with bias correction  | `acer_policy_gradient`                 |
| Eq. (6) critic update (Q^ret − Q)∇Q                             | `acer_loss`                            |
| Eqs. (11)-(12) trust region with the average policy network     | `trust_region_step`, `kl_gradient`     |
| Sec. 3.3 θ_a ← α θ_a + (1 − α) θ                                | `update_average`                       |
| Algorithm 1: on-policy step, then Poisson(r) replay steps       | `train_worker`                         |
| Sec. 4: Atari network, k, c, δ, α, β, γ, replay size            | `Agent`, `Args` defaults               |
| Eq. (13) stochastic dueling network Q̃ = V + A − mean_i A(x, u_i) | `ContinuousAgent.q_tilde`              |
| Eq. (16) Gaussian ĝ^acer with Q^opc (App. B), Eq. (14) V update | `gaussian_policy_gradient`             |
| Algorithm 3: c_i = min(1, ρ^(1/d)) traces, replay-only learning | `acer_loss_continuous`, `train_worker` |
| Sec. 6: σ = 0.3, n = 5, k = 50, replay 5,000, α = 0.995         | `ContinuousAgent`, `Args` defaults     |

What the paper leaves open (the optimiser, the initialisation, replay storage, the continuous truncation c and
network) and the measurements behind the defaults: docs/acer.md.

    python acer.py --env-id Breakout-v5
    python acer.py --env-id CartPole-v1 --num-workers 2 --num-envs 4
"""

import collections
import contextlib
import copy
import dataclasses
import itertools
import json
import math
import os
import queue
import signal
import sys
import time
from typing import Literal, NamedTuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from common.envs import EpisodeTracker, UsageError, check_render, env_spec, flat_obs_dim, flatten_obs, is_atari
from common.envs import make_env, require, require_in, task_family, to_env_action
from common.evaluation import evaluate_model, resume_checkpoint
from common.networks import NATURE, MLPTorso, RunningNorm, ShallowTorso, init_output_, init_weights_


@dataclasses.dataclass
class Args:
    env_id: str = "Breakout-v5"  # envpool task id, discrete (Atari *-v5, CartPole-v1) or continuous (HalfCheetah-v4)
    preset: Literal["family", "paper"] = "family"  # family: the env id's family defaults; paper: the paper's everywhere
    exp_name: str = "acer"  # name of this experiment, part of the run folder's name
    seed: int = 1  # seed of the initial weights; worker w: torch seed + w, envs from seed + w·num_envs
    torch_deterministic: bool = True  # the house flag; no effect here: the workers run on the CPU, without cuDNN
    cuda: bool = False  # the house flag, refused: the workers share their parameters in CPU memory
    total_timesteps: int = 20_000_000  # environment steps over all workers, on-policy steps only (80M frames on Atari)
    num_workers: int = 0  # actor-learner processes; 0: one per CPU core (the paper: 16 threads, Sec. 4)
    num_envs: int = 1  # environments per worker, stepped together (1 in the paper)
    k: int = 20  # k, steps per segment and update (Sec. 4)
    replay_ratio: float = 4.0  # r, replay updates per on-policy update, Poisson (Algorithm 1; Sec. 4); 0: no replay
    replay_size: int = 50_000  # replay per worker, in env steps (Sec. 4)
    c: float = 10.0  # c, truncation of the policy gradient's importance weight (Sec. 4)
    delta: float = 1.0  # δ, trust-region bound on the linearised KL to the average policy (Sec. 4)
    avg_decay: float = 0.99  # α of the average policy network (Sec. 4)
    trust_region: bool = True  # the trust region (Sec. 3.3); off: the paper's 'without trust region' ablation
    learning_rate: float = 1e-3  # η, constant (Sec. 4)
    rmsprop_alpha: float = 0.99  # RMSProp decay of the squared-gradient average (as A3C)
    rmsprop_eps: float = 0.1  # RMSProp ε, inside the square root (as a3c.py)
    gamma: float = 0.99  # γ, discount (Sec. 4)
    ent_coef: float = 0.001  # β, entropy regularisation (Sec. 4)
    value_coef: float = 0.5  # weight of the critic loss (Q^ret − Q)²; 0.5 gives Eq. (6)'s gradient
    max_grad_norm: float = 40.0  # gradient-norm clipping for pixels (not in the paper; as a3c.py); 0: none
    hidden: int = 200  # ReLU units of the hidden layer for vector observations (and of the advantage network)
    policy_std: float = 0.3  # σ, fixed standard deviation of the Gaussian policy in [-1, 1] action units (Sec. 6)
    scale_rewards: bool = False  # continuous: r / std of the running discounted return, clipped ±10 (not the paper's)
    sdn_samples: int = 5  # n, samples u_i ~ π of the stochastic dueling network (Eq. 13; Sec. 6)
    bf16: bool = False  # Atari: the updates' network passes in bfloat16, channels-last; acting, loss math float32
    save_model: bool = False  # write model.pt (weights, what evaluation needs) in the run folder
    capture_video: bool = False  # record the first evaluation episode (an animated PNG) in the run folder
    eval_episodes: int = 10  # evaluation episodes at the end of training, sampling from the policy (0: none)
    run_dir: str = "runs"  # folder of the run folders
    log_interval: float = 5.0  # seconds between console progress lines
    checkpoint_interval: float = 300.0  # seconds between checkpoints (not the replay; also at the end and on Ctrl-C)
    resume: str = ""  # a run folder to continue from its checkpoint.pt, with its own arguments


# Defaults by task family, the same on every device (a flag given wins; the measurements: docs/acer.md).
FAMILY_DEFAULTS = {
    "atari": ("the paper's Atari settings (Sec. 4) with RMSProp ε 1e-5, as a3c.py", dict(rmsprop_eps=1e-5)),
    "mujoco": (
        "the paper's continuous-control settings (Sec. 6) with five values measured on InvertedPendulum-v4, "
        "Hopper-v4 and HalfCheetah-v4",
        dict(learning_rate=5e-4, value_coef=0.01, scale_rewards=True, rmsprop_eps=1e-5, delta=0.3),
    ),
    "classic": ("settings measured on CartPole-v1", dict(total_timesteps=300_000, num_envs=4)),
}
PAPER = "the paper's settings (the Args defaults)"  # the defaults' source without a family entry
# The Args defaults are Sec. 4's (Atari); continuous actions take Sec. 6's values (its learning rate the middle of the
# range it searched), vector observations no gradient clipping. These hold with --preset paper too.
CONTINUOUS = dict(k=50, replay_size=5_000, c=5.0, avg_decay=0.995, learning_rate=2.2e-4)


def defaults_for(args, given=()) -> tuple[str, str, dict]:
    """(task family, the defaults' source, their values) of a run of `args`: the actions' and observations' values
    above and, unless `--preset paper`, the family's on top."""
    family = task_family(args.env_id)
    source, values = FAMILY_DEFAULTS.get(family, (PAPER, {}))
    if args.preset == "paper":
        source, values = PAPER + ", forced by --preset paper", {}
    own = {} if hasattr(env_spec(args.env_id).action_space, "n") else dict(CONTINUOUS)
    return family, source, {**own, **({} if is_atari(args.env_id) else dict(max_grad_norm=0.0)), **values}


# ---------------------------------------------------------------------------------------------------------
# The paper's math: pure functions of time-major [T, B] tensors.


@torch.no_grad()
def retrace(rewards, discounts, q_taken, values, truncated_rhos, bootstrap_value):
    """Eq. (5), as Algorithm 2 computes it backwards from Q^ret = V(x_k) (the bootstrap):

        Q^ret_t = r_t + γ_t [ ρ̄_{t+1} (Q^ret_{t+1} − Q(x_{t+1}, a_{t+1})) + V(x_{t+1}) ]

    with per-step discounts γ_t = γ (1 − done_t) and ρ̄_t = min(1, ρ_t) given by the caller. `[T, B]` inputs,
    bootstrap_value `[B]`; returns Q^ret `[T, B]`."""
    carry, out = bootstrap_value, []
    for t in reversed(range(rewards.shape[0])):
        q_ret = rewards[t] + discounts[t] * carry
        out.append(q_ret)
        carry = truncated_rhos[t] * (q_ret - q_taken[t]) + values[t]
    return torch.stack(out[::-1])


def trust_region_step(g, k, delta):
    """Eq. (12), row-wise over `[N, D]`: z* = g − max(0, (kᵀg − δ) / ‖k‖²) k, the solution of
    min_z ½‖g − z‖² subject to kᵀz ≤ δ (Eq. 11)."""
    scale = ((k * g).sum(-1, keepdim=True) - delta).clamp(min=0) / (k * k).sum(-1, keepdim=True).clamp(min=1e-12)
    return g - scale * k


PROB_FLOOR = 1e-6  # probabilities are floored here where they divide or enter a log: 1/φ and log φ stay finite


def kl_gradient(avg_probs, probs):
    """k = ∇_φ KL(f(·|φ_a) ‖ f(·|φ)) for categorical f with probabilities φ: −φ_a / φ (Sec. 3.3)."""
    return -avg_probs / probs.clamp(min=PROB_FLOOR)


def acer_policy_gradient(probs, actions, behaviour_probs, q, q_ret, c, ent_coef=0.0):
    """Eq. (10): ĝ^acer with respect to the probabilities φ, per state `[N, A]`:

        ρ̄_t ∇_φ log φ(a_t) (Q^ret − V) + Σ_a [1 − c/ρ(a)]_+ φ(a) ∇_φ log φ(a) (Q(a) − V)  (+ β ∇_φ H(φ))

    with ρ(a) = φ(a)/μ(a), ρ̄_t = min(c, ρ(a_t)), V = Σ_a φ(a) Q(a); ∇_φ log φ(a) = e_a / φ(a), so the correction
    term is [1 − c/ρ(a)]_+ (Q(a) − V) for every a. Inputs are constants. Returns (g, truncated ρ̄_t, ρ_t)."""
    probs, q = probs.detach().clamp(min=PROB_FLOOR), q.detach()
    v = (probs * q).sum(-1, keepdim=True)
    rho_all = probs / behaviour_probs.detach().clamp(min=PROB_FLOOR)
    rho = rho_all.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
    rho_bar = rho.clamp(max=c)
    taken = rho_bar * (q_ret.detach() - v.squeeze(-1)) / probs.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
    g = ((1 - c / rho_all).clamp(min=0) * (q - v)).scatter_add(-1, actions.unsqueeze(-1), taken.unsqueeze(-1))
    if ent_coef:
        g = g - ent_coef * (probs.log() + 1)  # ∇_φ of H = −Σ φ log φ
    return g, rho_bar, rho


class AcerLoss(NamedTuple):
    """The ACER losses' result: the loss and its parts (summed over time, averaged over the B environments) and
    diagnostics (means over the real steps)."""

    loss: torch.Tensor
    policy_loss: torch.Tensor
    value_loss: torch.Tensor
    rho_mean: torch.Tensor  # min(c, ρ), the truncated weight
    truncated_fraction: torch.Tensor  # ρ > c
    trust_region_adjustment: torch.Tensor  # ‖z − ĝ‖ / ‖ĝ‖
    kl_avg: torch.Tensor  # KL(average policy ‖ policy)
    value_mean: torch.Tensor
    entropy: torch.Tensor = torch.tensor(float("nan"))  # NaN where σ is fixed (continuous actions)


def acer_result(phi, g, k, mask, delta, trust_region, critic_loss, value_loss, **per_step) -> AcerLoss:
    """Algorithms 2 and 3 alike: z, the trust-region step (Eq. 12) of ĝ `[N, X]` away from the KL gradient k (ĝ
    without the trust region), zero at reset steps (`mask` `[T, B]`) and back-propagated as −z/B through the
    policy's statistics φ `[T, B, X]`; the loss adds `critic_loss`. Logged: `value_loss`, ‖z − ĝ‖/‖ĝ‖ and the
    means of the `per_step` diagnostics `[T, B]` over the real steps."""
    with torch.no_grad():
        z = trust_region_step(g, k, delta) if trust_region else g
        z, g = (x.view(phi.shape) * mask[..., None] for x in (z, g))
        n = mask.sum().clamp(min=1)
    policy_loss = -(z * phi).sum() / phi.shape[1]  # ∂/∂φ = −z/B: ascent along z
    means = {name: (mask * x).sum() / n for name, x in per_step.items()}
    adjustment = (z - g).norm() / g.norm().clamp(min=1e-12)
    return AcerLoss(policy_loss + critic_loss, policy_loss, value_loss, trust_region_adjustment=adjustment, **means)


def acer_loss(logits, q, avg_logits, actions, rewards, terminated, ended, behaviour_probs, gamma=0.99, c=10.0,
              delta=1.0, ent_coef=1e-3, value_coef=0.5, trust_region=True) -> AcerLoss:  # fmt: skip
    """Algorithm 2 on a segment `[k+1, B]` (row k only bootstraps): a loss whose gradient is the ACER update.

    `logits`, `q`, `avg_logits` (of θ' and θ_a) and μ `[k+1, B, A]`; `actions`, `rewards`, `terminated`, `ended`
    (step t is envpool's reset step) `[k+1, B]`. The policy part back-propagates −z (Eq. 12; −ĝ without the trust
    region) through the softmax; the critic part is value_coef · Σ (Q^ret − Q(x, a))²."""
    probs = F.softmax(logits, dim=-1)
    T, B = actions[:-1].shape
    actions, ended = actions[:-1].long(), ended[:-1]
    mask = (~ended).float()
    q_sa = q[:-1].gather(-1, actions.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        p, values = probs[:-1].detach().clamp(min=PROB_FLOOR), (probs.detach() * q.detach()).sum(-1)
        rho = (p / behaviour_probs[:-1].clamp(min=PROB_FLOOR)).gather(-1, actions.unsqueeze(-1)).squeeze(-1)
        truncated = torch.where(ended, 0.0, rho.clamp(max=1.0))  # ρ̄ = min(1, ρ); 0 cuts the trace at a reset step
        discounts = gamma * (~terminated[:-1]).float()
        q_ret = retrace(rewards[:-1], discounts, q_sa.detach(), values[:-1], truncated, values[-1])
        per_state = [x.flatten(0, 1) for x in (p, actions, behaviour_probs[:-1], q.detach()[:-1], q_ret)]
        g, rho_bar, _ = acer_policy_gradient(*per_state, c, ent_coef)
        avg_probs = F.softmax(avg_logits[:-1], dim=-1).clamp(min=PROB_FLOOR)
        k = kl_gradient(avg_probs, p).flatten(0, 1)
        per_step = dict(rho_mean=rho_bar.view(T, B), truncated_fraction=(rho > c).float(), value_mean=values[:-1])
        per_step.update(kl_avg=(avg_probs * (avg_probs.log() - p.log())).sum(-1), entropy=-(p * p.log()).sum(-1))
    value_loss = (mask * (q_ret - q_sa) ** 2).sum() / B
    return acer_result(probs[:-1], g, k, mask, delta, trust_region, value_coef * value_loss, value_loss, **per_step)


def gaussian_ratio(actions, mean, behaviour_mean, std):
    """ρ = f(a|φ) / μ(a|x) for two Gaussians with the same fixed σ: N(φ, σ²I) over N(behaviour_mean, σ²I)."""
    return ((((actions - behaviour_mean) ** 2 - (actions - mean) ** 2) / (2 * std * std)).sum(-1)).exp()


def gaussian_policy_gradient(mean, actions, behaviour_mean, q_opc, values, sampled_actions, q_sampled, std, c):
    """Eq. (16): ĝ^acer with respect to the mean φ of a Gaussian policy N(φ, σ²I) with fixed σ, per state `[N, d]`:

        min(c, ρ_t) ∇_φ log f(a_t|φ) (Q^opc − V) + [1 − c/ρ'_t]_+ (Q̃(x, a'_t) − V) ∇_φ log f(a'_t|φ)

    with ∇_φ log f(a|φ) = (a − φ)/σ², ρ_t = f(a_t|φ)/μ(a_t|x), a'_t ~ π a fresh sample and ρ'_t its ratio; the
    behaviour policy μ is N(behaviour_mean, σ²I). Inputs are constants. Returns (g, min(c, ρ_t), ρ_t)."""
    var = std * std
    rho, rho_sampled = (gaussian_ratio(a, mean, behaviour_mean, std) for a in (actions, sampled_actions))
    rho_bar = rho.clamp(max=c)
    g = (rho_bar * (q_opc - values))[:, None] * (actions - mean) / var
    correction = (1 - c / rho_sampled).clamp(min=0) * (q_sampled - values)
    g = g + correction[:, None] * (sampled_actions - mean) / var
    return g, rho_bar, rho


def acer_loss_continuous(mean, values, q_taken, q_sampled, sampled_actions, avg_mean, actions, rewards, terminated,
                         ended, behaviour_mean, std=0.3, gamma=0.99, c=5.0, delta=1.0, value_coef=0.5,
                         trust_region=True) -> AcerLoss:  # fmt: skip
    """Algorithm 3 on a replayed segment `[k+1, B]` (row k only bootstraps): a loss whose gradient is the update.

    `mean`, `avg_mean` (of θ' and θ_a), `actions`, the behaviour means `[k+1, B, d]`; `values`, `rewards`,
    `terminated`, `ended` `[k+1, B]`; `q_taken` Q̃(x_i, a_i) (Eq. 13, differentiable), `q_sampled` Q̃(x_i, a'_i) for
    fresh a'_i ~ π `[k, B]`. Q^ret's traces are c_i = min(1, ρ_i^(1/d)) (Sec. 5.1), Q^opc's 1 (App. B); the critic
    gets (Q^ret − Q̃)∇Q̃ + min(1, ρ)(Q^ret − Q̃)∇V (Algorithm 3) times 2 value_coef; `entropy` is NaN (σ is fixed)."""
    T, B, d = mean[:-1].shape
    mask = (~ended[:-1]).float()
    with torch.no_grad():
        m, v, qt = mean[:-1].detach(), values.detach(), q_taken.detach()
        rho = gaussian_ratio(actions[:-1], m, behaviour_mean[:-1], std)
        traces = torch.where(ended[:-1], 0.0, rho.pow(1.0 / d).clamp(max=1.0))  # c_i; 0 cuts at a reset step
        discounts = gamma * (~terminated[:-1]).float()
        q_ret, q_opc = (retrace(rewards[:-1], discounts, qt, v[:-1], x, v[-1]) for x in (traces, mask))
        per_state = (m, actions[:-1], behaviour_mean[:-1], q_opc, v[:-1], sampled_actions, q_sampled)
        g, rho_bar, _ = gaussian_policy_gradient(*[x.flatten(0, 1) for x in per_state], std, c)
        k = (m - avg_mean[:-1]).reshape(-1, d) / (std * std)  # ∇_φ KL(N(φ_a, σ²) ‖ N(φ, σ²))
        kl = 0.5 * ((m - avg_mean[:-1]) ** 2).sum(-1) / (std * std)
        per_step = dict(rho_mean=rho_bar.view(T, B), truncated_fraction=(rho > c).float(), kl_avg=kl, value_mean=v[:-1])
    td = q_ret - q_taken
    value_loss = (mask * (td**2 - 2 * rho.clamp(max=1.0) * td.detach() * values[:-1])).sum() / B
    squared_error = (mask * td**2).sum().detach() / B  # what is logged (value_loss's gradient is Algorithm 3's)
    return acer_result(mean[:-1], g, k, mask, delta, trust_region, value_coef * value_loss, squared_error, **per_step)


@torch.no_grad()
def update_average(avg_agent, agent, decay):
    """Sec. 3.3: θ_a ← α θ_a + (1 − α) θ after every update of θ, the weights only (the workers copy the statistics)."""
    for pa, p in zip(avg_agent.parameters(), agent.parameters()):
        pa.mul_(decay).add_(p, alpha=1 - decay)


# ---------------------------------------------------------------------------------------------------------
# The agent.


class Agent(nn.Module):
    """One network with a softmax policy head and a Q head (Sec. 3.1). `forward(obs)` takes `[T, B, ...]` and
    returns logits and Q values, both `[T, B, A]`."""

    def __init__(self, obs_shape, num_actions, hidden=200):
        super().__init__()
        self.config = dict(obs_shape=tuple(obs_shape), num_actions=num_actions, hidden=hidden)
        pixels = len(obs_shape) == 3  # Sec. 4: Mnih et al. (2015)'s network; vectors: one hidden layer of `hidden`
        self.torso = ShallowTorso(obs_shape, **NATURE) if pixels else MLPTorso(math.prod(obs_shape), (hidden,), nn.ReLU)
        self.policy = nn.Linear(self.torso.out_features, num_actions)
        self.q = nn.Linear(self.torso.out_features, num_actions)
        if pixels:  # with PyTorch's default init the torso starts nearly state-blind on Atari frames
            init_weights_(self.torso)  # CleanRL's: gain √2, zero biases; readouts 0.01 and 1
            init_output_(self.policy, 0.01)
            init_output_(self.q, 1.0)

    def forward(self, obs):
        x = self.torso(obs.flatten(0, 1))
        return self.policy(x).view(*obs.shape[:2], -1), self.q(x).view(*obs.shape[:2], -1)


class ContinuousAgent(nn.Module):
    """Sec. 5-6: a Gaussian policy N(φ(x), σ²I) with a fixed σ, and a stochastic dueling network (Eq. 13): V(x) and a
    small separate network A(x, a). `forward(obs)` `[T, B, D]` gives the mean `[T, B, d]` and V `[T, B]`. The policy's
    θ and the critic's θ_v (V and A) apart (Algorithm 3); running statistics of the observations and, with
    `scale_rewards`, of the discounted return, which the workers update (not the paper's)."""

    def __init__(self, obs_shape, action_dim, hidden=200, policy_std=0.3, scale_rewards=False):
        super().__init__()
        self.config = dict(obs_shape=tuple(obs_shape), action_dim=action_dim, hidden=hidden, policy_std=policy_std)
        self.config.update(scale_rewards=scale_rewards)
        self.action_dim, self.std = action_dim, policy_std
        obs_dim = int(math.prod(obs_shape))
        self.obs_norm = RunningNorm(obs_dim)
        self.return_norm = RunningNorm(1) if scale_rewards else None  # statistics of the discounted return
        self.torso = MLPTorso(obs_dim, (hidden,), activation=nn.ReLU)  # the mean's
        self.mean = nn.Linear(hidden, action_dim)
        self.value = nn.Linear(hidden, 1)
        self.advantage = nn.Sequential(nn.Linear(obs_dim + action_dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.value_torso = MLPTorso(obs_dim, (hidden,), activation=nn.ReLU)  # V's
        init_output_(self.mean, 0.01)  # pfrl's train_acer_mujoco.py

    def forward(self, obs):
        x = self.obs_norm(obs.flatten(0, 1))
        return self.mean(self.torso(x)).view(*obs.shape[:2], -1), self.value(self.value_torso(x)).view(obs.shape[:2])

    def q_tilde(self, obs, actions, mean, values, n):
        """Eq. (13): Q̃(x, a) = V(x) + A(x, a) − (1/n) Σ_i A(x, u_i), u_i ~ π(·|x) (no gradient through them), for
        `[..., D]` raw observations (normalised here as in `forward`) and `[..., d]` actions."""
        u = mean.detach().unsqueeze(-2) + self.std * torch.randn(*mean.shape[:-1], n, self.action_dim)
        a_all = torch.cat([actions.unsqueeze(-2), u], dim=-2)  # [..., 1 + n, d]
        obs_all = self.obs_norm(obs).unsqueeze(-2).expand(*obs.shape[:-1], n + 1, obs.shape[-1])
        adv = self.advantage(torch.cat([obs_all.float(), a_all], dim=-1)).squeeze(-1)
        return values + adv[..., 0] - adv[..., 1:].mean(-1)


# ---------------------------------------------------------------------------------------------------------
# Hogwild (Sec. 4 and Supp. Eqs. S2-S3 of Mnih et al. 2016): the shared RMSProp, the update, what the workers share;
# one text in a3c.py and acer.py (tests/test_common.py checks it).


class SharedRMSprop(torch.optim.Optimizer):
    """Eqs. (S2)-(S3), elementwise and without locks: g ← α g + (1 − α) Δθ², θ ← θ − η Δθ / √(ĝ + ε), where
    ĝ = g / (1 − α^t) is g bias-corrected by its t-th update (Adam's correction; the paper gives neither it nor ε).
    Uncorrected, g starts at 0 and with ε = 1e-5 the first step moves every weight by η/√(1 − α) = 10η, whatever
    the size of its gradient. g and t are made here, not at the first step, so that
    `share_memory()` shares them with every worker ("Shared RMSProp", Sec. 4); a race on t only delays the
    correction's end. With ε = 0 this is `Adam(betas=(0, α), eps=0)`."""

    def __init__(self, params, lr=1e-3, alpha=0.99, eps=0.1):
        super().__init__(params, dict(lr=lr, alpha=alpha, eps=eps))
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].update(square_avg=torch.zeros_like(p), step=torch.zeros(()))

    def share_memory(self):
        for state in self.state.values():
            state["square_avg"].share_memory_()
            state["step"].share_memory_()
        return self

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, alpha, eps = group["lr"], group["alpha"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, t = self.state[p]["square_avg"], self.state[p]["step"].add_(1)
                g.mul_(alpha).addcmul_(p.grad, p.grad, value=1 - alpha)
                p.addcdiv_(p.grad, (g / (1 - alpha ** t.item()) + eps).sqrt_(), value=-lr)


def hogwild_update(local, shared, optimizer, loss, max_grad_norm):
    """Algorithm S3's 'asynchronous update of θ using dθ': this rollout's gradient at θ', clipped, on the shared θ;
    `.grad` is set anew each time (set once, `zero_grad()` makes it stale). Returns the norm before clipping."""
    local.zero_grad(set_to_none=True)
    loss.backward()
    norm = nn.utils.clip_grad_norm_(local.parameters(), max_grad_norm if max_grad_norm > 0 else float("inf"))
    check_finite("in a worker's update (nothing applied)", loss=loss, gradient=norm)
    for shared_p, local_p in zip(shared.parameters(), local.parameters()):
        shared_p.grad = local_p.grad
    optimizer.step()
    shared.zero_grad(set_to_none=True)
    return norm


@torch.no_grad()
def copy_network(dst, src, obs_lock):
    """dst ← src: the parameters without a lock (Hogwild), the observation statistics (buffers) whole, under theirs."""
    for d, s in zip(dst.parameters(), src.parameters()):
        d.copy_(s)
    with obs_lock:
        for d, s in zip(dst.buffers(), src.buffers()):
            d.copy_(s)


def scale_rewards(rewards, return_var, clip=10.0):
    """--scale-rewards: r / sqrt(Var[R] + 1e-8), clipped to ±10, R the discounted return of the environment's episode
    so far (SB3's VecNormalize, not in the papers): the value learns returns of unit scale whatever the task's."""
    return (rewards / math.sqrt(float(return_var[0]) + 1e-8)).clip(-clip, clip)


def obs_tensor(obs):
    """envpool observations as a tensor: uint8 frames as they are, anything else one float32 vector per env."""
    return torch.from_numpy(obs) if getattr(obs, "dtype", None) == np.uint8 else torch.from_numpy(flatten_obs(obs))


# ---------------------------------------------------------------------------------------------------------
# Replay and the workers: Algorithm 1.


def train_worker(worker_id, args, shared, avg_agent, optimizer, counter, obs_lock, msg_q, halt, started):
    """Algorithm 1 for one actor-learner: an on-policy segment (acted, learned from but for continuous actions, Sec. 6,
    stored raw), then Poisson(r) segments replayed from its memory. Once `halt` is set, it ends after its updates."""
    n, k = args.num_envs, args.k
    torch.manual_seed(args.seed + worker_id)  # every torch draw of this process
    np.random.seed(args.seed + worker_id)
    envs = make_env(args.env_id, n, args.seed + worker_id * n, training=True, num_threads=1)
    local = copy.deepcopy(shared)  # θ', in this process's memory (channels-last with --bf16, as θ)
    continuous = isinstance(local, ContinuousAgent)
    if continuous:  # the env's box, as float32
        low, high = envs.action_space.low.astype(np.float32), envs.action_space.high.astype(np.float32)
    replay = collections.deque(maxlen=max(1, args.replay_size // (k * n)))  # whole segments, the oldest leaves first
    tracker = EpisodeTracker(n)
    obs = obs_tensor(envs.reset()[0])
    ended = torch.zeros(n, dtype=torch.bool)  # obs is the last one of an episode: the next step is a reset step
    last_report = 0.0
    discounted_return = np.zeros(n)  # each environment's discounted return so far (--scale-rewards' statistics)

    def learn(segment):
        """One update: θ' ← θ, the gradient Δθ of the segment's loss at θ', clipped, applied to the shared θ by A3C's
        shared RMSProp without locks (Hogwild), then θ_a's soft update."""
        copy_network(local, shared, obs_lock)
        if args.scale_rewards:
            segment = {**segment, "reward": scale_rewards(segment["reward"], local.return_norm.var)}  # θ's statistics
        out = segment_loss(local, avg_agent, segment, args)
        grad_norm = hogwild_update(local, shared, optimizer, out.loss, args.max_grad_norm)
        update_average(avg_agent, shared, args.avg_decay)
        return {**{k: v for k, v in loss_stats(out).items() if not v.isnan()}, "stats/grad_norm": grad_norm}

    started.wait()  # every worker set up: they take their steps of the budget together, none left to one
    while counter.value < args.total_timesteps and not halt.is_set():
        copy_network(local, shared, obs_lock)
        rows = {key: [] for key in ("obs", "action", "reward", "terminated", "ended", "behaviour", "return")}
        with torch.no_grad():
            for _ in range(k):
                # μ, the behaviour policy, is stored as its mean (continuous: σ is fixed) or its probabilities
                behaviour = local(obs[None])[0][0] if continuous else F.softmax(local(obs[None])[0][0], dim=-1)
                check_finite(f"while acting at step {counter.value}", policy=behaviour)  # before sampling from it
                if continuous:
                    action = behaviour + local.std * torch.randn(behaviour.shape)
                else:
                    action = torch.multinomial(behaviour, 1).squeeze(-1)
                env_action = to_env_action(action.numpy(), low, high) if continuous else action.numpy()
                next_obs, reward, term, trunc, info = envs.step(env_action)
                for _, score, length in tracker.step(info["env_id"], reward, term, trunc, info):
                    msg_q.put(("episode", counter.value, (score, length)))
                discounted_return = discounted_return * args.gamma + reward
                row = (obs, action, reward.astype(np.float32), term, ended, behaviour, discounted_return)
                for key, v in zip(rows, row):
                    rows[key].append(torch.as_tensor(v))
                discounted_return = np.where(term | trunc, 0.0, discounted_return)  # a new array: the row keeps R
                ended = torch.as_tensor(term | trunc)
                obs = obs_tensor(next_obs)
        # row k: the bootstrap observation (its other fields are never used)
        segment = {key: torch.stack([*v, obs if key == "obs" else torch.zeros_like(v[-1])]) for key, v in rows.items()}
        with counter.get_lock():
            step = counter.value
            counter.value += k * n
        stats = {} if continuous else learn(segment)  # Sec. 6: continuous ACER learns from replay only
        with obs_lock:  # the shared statistics take the on-policy observations (the bootstrap one is the next's)
            if continuous:
                shared.obs_norm.update(segment["obs"][:-1])
            if args.scale_rewards:
                shared.return_norm.update(segment["return"][:-1])
            for avg_buffer, buffer in zip(avg_agent.buffers(), shared.buffers()):  # θ_a normalises as θ from now on
                avg_buffer.copy_(buffer)
        replay.append(segment)
        replays = int(np.random.poisson(args.replay_ratio))
        for _ in range(replays):
            replay_stats = learn(replay[int(torch.randint(len(replay), (1,)))])  # uniform
        now, last = time.time(), counter.value >= args.total_timesteps or halt.is_set()  # the last update reported
        if (stats or replays) and ((worker_id == 0 and now - last_report >= 1.0) or last):
            report = {key.replace("stats/", "on_policy/", 1): v for key, v in stats.items()}  # the on-policy update's
            report.update({**(replay_stats if replays else {}), "charts/learning_rate": args.learning_rate})
            report.update({"stats/replay_updates": replays, "stats/replay_segments": len(replay)})
            msg_q.put(("stats", step + k * n, {key: float(v) for key, v in report.items()}))
            last_report = now
    msg_q.put(("done", counter.value, worker_id))


def segment_loss(local, avg_agent, segment, args):
    """Runs the local and average networks over a segment and returns the ACER loss (Algorithm 2 or 3)."""
    hyper = {k: getattr(args, k) for k in ("gamma", "c", "delta", "value_coef", "trust_region")}
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16)  # --bf16: the networks' passes only
    with torch.no_grad(), amp:
        avg_out = avg_agent(segment["obs"])[0].float()
    data = [
        avg_out,
        *(segment[key] for key in ("action", "reward", "terminated", "ended", "behaviour")),
    ]  # θ_a, then data
    if isinstance(local, ContinuousAgent):
        mean, values = local(segment["obs"])
        obs = segment["obs"][:-1].float()
        q_taken = local.q_tilde(obs, segment["action"][:-1], mean[:-1], values[:-1], args.sdn_samples)
        with torch.no_grad():
            sampled = mean[:-1] + local.std * torch.randn(mean[:-1].shape)
            q_sampled = local.q_tilde(obs, sampled, mean[:-1], values[:-1], args.sdn_samples)
        return acer_loss_continuous(mean, values, q_taken, q_sampled, sampled, *data, std=args.policy_std, **hyper)
    with amp:
        logits, q = local(segment["obs"])
    return acer_loss(logits.float(), q.float(), *data, ent_coef=args.ent_coef, **hyper)


def main(args: Args):
    args, resumed = resume_checkpoint(args.resume, os.path.basename(__file__), Args) if args.resume else (args, None)
    args, spec = check_args(args)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    obs_shape = tuple(spec.observation_space.shape) if is_atari(args.env_id) else (flat_obs_dim(spec),)
    discrete = hasattr(spec.action_space, "n")
    if discrete:  # a resumed run's from its own arguments
        agent = Agent(obs_shape, int(spec.action_space.n), args.hidden)
    else:
        action_dim = int(spec.action_space.shape[0])
        agent = ContinuousAgent(obs_shape, action_dim, args.hidden, args.policy_std, scale_rewards=args.scale_rewards)
    avg_agent = copy.deepcopy(agent)  # θ_a starts at θ (and its observation statistics at θ's)
    for net in (agent, avg_agent):  # --bf16: convolutions in channels-last layout, as oneDNN's bfloat16 kernels prefer
        net.to(memory_format=torch.channels_last if args.bf16 else torch.contiguous_format).share_memory()
    optimizer = SharedRMSprop(agent.parameters(), args.learning_rate, args.rmsprop_alpha, args.rmsprop_eps)
    if resumed is not None:  # in place: the tensors stay in shared memory
        for name, part in (("agent", agent), ("avg_agent", avg_agent), ("optimizer", optimizer)):
            part.load_state_dict(resumed[name])
    optimizer.share_memory()  # g and t, read and written by every worker
    nets = dict(agent_config=agent.config, agent=agent.state_dict(), avg_agent=avg_agent.state_dict())
    state = dict(nets, optimizer=optimizer.state_dict())
    model = dict(nets, script="acer", env_id=args.env_id, args=dataclasses.asdict(args))
    if not discrete:  # evaluation maps the policy's [-1, 1] actions to the env's box
        low, high = spec.action_space.low, spec.action_space.high
        model.update(action_low=low.astype(np.float32).tolist(), action_high=high.astype(np.float32).tolist())
    describe = f"{args.num_workers} workers x {args.num_envs} env(s), k {args.k}, replay ratio {args.replay_ratio}, "
    log = RunLog(args, resumed, describe + ("" if args.trust_region else "no ") + "trust region")

    def save(step):  # `state` and `model`: views of the shared tensors as the workers leave them (read without locks)
        weights = {f"{net}.{k}": v for net in ("agent", "avg_agent") for k, v in state[net].items()}
        check_finite(f"at step {step}", **weights)
        log.save(step, state, dict(model, global_step=step) if args.save_model else None)

    step = run_workers(train_worker, (agent, avg_agent, optimizer), log, save)  # Algorithm 1 runs in the workers
    log.end(step, evaluate_model(log, dict(model, global_step=step), make_eval_policy), num_workers=args.num_workers)


def make_eval_policy(checkpoint, num_envs, device="cpu", greedy=False):
    """A callable `policy(obs, rewards, first) -> actions` of a saved model (evaluate.py plays it)."""
    config = checkpoint["agent_config"]
    agent = (ContinuousAgent if "action_dim" in config else Agent)(**config).to(device)
    agent.load_state_dict(checkpoint["agent"])  # with the observation statistics it was trained with

    @torch.no_grad()
    def policy(obs, rewards, first):
        out, _ = agent(obs_tensor(obs).to(device)[None])  # the mean, or the logits
        if isinstance(agent, ContinuousAgent):
            action = out[0] if greedy else out[0] + agent.std * torch.randn_like(out[0])
            low, high = np.asarray(checkpoint["action_low"]), np.asarray(checkpoint["action_high"])
            return to_env_action(action.cpu().numpy(), low, high)
        action = out[0].argmax(-1) if greedy else torch.distributions.Categorical(logits=out[0]).sample()
        return action.cpu().numpy()

    return policy


def check_args(args):
    """Bad input: one clear line before any work (UsageError). Returns the arguments (workers resolved) and the spec."""
    spec = env_spec(args.env_id)
    discrete, pixels = hasattr(spec.action_space, "n"), is_atari(args.env_id)
    require(not args.cuda, "--cuda: acer.py's workers share their parameters in CPU memory (as the paper's threads)")
    if args.capture_video:
        check_render(args.env_id)
    args = dataclasses.replace(args, num_workers=args.num_workers or os.cpu_count() or 1)
    positive = "num_workers num_envs k replay_size sdn_samples hidden c delta learning_rate rmsprop_eps policy_std"
    require_in("(0, inf)", args, positive)
    require_in("[0, 1)", args, "avg_decay rmsprop_alpha")
    require_in("[0, inf)", args, "value_coef ent_coef max_grad_norm replay_ratio")
    require_in("[0, 1]", args, "gamma")
    segment = args.k * args.num_envs
    require(args.total_timesteps >= segment, f"--total-timesteps must be at least one segment ({segment} steps)")
    require(args.replay_size >= segment or not args.replay_ratio, f"--replay-size is below one segment ({segment})")
    require(discrete or args.replay_ratio > 0, "--replay-ratio 0: continuous ACER learns from replay only (Sec. 6)")
    require(not (discrete and args.scale_rewards), "--scale-rewards is for continuous actions (Atari clips rewards)")
    require(pixels or not args.bf16, "--bf16 is for the Atari network's convolutions; vector tasks run in float32")
    return args, spec


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


def loss_stats(result) -> dict:
    """A loss's named tuple as TensorBoard tags: `losses/<name>` for its parts, `stats/<name>` for other scalars."""
    items = [(k, v.detach()) for k, v in result._asdict().items() if k != "loss" and v.dim() == 0]
    return {(f"losses/{k}" if k.endswith("loss") else f"stats/{k}"): v for k, v in items}


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


def run_workers(train_worker, parts, log, save) -> int:
    """A Hogwild run's workers: `train_worker(i, args, *parts, counter, obs_lock, msg_q, halt, started)` in
    --num-workers processes, sharing the step counter (from the log's step), the observation statistics' lock, a
    message queue, the halt flag and a start barrier; watched to their end, then saved (`save(step)`) and ended. A
    failed worker or a non-finite value ends the run (`exit_failed`), a stop after the save (`exit_stopped`).
    Returns the step."""
    args, ctx, stop = log.args, torch.multiprocessing.get_context("spawn"), Stop()
    counter, obs_lock, msg_q, halt = ctx.Value("q", log.start_step), ctx.Lock(), ctx.Queue(), ctx.Event()
    started = ctx.Barrier(args.num_workers)  # passed once every worker is set up
    steps = counter.get_obj()  # read without the lock: a worker killed while holding it must not hang this process
    shared = (args, *parts, counter, obs_lock, msg_q, halt, started)
    workers = start_workers(train_worker, range(args.num_workers), *shared)
    try:
        step = watch_workers(workers, msg_q, halt, steps, log, stop, save)
        save(step)
    except (WorkerError, NonFiniteError) as e:
        exit_failed(e, log.path)
    finally:
        end_workers(workers)
    log.console(step)
    if stop.requested:
        exit_stopped(log, step)
    return step


def watch_workers(workers, msg_q, halt, steps, log, stop, save) -> int:
    """A Hogwild run's main process until every worker is done: their episodes and stats logged, `save(step)` on time,
    a failed worker ending the run, a stop passed on (a worker still starting is not waited for past 10 s)."""
    done, give_up = 0, float("inf")
    while done < len(workers.processes) and time.time() < give_up:
        with contextlib.suppress(queue.Empty):  # ("episode", step, (score, length)), ("stats", step, {tag: value}), ...
            kind, step, payload = msg_q.get(timeout=0.2)
            if kind == "episode":
                log.episode(*payload, step)
            elif kind == "stats":
                log.scalars(payload, step)
            else:  # ("done", step, worker)
                done += 1
        check_workers(workers)
        if stop.requested and not halt.is_set():
            halt.set()
            give_up = time.time() + 10
        if log.save_due() and steps.value > log.start_step:
            save(steps.value)
        if log.due():
            log.console(steps.value)
    return steps.value


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
