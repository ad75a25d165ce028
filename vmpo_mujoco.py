"""V-MPO for continuous actions (Gym MuJoCo, dm_control humanoid, any envpool continuous-action task).

Song, Abdolmaleki, Springenberg, Clark, Soyer, Rae, Noury, Ahuja, Liu, Tirumala, Heess, Belov, Riedmiller,
Botvinick (2020), "V-MPO: On-Policy Maximum a Posteriori Policy Optimization for Discrete and Continuous
Control".

An approximate policy iteration: a *target* network acts in the environments and stays fixed for T_target
learning steps; meanwhile the *online* network learns its value function from n-step returns and improves its
policy in two steps. The E-step weights the top half of the batch's advantages by exp(A/η), the temperature η a
Lagrange multiplier keeping the weights ψ within ε_η (in KL) of the data. The M-step fits the Gaussian policy to
ψ by weighted maximum likelihood inside a trust region around π_target. For Gaussians the trust region is
*decoupled* (Appendix C): KL(π_target ‖ π) splits into a mean part, which measures the mean's move in the
metric of the target's covariance, and a covariance part; each has its own bound (ε_αμ ≫ ε_αΣ) and its own
multiplier (α_μ, α_Σ). So the mean can move fast in action space while the covariance shrinks slowly, which
keeps exploring. A PopArt value head keeps the value loss on one scale whatever the task's reward scale.

| paper                                                          | here                                       |
|----------------------------------------------------------------|--------------------------------------------|
| Algorithm 1: target network, refreshed every T_target steps     | `pool.publish` every `--target-update-period` |
| Eq. (1) n-step returns G^(n) bootstrapped from the online V     | `n_step_returns`, `n_step_targets`         |
| Eq. (1) L_V, advantages A = G − V; Sec. 4.1 PopArt              | `vmpo_loss`, `batch_loss`, common/popart   |
| Eq. (12) ψ over the top half of the advantages, L_π             | `vmpo_weights` -> psi, `vmpo_loss`          |
| Eq. (13) temperature loss L_η                                   | `vmpo_weights` -> eta_loss                 |
| Eqs. (23)-(25) KL of Gaussians split into mean and covariance   | `gaussian_kl_parts`                        |
| Eqs. (14), (26) L_αμ + L_αΣ with stop-gradients                 | `kl_constraint_loss`                       |
| Sec. 4.2.2: η, α_μ, α_Σ ≥ 1e-8 after every step                 | `LagrangeMultipliers.project`              |
| App. F: 512-256 MLP core, 256-unit policy and value MLP heads   | `Agent`                                    |
| Tables 1 and 7: initial η, α_μ, α_Σ; ε_η, ε_αμ, ε_αΣ; n; γ; T_target | `Args` defaults, `TABLE7_COLUMNS` |

Choices the paper leaves open, and what is done here:
- The policy is a diagonal Gaussian over actions scaled to [-1, 1]^d: mean linear, σ = softplus(·) + 1e-4.
  A sampled action is stored as sampled and only mapped to the env's bounds and clipped when sent to the env.
  The initial σ (`--init-std`, 0.5) is not given in the paper.
- Observations are normalised by running mean and variance (clipped to ±10), updated by the learner from every
  batch and handed to the actors with the target network's weights; the statistics are saved in `model.pt`.
- Losses are means: ψ sums to one over the batch, L_V = 1/(2|D|) Σ (V − G)², the KLs are averaged over |D|.
  The value loss and the advantages are in PopArt's normalised space (A = (G − V)/σ); PopArt's statistics take
  one step with the batch's returns before the loss (van Hasselt et al. 2016, Algorithm 1).
- The batch is split into `--num-minibatches` minibatches (8) for the E-step, each with its own top half and ψ
  normalisation, as the paper's 8 TPU replicas did (App. F, implementation note); ψ of each is scaled by
  1/minibatches. The network runs once on the whole batch.
- The actors act with the target network, so the Gaussian they store is π_target's: the KLs are taken against
  it, with no second forward pass.
- Table 7's ε_η row reads 0.1 (humanoid pixels), 0.01 (humanoid state) and leaves the Gym cell to the state
  column: 0.01 here. Ranges sampled log-uniformly in the paper take their geometric middle. Table 7 gives the
  humanoid-from-state unroll as 63, Appendix F as 40: the column follows the table.
- Gym tasks have no network in the paper: the humanoid-from-state agent (512-256 core) is used for all, with
  ELU activations (the paper does not name them).

envpool resets an environment on the step *after* an episode ends; that step is no transition and is masked
out of every loss. Its n-step return is set to V(x_k), so a time-limit truncation (all MuJoCo tasks have one)
bootstraps from the value of the last observation; termination has discount 0.

    python vmpo_mujoco.py --env-id Hopper-v4                              # settings measured on one machine
    python vmpo_mujoco.py --env-id HumanoidRun-v1 --preset paper --num-envs 128   # Table 7, humanoid column
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from common.actor_pool import ActorPool, UnrollWriter, actor_configs, check_pool_args
from common.checkpoint import NonFiniteError, check_finite, check_finite_parameters, save_checkpoint, save_model
from common.envs import EpisodeTracker, UsageError, env_spec, flat_obs_dim, flatten_obs
from common.families import given_flags, with_family_defaults
from common.networks import MLPTorso, RunningNorm
from common.popart import PopArt
from common.processes import WorkerError, exit_if_orphaned
from common.run import (
    Interrupt,
    RunLog,
    average_gradients,
    broadcast_parameters,
    learner_failed,
    learner_interrupted,
    learner_process,
    loss_stats,
    resume_args,
)


@dataclass
class Args:
    env_id: str = "HalfCheetah-v4"
    """envpool task id with continuous actions (Gym MuJoCo *-v4/v5, dm_control HumanoidRun-v1, Pendulum-v1, ...)"""
    preset: Literal["family", "paper"] = "family"
    """family: the defaults of the env id's task family (FAMILY_DEFAULTS); paper: Table 7's column for the task
    (humanoid from state for the dm_control humanoid, OpenAI Gym for every other task)"""
    exp_name: str = "vmpo_mujoco"
    """name of this experiment, part of the run folder's name"""
    seed: int = 1
    """seed of torch, numpy and the environments (actor a of learner r uses seed + 1000 r + a)"""
    torch_deterministic: bool = True
    """torch.backends.cudnn.deterministic"""
    cuda: bool = True
    """learner and actors' inference on the GPU when there is one"""
    total_timesteps: int = 10_000_000
    """environment steps in all (the paper's Gym curves run to billions, Fig. 5c-d)"""
    num_envs: int = 64
    """environments per learner process, split evenly over its actors"""
    env_batch_size: int = 0
    """envs returned per envpool step (async when below envs per actor); 0: half of each actor's envs"""
    num_actors: int = 1
    """actor processes per learner process"""
    unroll_length: int = 39
    """n, unroll length (Table 7: 39 OpenAI Gym, 63 humanoid)"""
    batch_size: int = 64
    """B, unrolls per learning step, over all learner processes (App. F, humanoid)"""
    num_minibatches: int = 8
    """E-step minibatches (over all learner processes), each with its own top half and ψ normalisation: the
    paper's 8 TPU replicas (App. F, implementation note)"""
    target_update_period: int = 100
    """T_target, learning steps between target-network refreshes (Table 7)"""
    learning_rate: float = 1e-4
    """Adam learning rate for everything (Sec. 4.3)"""
    adam_eps: float = 1e-8
    """Adam ε (the paper's TensorFlow default)"""
    max_grad_norm: float = 0.0
    """global gradient-norm clipping threshold; 0: none (the paper mentions none)"""
    gamma: float = 0.99
    """γ, agent discount (Table 7)"""
    eps_eta: float = 0.01
    """ε_η, bound of the temperature dual: KL of ψ from the data (Table 7)"""
    eps_alpha_mu: float = 0.007
    """ε_αμ, bound of the mean part of KL(π_target ‖ π) (Table 7 Gym: log-uniform [0.005, 0.01]; geometric middle)"""
    eps_alpha_sigma: float = 1.6e-5
    """ε_αΣ, bound of the covariance part (Table 7 Gym: log-uniform [5e-6, 5e-5); geometric middle)"""
    init_eta: float = 1.0
    """initial η, temperature (Table 1)"""
    init_alpha_mu: float = 1.0
    """initial α_μ, mean-KL multiplier (Table 1)"""
    init_alpha_sigma: float = 1.0
    """initial α_Σ, covariance-KL multiplier (Table 1)"""
    min_multiplier: float = 1e-8
    """η_min = α_min, projection of the multipliers after every step (Sec. 4.2.2)"""
    top_fraction: float = 0.5
    """fraction of the highest advantages used in the E-step (Sec. 4.2.1, 'top-k')"""
    popart_beta: float = 1e-4
    """PopArt statistics step size (Sec. 4.1)"""
    popart_scale_lower: float = 1e-2
    """PopArt lower bound of σ (Sec. 4.1)"""
    popart_scale_upper: float = 1e6
    """PopArt upper bound of σ (Sec. 4.1)"""
    hidden: tuple[int, ...] = (512, 256)
    """MLP core (App. F, humanoid from state: 512 and 256 units)"""
    head_hidden: int = 256
    """hidden units of the policy and value MLP heads (App. F)"""
    init_std: float = 0.5
    """initial standard deviation of the policy in [-1, 1] action units (not given in the paper)"""
    save_model: bool = False
    """write model.pt (weights, observation and PopArt statistics, what evaluation needs) in the run folder"""
    capture_video: bool = False
    """record an evaluation episode (not available for MuJoCo here: envpool renders it only with an OpenGL
    context; the flag is refused with a message)"""
    eval_episodes: int = 10
    """evaluation episodes at the end of training, sampling from the policy (0: none)"""
    run_dir: str = "runs"
    """folder of the run folders"""
    log_interval: float = 5.0
    """seconds between console progress lines"""
    learner_threads: int = 0
    """torch threads of a learner process; 0: half the CPU cores (the other half steps the envs)"""
    checkpoint_interval: float = 300.0
    """seconds between checkpoints (runs/<run>/checkpoint.pt: weights with the observation statistics and
    PopArt, target network, optimiser, η and α, counters; written atomically); also at the end and on Ctrl-C"""
    resume: str = ""
    """a run folder to continue from its checkpoint, with its own arguments; curves continue in its folder"""


# Table 7's columns: the Args defaults are the OpenAI Gym column; the dm_control humanoid takes the humanoid-from-state
# column (`table7_column`). Flags given on the command line win.
TABLE7_COLUMNS = {
    "gym": {},
    "humanoid-state": dict(unroll_length=63, eps_eta=0.01, eps_alpha_mu=0.16, eps_alpha_sigma=2.2e-5),
}

# Defaults by task family (common/families.py), on top of the task's Table 7 column; a flag on the command line
# wins, `--preset paper` keeps the column alone. Table 7's settings are for thousands of envs and billions of
# steps: at 64 x 39 steps a batch and a target refreshed every 100 learning steps, the acting policy changes once
# in 250k steps, and 2M steps of HalfCheetah-v4 learned nothing (README). The one-machine settings were measured
# on 2 CPU cores (README, "Defaults by task family"): MuJoCo on InvertedPendulum-v4, Hopper-v4 and HalfCheetah-v4
# (32 envs: 16 let InvertedPendulum fall back after solving it), classic control on Pendulum-v1 (16 envs: 32 did
# worse there).
ONE_MACHINE = dict(
    num_envs=16,
    batch_size=16,
    num_minibatches=1,
    unroll_length=10,
    target_update_period=10,
    learning_rate=1e-3,
    popart_beta=0.1,
)
FAMILY_DEFAULTS = {
    "mujoco": (
        "settings measured on InvertedPendulum-v4, Hopper-v4 and HalfCheetah-v4 (README)",
        dict(ONE_MACHINE, num_envs=32, batch_size=32),
    ),
    "classic": ("settings measured on Pendulum-v1 (README)", ONE_MACHINE),
}


def table7_column(env_id: str) -> str:
    """'humanoid-state' for the dm_control humanoid tasks (HumanoidRun-v1, ...), 'gym' for every other task."""
    return (
        "humanoid-state"
        if env_id.startswith("Humanoid") and type(env_spec(env_id)).__name__.startswith("Dmc")
        else "gym"
    )


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


def gaussian_log_prob(actions, mean, std):
    """log N(a; μ, diag σ²), summed over the action dimensions `[..., d] -> [...]`."""
    z = (actions - mean) / std
    return (-0.5 * z * z - std.log() - 0.5 * math.log(2 * math.pi)).sum(-1)


def gaussian_kl_parts(target_mean, target_std, mean, std):
    """Eqs. (24)-(25) for diagonal Gaussians: KL(π_target ‖ π) split into

        KL_μ = ½ (μ − μ_t)ᵀ Σ_t⁻¹ (μ − μ_t)                     (the target's covariance: only μ moves it)
        KL_Σ = ½ [ Tr(Σ⁻¹ Σ_t) − d + log(|Σ| / |Σ_t|) ]           (no mean: only σ moves it)

    `[..., d] -> ([...], [...])`; KL_μ + KL_Σ is the full KL of Eq. (23). π_target carries no gradient."""
    target_mean, target_var = target_mean.detach(), target_std.detach() ** 2
    var = std**2
    kl_mu = 0.5 * ((mean - target_mean) ** 2 / target_var).sum(-1)
    kl_sigma = 0.5 * (target_var / var - 1.0 + var.log() - target_var.log()).sum(-1)
    return kl_mu, kl_sigma


def kl_constraint_loss(kl, alpha, eps_alpha, mask=None):
    """Eq. (14), for one KL part (Eq. 26): L_α = (1/|D|) Σ_D [ α (ε_α − sg[KL]) + sg[α] KL ], on the full batch D.

    The first term moves α (up when the KL exceeds ε_α, down when below); the second is the trust region on the
    policy, with α held fixed. Returns (loss, mean KL)."""
    m = torch.ones_like(kl) if mask is None else mask.float()
    kl_mean = (m * kl).sum() / m.sum().clamp(min=1)
    return alpha * (eps_alpha - kl_mean.detach()) + alpha.detach() * kl_mean, kl_mean


def n_step_targets(values, rewards, terminated, ended, gamma):
    """The value targets G_k for rows 0..T-1 of unrolls `[T+1, B]`: Eq. (1)'s n-step returns bootstrapped from
    V(x_T) (`values` unnormalised), with γ_k = 0 after a termination. Row k holds x_k and the reward and end flags
    that came with it; where x_k ended an episode (`ended`), step k is envpool's reset step: G_k = V(x_k) there,
    so a truncated episode bootstraps from its last observation."""
    reset_step = ended[:-1]
    discounts = torch.where(reset_step, 0.0, gamma * (~terminated[1:]).float())
    rewards = torch.where(reset_step, values[:-1], rewards[1:])
    return n_step_returns(rewards, discounts, values[-1])


class VmpoLoss(NamedTuple):
    """vmpo_loss's result: the loss and its five parts, and diagnostics (means over the real steps)."""

    loss: torch.Tensor
    value_loss: torch.Tensor
    policy_loss: torch.Tensor
    eta_loss: torch.Tensor
    alpha_mu_loss: torch.Tensor
    alpha_sigma_loss: torch.Tensor
    kl_mu: torch.Tensor
    kl_sigma: torch.Tensor
    kl_psi: torch.Tensor  # KL(ψ ‖ uniform on D̃), averaged over the E-step's minibatches
    policy_std: torch.Tensor
    advantage_mean: torch.Tensor


def vmpo_loss(
    mean,
    std,
    target_mean,
    target_std,
    actions,
    value_norm,
    returns_norm,
    ended,
    eta,
    alpha_mu,
    alpha_sigma,
    eps_eta=0.01,
    eps_alpha_mu=0.007,
    eps_alpha_sigma=1.6e-5,
    top_fraction=0.5,
    num_minibatches=1,
) -> VmpoLoss:
    """Eq. (26): L_V + L_π + L_η + L_αμ + L_αΣ on a batch of unrolls, in PopArt's normalised units.

    `mean, std [T+1, B, d]` from the online network on rows 0..T (row T only bootstraps), `target_mean,
    target_std` π_target's (the actors'), `actions [T+1, B, d]`, `ended [T+1, B]`; `value_norm` the online
    network's normalised values and `returns_norm` the normalised targets (G − μ)/σ of rows 0..T-1 `[T, B]`; η,
    α_μ, α_Σ the Lagrange multipliers. The E-step runs on `num_minibatches` groups of columns, ψ of each scaled
    by 1/num_minibatches. A reset step (`ended`) takes no part."""
    mask = ~ended[:-1]
    n = mask.sum().clamp(min=1)
    value_loss = 0.5 * (mask * (returns_norm - value_norm) ** 2).sum() / n
    advantages = returns_norm - value_norm.detach()  # (G − V)/σ
    psi = torch.zeros_like(advantages)
    eta_loss, kl_psi = 0.0, 0.0
    for cols in torch.arange(advantages.shape[1], device=advantages.device).chunk(num_minibatches):
        psi_mb, eta_loss_mb = vmpo_weights(advantages[:, cols], eta, eps_eta, mask[:, cols], top_fraction)
        psi[:, cols] = psi_mb / num_minibatches
        eta_loss = eta_loss + eta_loss_mb / num_minibatches
        top = psi_mb[psi_mb > 0].detach()
        kl_psi = kl_psi + (top * (top * top.numel()).log()).sum() / num_minibatches
    logp = gaussian_log_prob(actions[:-1], mean[:-1], std[:-1])
    policy_loss = -(psi * logp).sum()
    kl_mu, kl_sigma = gaussian_kl_parts(target_mean[:-1], target_std[:-1], mean[:-1], std[:-1])
    alpha_mu_loss, kl_mu_mean = kl_constraint_loss(kl_mu, alpha_mu, eps_alpha_mu, mask)
    alpha_sigma_loss, kl_sigma_mean = kl_constraint_loss(kl_sigma, alpha_sigma, eps_alpha_sigma, mask)
    return VmpoLoss(
        loss=value_loss + policy_loss + eta_loss + alpha_mu_loss + alpha_sigma_loss,
        value_loss=value_loss,
        policy_loss=policy_loss,
        eta_loss=torch.as_tensor(eta_loss),
        alpha_mu_loss=alpha_mu_loss,
        alpha_sigma_loss=alpha_sigma_loss,
        kl_mu=kl_mu_mean,
        kl_sigma=kl_sigma_mean,
        kl_psi=torch.as_tensor(kl_psi),
        policy_std=((mask[..., None] * std[:-1]).sum() / (n * std.shape[-1])).detach(),
        advantage_mean=((mask * advantages).sum() / n).detach(),
    )


class LagrangeMultipliers(nn.Module):
    """η (temperature, Eq. 13), α_μ and α_Σ (decoupled KL multipliers, Eq. 26), learned by the same Adam as the
    networks."""

    def __init__(self, eta=1.0, alpha_mu=1.0, alpha_sigma=1.0):
        super().__init__()
        self.eta = nn.Parameter(torch.tensor(float(eta)))
        self.alpha_mu = nn.Parameter(torch.tensor(float(alpha_mu)))
        self.alpha_sigma = nn.Parameter(torch.tensor(float(alpha_sigma)))

    @torch.no_grad()
    def project(self, minimum=1e-8):
        """Sec. 4.2.2: every multiplier ← max(multiplier, 1e-8)."""
        for p in self.parameters():
            p.clamp_(min=minimum)


# ---------------------------------------------------------------------------------------------------------
# The agent (Appendix F).


class Agent(nn.Module):
    """Observation normalisation, an MLP core (512, 256; ELU) and two 256-unit MLP heads: the Gaussian's mean and
    standard deviation (readout initialised to zero weights: the same policy N(0, init_std²) in every state at
    the start) and a PopArt value readout."""

    MIN_STD = 1e-4

    def __init__(
        self,
        obs_dim,
        action_dim,
        hidden=(512, 256),
        head_hidden=256,
        init_std=0.5,
        num_tasks=1,
        popart_beta=1e-4,
        popart_scale_lower=1e-2,
        popart_scale_upper=1e6,
    ):
        super().__init__()
        self.config = dict(
            obs_dim=obs_dim,
            action_dim=action_dim,
            hidden=tuple(hidden),
            head_hidden=head_hidden,
            init_std=init_std,
            num_tasks=num_tasks,
            popart_beta=popart_beta,
            popart_scale_lower=popart_scale_lower,
            popart_scale_upper=popart_scale_upper,
        )
        self.action_dim = action_dim
        self.obs_norm = RunningNorm(obs_dim)
        self.core = MLPTorso(obs_dim, hidden, activation=nn.ELU)
        n = self.core.out_features
        self.policy_mlp = nn.Sequential(nn.Linear(n, head_hidden), nn.ELU())
        self.policy = nn.Linear(head_hidden, 2 * action_dim)
        nn.init.zeros_(self.policy.weight)
        nn.init.zeros_(self.policy.bias)
        with torch.no_grad():  # softplus(b) + MIN_STD = init_std
            self.policy.bias[action_dim:] = math.log(math.expm1(init_std - self.MIN_STD))
        self.value_mlp = nn.Sequential(nn.Linear(n, head_hidden), nn.ELU())
        self.popart = PopArt(head_hidden, num_tasks, popart_beta, popart_scale_lower, popart_scale_upper)

    def forward(self, obs):
        """`obs [..., obs_dim]` (raw) -> mean `[..., d]`, std `[..., d]`, the value head's features `[..., H]`
        (normalised values are `self.popart(features)`)."""
        x = self.core(self.obs_norm(obs).reshape(-1, self.obs_norm.mean.shape[0])).view(*obs.shape[:-1], -1)
        out = self.policy(self.policy_mlp(x))
        mean, raw_std = out.split(self.action_dim, dim=-1)
        return mean, F.softplus(raw_std) + self.MIN_STD, self.value_mlp(x)


# ---------------------------------------------------------------------------------------------------------
# The run: setup, the paper's loop, the end.


def main(args: Args):
    args, resumed = resume_args(args)
    spec = check_args(args)
    rank, world, device = learner_process(args)
    obs_dim, action_dim = flat_obs_dim(spec), int(spec.action_space.shape[0])
    agent = Agent(
        obs_dim,
        action_dim,
        args.hidden,
        args.head_hidden,
        args.init_std,
        1,
        args.popart_beta,
        args.popart_scale_lower,
        args.popart_scale_upper,
    ).to(device)
    multipliers = LagrangeMultipliers(args.init_eta, args.init_alpha_mu, args.init_alpha_sigma).to(device)
    params = list(agent.parameters()) + list(multipliers.parameters())
    broadcast_parameters(params, world)
    optimizer = torch.optim.Adam(params, lr=args.learning_rate, eps=args.adam_eps)
    start_update, target_state = 0, None
    if resumed is not None:
        agent.load_state_dict(resumed["agent"])
        multipliers.load_state_dict(resumed["multipliers"])
        optimizer.load_state_dict(resumed["optimizer"])
        start_update, target_state = resumed["update"], resumed["target_agent"]
    describe = f"device {device}, {world} learner process(es), {args.num_actors * world} actor process(es), "
    log = RunLog(args, FAMILY_DEFAULTS, args.env_id, resumed, describe + f"{args.num_envs * world} envs", rank == 0)
    steps_per_update = args.batch_size * args.unroll_length
    num_updates = args.total_timesteps // steps_per_update
    groups = args.num_minibatches // world  # E-step minibatches of this learner process
    global_step, last_checkpoint = log.start_step, time.time()

    def checkpoint(update):
        if rank == 0:
            check_finite_parameters(f"at update {update}", agent=agent, multipliers=multipliers)
            if args.save_model:  # a run stopped early can be evaluated too
                save_model(saved_model(args, spec, agent, multipliers, global_step), log.path)
            state = dict(
                agent=agent.state_dict(),
                target_agent=pool.agent.state_dict(),
                multipliers=multipliers.state_dict(),
                optimizer=optimizer.state_dict(),
                update=update,
            )
            save_checkpoint(log.state(global_step, args, **state), log.path)
        return global_step

    def save_last():
        if before is not None:  # the update in progress is dropped, with what it did to the normalisers
            agent.load_state_dict(before, strict=False)
        return checkpoint(done_update)

    # Ctrl-C or SIGTERM: stop at once, dropping the update in progress, and save the last completed update's
    # state; only the lines that change the training state (the optimiser step to the target refresh) finish first.
    interrupt, pool = Interrupt(), None
    done_update, before = start_update, None
    try:
        specs = buffer_specs(obs_dim, action_dim, args.unroll_length)
        pool = ActorPool(act, actor_configs(args, rank, device), agent, specs, args.batch_size // world, device)
        if target_state is not None:  # the target network the run was acting with
            pool.publish(target_state)
        for update in range(start_update + 1, num_updates + 1):
            batch = pool.next_batch(  # a progress line also while the batch is being collected
                lambda ready: rank == 0 and log.collecting(global_step, ready, pool.batch_size, args.unroll_length)
            )
            before = {k: v.clone() for k, v in agent.state_dict().items() if k.startswith(("obs_norm", "popart"))}
            agent.obs_norm.update(batch["obs"][:-1])  # rows 0..T-1: row T is the next unroll's row 0
            mean, std, value_features = agent(batch["obs"])
            out, stats = batch_loss(mean, std, value_features, batch, agent, multipliers, args, groups)
            loss = out.loss
            optimizer.zero_grad(set_to_none=False)
            loss.backward()
            if world > 1:
                average_gradients(params, world)
            grad_norm = nn.utils.clip_grad_norm_(
                agent.parameters(), args.max_grad_norm if args.max_grad_norm > 0 else float("inf")
            )
            where = f"at update {update} (step {update * steps_per_update})"
            check_finite(where, loss=loss, gradient=grad_norm, **{k.split("/")[-1]: v for k, v in stats.items()})
            with interrupt.commit():
                optimizer.step()
                multipliers.project(args.min_multiplier)
                stale = (batch["version"][:-1] != pool.version.item()).float().mean()
                if update % args.target_update_period == 0:
                    pool.publish(agent.state_dict())  # θ_target ← θ_online
                global_step = update * steps_per_update
                log.first_update(global_step)
                done_update, before = update, None
            if 0 < args.checkpoint_interval <= time.time() - last_checkpoint:
                checkpoint(update)
                last_checkpoint = time.time()
            episodes = list(pool.episodes)
            pool.episodes.clear()
            if rank != 0:
                continue
            for score, length in episodes:
                log.episode(score, length, global_step)
            if log.due() or update == num_updates:
                stats.update({"stats/stale_fraction": stale, "stats/target_version": pool.version.item()})
                log.scalars({**stats, "charts/learning_rate": args.learning_rate}, global_step)
                log.console(
                    global_step,
                    f"η {stats['stats/eta'].item():.3f} α_μ {stats['stats/alpha_mu'].item():.3f} "
                    f"α_Σ {stats['stats/alpha_sigma'].item():.3f} σ {stats['stats/policy_std'].item():.3f}",
                )
    except (WorkerError, NonFiniteError) as e:
        learner_failed(e, log.path, pool)
    except KeyboardInterrupt:
        save = save_last if done_update > start_update else None
        learner_interrupted(pool, interrupt, save, log, os.path.basename(__file__), world)
    pool.close()
    end_time = time.time()
    checkpoint(num_updates)
    if rank == 0:
        log.end(saved_model(args, spec, agent, multipliers, global_step), make_eval_policy, end_time, device)
    if world > 1:
        torch.distributed.destroy_process_group()


def to_env_action(action, low, high):
    """[-1, 1]^d policy actions -> the env's box, clipped (only here: the stored action stays as sampled)."""
    return np.clip(low + (action + 1.0) * 0.5 * (high - low), low, high)


def make_eval_policy(checkpoint, num_envs, device="cpu", greedy=False):
    """A callable `policy(obs, rewards, first) -> actions` for `common/evaluation.py`: the saved observation
    statistics normalise; the action is sampled (or the mean, `greedy`), mapped to the env's box and clipped."""
    agent = Agent(**checkpoint["agent_config"]).to(device)
    agent.load_state_dict(checkpoint["agent"])
    agent.eval()
    low, high = np.asarray(checkpoint["action_low"]), np.asarray(checkpoint["action_high"])

    @torch.no_grad()
    def policy(obs, rewards, first):
        mean, std, _ = agent(torch.as_tensor(flatten_obs(obs), device=device))
        action = mean if greedy else mean + std * torch.randn_like(mean)
        return to_env_action(action.cpu().numpy(), low, high)

    return policy


# ---------------------------------------------------------------------------------------------------------
# Acting (with the target network). Row t of an unroll holds obs_t, the reward and end flags that came with
# obs_t, the action taken at obs_t and the target policy's mean and std there. An unroll has T+1 rows; its last
# row is the next unroll's first.


def buffer_specs(obs_dim, action_dim, T):
    return {
        "obs": ((T + 1, obs_dim), torch.float32),
        "reward": ((T + 1,), torch.float32),
        "ended": ((T + 1,), torch.bool),
        "terminated": ((T + 1,), torch.bool),
        "action": ((T + 1, action_dim), torch.float32),
        "mean": ((T + 1, action_dim), torch.float32),
        "std": ((T + 1, action_dim), torch.float32),
        "version": ((T + 1,), torch.long),
    }


def act(actor_id, cfg, link):
    """Algorithm 1, 'use π_θtarget to act': steps an envpool with the target network and fills unrolls."""
    n, device = cfg.num_envs, torch.device(cfg.device)
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    envs = cfg.make_envs()
    low = envs.action_space.low.astype(np.float32)
    high = envs.action_space.high.astype(np.float32)
    agent = link.local_agent(device)
    unrolls = UnrollWriter(link, n, cfg.unroll_length)
    tracker = EpisodeTracker(n)
    envs.async_reset()
    while True:
        obs, reward, term, trunc, info = envs.recv()
        ids = info["env_id"]
        exit_if_orphaned(link.parent_pid)
        seen = link.refresh(agent)  # θ_target ← θ_online happened in the learner
        obs_t = torch.from_numpy(flatten_obs(obs))
        with torch.no_grad():
            mean, std, _ = agent(obs_t.to(device))
            action = mean + std * torch.randn(mean.shape, device=device, generator=generator)
        action_cpu = action.cpu()
        envs.send(to_env_action(action_cpu.numpy(), low, high), ids)  # the envs step during the bookkeeping

        row = {
            "obs": obs_t,
            "reward": torch.from_numpy(reward).float(),
            "ended": torch.from_numpy(term | trunc),
            "terminated": torch.from_numpy(term),
            "action": action_cpu,
            "mean": mean.cpu(),
            "std": std.cpu(),
            "version": torch.full((len(ids),), seen, dtype=torch.long),
        }
        unrolls.write(ids, row)
        for _, score, length in tracker.step(ids, reward, term, trunc, info):
            link.report("episode", score, length)


# ---------------------------------------------------------------------------------------------------------
# Learning and process plumbing.


def check_args(args):
    """Bad input: one clear line before any work (UsageError)."""
    spec = env_spec(args.env_id, discrete=False)
    if len(spec.action_space.shape) != 1:
        raise UsageError(f"{args.env_id} has actions of shape {spec.action_space.shape}; this script needs a vector")
    check_pool_args(args)
    if args.target_update_period < 1:
        raise UsageError(f"--target-update-period must be at least 1, got {args.target_update_period}")
    if not 0 < args.top_fraction <= 1:
        raise UsageError(f"--top-fraction must be in (0, 1], got {args.top_fraction}")
    for name in (
        "eps_eta",
        "eps_alpha_mu",
        "eps_alpha_sigma",
        "init_eta",
        "init_alpha_mu",
        "init_alpha_sigma",
        "learning_rate",
    ):
        if not getattr(args, name) > 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not args.init_std > Agent.MIN_STD:
        raise UsageError(f"--init-std must be greater than {Agent.MIN_STD}, got {args.init_std}")
    if not 0 <= args.gamma <= 1:
        raise UsageError(f"--gamma must be in [0, 1], got {args.gamma}")
    if not args.hidden or min(args.hidden) < 1:
        raise UsageError(f"--hidden takes one or more positive layer sizes, got {args.hidden}")
    if args.capture_video:
        raise UsageError(
            "--capture-video is not available for continuous control: envpool renders MuJoCo only "
            "with an OpenGL context, which it does not create; leave the flag out"
        )
    if not (np.all(np.isfinite(spec.action_space.low)) and np.all(np.isfinite(spec.action_space.high))):
        raise UsageError(f"{args.env_id} has an unbounded action space; this script needs a box")
    return spec


def batch_loss(mean, std, value_features, batch, agent, multipliers, args, num_minibatches=1):
    """vmpo_loss on a batch of unrolls: the n-step targets from the online network's unnormalised values, PopArt's
    statistics moved toward them first (the layer is rescaled so that V(s) is unchanged), then the loss in the new
    normalised units. Returns (VmpoLoss, stats)."""
    popart = agent.popart
    task = torch.zeros(value_features.shape[:2], dtype=torch.long, device=value_features.device)
    with torch.no_grad():
        values = popart.unnormalize(popart(value_features)[..., 0], task)  # online V, unnormalised
    returns = n_step_targets(values, batch["reward"], batch["terminated"], batch["ended"], args.gamma)
    real = ~batch["ended"][:-1]
    popart.update(returns[real], task[:-1][real])
    value_norm, returns_norm = popart(value_features[:-1])[..., 0], popart.normalize(returns, task[:-1])
    out = vmpo_loss(
        mean,
        std,
        batch["mean"],
        batch["std"],
        batch["action"],
        value_norm,
        returns_norm,
        batch["ended"],
        multipliers.eta,
        multipliers.alpha_mu,
        multipliers.alpha_sigma,
        args.eps_eta,
        args.eps_alpha_mu,
        args.eps_alpha_sigma,
        args.top_fraction,
        num_minibatches,
    )
    n = real.sum().clamp(min=1)
    stats = {
        **loss_stats(out),
        "stats/eta": multipliers.eta.detach().clone(),
        "stats/alpha_mu": multipliers.alpha_mu.detach().clone(),
        "stats/alpha_sigma": multipliers.alpha_sigma.detach().clone(),
        "stats/value_mean": (real * values[:-1]).sum() / n,
        "stats/popart_mu": popart.mu[0].clone(),
        "stats/popart_sigma": popart.sigma[0].clone(),
    }
    return out, stats


def saved_model(args, spec, agent, multipliers, global_step):
    """What model.pt holds (common/evaluation.py plays it)."""
    return {
        "script": "vmpo_mujoco",
        "env_id": args.env_id,
        "args": dataclasses.asdict(args),
        "agent_config": agent.config,
        "agent": {k: v.cpu() for k, v in agent.state_dict().items()},
        "multipliers": {k: v.cpu() for k, v in multipliers.state_dict().items()},
        "action_low": spec.action_space.low.astype(np.float32).tolist(),
        "action_high": spec.action_space.high.astype(np.float32).tolist(),
        "global_step": global_step,
    }


def parse_args(argv=None):
    """`tyro` over `Args`; then, for every field the command line did not set, the task's Table 7 column and,
    unless `--preset paper`, its family's defaults."""
    import tyro

    argv = sys.argv[1:] if argv is None else list(argv)
    values = [b for a, b in zip(argv, argv[1:]) if a == "--preset"] + [
        a.split("=", 1)[1] for a in argv if a.startswith("--preset=")
    ]
    for value in values:  # one clear line rather than tyro's box
        if value not in ("family", "paper"):
            raise UsageError(f"--preset {value!r} is not one of family, paper")
    args = tyro.cli(Args, args=argv)
    if args.resume:
        return args
    given = given_flags(argv)
    column = TABLE7_COLUMNS[table7_column(args.env_id)]
    args = dataclasses.replace(args, **{k: v for k, v in column.items() if k not in given})
    return with_family_defaults(args, FAMILY_DEFAULTS, argv)


def cli():
    try:
        main(parse_args())
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    cli()
