"""V-MPO for continuous actions: Song, Abdolmaleki, Springenberg, Clark, Soyer, Rae, Noury, Ahuja, Liu, Tirumala,
Heess, Belov, Riedmiller, Botvinick (2020), "V-MPO: On-Policy Maximum a Posteriori Policy Optimization for
Discrete and Continuous Control".

A *target* network acts and stays fixed for T_target learning steps; the *online* network learns its value from
n-step returns and improves its policy in two steps. The E-step weights the top half of the batch's advantages by
exp(A/η), the temperature η keeping ψ within ε_η of the data; the M-step fits the Gaussian policy to ψ inside a
trust region around π_target that is *decoupled* (Appendix C): KL(π_target ‖ π) splits into a mean part and a
covariance part, each with its own bound (ε_αμ ≫ ε_αΣ) and multiplier, so the mean moves fast while the
covariance shrinks slowly and keeps exploring. PopArt keeps the value loss on one scale.

`--env-id` alone departs from Algorithm 1 where one machine's budget needs it (docs/vmpo_mujoco.md measures each):
the Gaussian's sample acts through a tanh, so the action taken is the action learned from; each state's Gaussian is
projected onto the decoupled bounds before the M-step fits it (Otto et al. 2021, "Differentiable Trust Region
Layers"), which holds the bound in every state rather than on average and lets each batch be used for several
passes of minibatches; the targets are λ-returns recomputed at every pass. `--preset paper` is Algorithm 1.

| paper                                                                | here                                    |
|----------------------------------------------------------------------|-----------------------------------------|
| Algorithm 1: target network, refreshed every T_target steps          | `act`, `pool.publish` in `main`         |
| Eq. (1) n-step returns G^(n) bootstrapped from the online V          | `n_step_targets`, `value_targets`       |
| Eq. (1) L_V, advantages A = G − V; Sec. 4.1 PopArt                   | `vmpo_loss`, `learner_step`             |
| Eqs. (12)-(13) ψ on the top half of the advantages, L_π; L_η         | `vmpo_weights`, `vmpo_loss`             |
| Eqs. (23)-(25) KL of Gaussians split into mean and covariance        | `gaussian_kl_parts`                     |
| Eqs. (14), (26) L_αμ + L_αΣ with stop-gradients                      | `kl_constraint_loss`                    |
| (not in the paper) each state's Gaussian projected onto the bounds   | `project_gaussian`                      |
| Sec. 4.2.2: η, α_μ, α_Σ ≥ 1e-8 after every step                      | `LagrangeMultipliers`                   |
| App. F: 512-256 MLP core, 256-unit policy and value MLP heads        | `Agent`                                 |
| Tables 1 and 7: initial η, α_μ, α_Σ; ε_η, ε_αμ, ε_αΣ; n; γ; T_target | `Args` defaults, `TABLE7_COLUMNS`       |

The choices the paper leaves open and the one-machine defaults, with their measurements: docs/vmpo_mujoco.md.

    python vmpo_mujoco.py --env-id Hopper-v4                                      # settings measured on 2 cores
    python vmpo_mujoco.py --env-id HumanoidRun-v1 --preset paper --num-envs 128   # Table 7, humanoid column
"""

import contextlib
import copy
import dataclasses
import itertools
import hashlib
import json
import math
import os
import queue
import signal
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import torch
import torch.nn as nn

from common.envs import EpisodeTracker, UsageError, check_render, env_spec, flat_obs_dim, flatten_obs, make_env, require
from common.envs import require_in, task_family, to_env_action
from common.evaluation import evaluate_model, resume_checkpoint
from common.networks import MLPTorso, RunningNorm
from common.popart import PopArt


@dataclass
class Args:
    env_id: str = "HalfCheetah-v4"  # envpool continuous-action task (Gym MuJoCo *-v4, dm_control HumanoidRun-v1, ...)
    preset: str = "family"  # family: the family defaults; paper: the task's Table 7 column
    exp_name: str = "vmpo_mujoco"  # name of this experiment, part of the run folder's name
    seed: int = 1  # seed of torch and the envs (learner r: seed + r; its actor a: seed + 1000 r + a)
    torch_deterministic: bool = True  # torch.backends.cudnn.deterministic
    cuda: bool = True  # learner and actors' inference on the GPU when there is one
    cuda_actors: bool = True  # with --cuda, the actors act on the GPU too (--no-cuda-actors: on the CPU, no context)
    total_timesteps: int = 10_000_000  # environment steps in all (the paper's Gym curves run to billions)
    num_envs: int = 64  # environments per learner process, split evenly over its actors
    env_batch_size: int = 0  # envs per envpool step (async below envs per actor); 0: half of an actor's envs
    num_actors: int = 1  # actor processes per learner process
    unroll_length: int = 39  # n, unroll length (Table 7: 39 OpenAI Gym, 63 humanoid)
    batch_size: int = 64  # B, unrolls per learning step, over all learner processes (App. F, humanoid)
    num_minibatches: int = 8  # E-step groups of a gradient step, each its own top half and ψ: the 8 replicas (App. F)
    update_epochs: int = 1  # passes over each batch against the same π_target (Algorithm 1: one)
    minibatch_size: int = 0  # states a gradient step (shuffled each pass); 0: the whole batch, one step (Algorithm 1)
    target_update_period: int = 100  # T_target, updates (passes over a batch) between target refreshes (Table 7)
    learning_rate: float = 1e-4  # Adam learning rate (Sec. 4.3)
    gamma: float = 0.99  # γ, agent discount (Table 7)
    gae_lambda: float = 1.0  # λ of the value targets, recomputed each pass; 1: Eq. (1)'s n-step returns
    squash: bool = False  # act with tanh of the Gaussian's sample (not in the paper; off: the sample, clipped)
    projection: bool = False  # each state's Gaussian projected onto the decoupled bounds (Otto et al. 2021)
    regression_coef: float = 0.0  # weight of KL(sg π_projected ‖ π), pulling the network to its projection
    eps_eta: float = 0.01  # ε_η, bound of the temperature dual: KL of ψ from the data (Table 7)
    eps_alpha_mu: float = 0.007  # ε_αμ, bound of the mean part of the KL (Table 7 Gym: middle of [0.005, 0.01])
    eps_alpha_sigma: float = 1.6e-5  # ε_αΣ, bound of the covariance part (Table 7 Gym: middle of [5e-6, 5e-5))
    init_eta: float = 1.0  # initial η, temperature (Table 1)
    init_alpha_mu: float = 1.0  # initial α_μ, mean-KL multiplier (Table 1)
    init_alpha_sigma: float = 1.0  # initial α_Σ, covariance-KL multiplier (Table 1)
    popart_beta: float = 1e-4  # PopArt statistics step size (Sec. 4.1)
    hidden: tuple[int, ...] = (512, 256)  # MLP core (App. F, humanoid from state); its last width is the heads'
    save_model: bool = False  # write model.pt (weights, observation and PopArt statistics) in the run folder
    capture_video: bool = False  # record the first evaluation episode (an animated PNG) in the run folder
    eval_episodes: int = 10  # evaluation episodes at the end of training, sampling from the policy (0: none)
    run_dir: str = "runs"  # folder of the run folders
    log_interval: float = 5.0  # seconds between console progress lines
    learner_threads: int = 0  # torch threads of a learner; 0: half the cores (the rest step the envs), the deep net all
    checkpoint_interval: float = 300.0  # seconds between checkpoints (also at the end and on Ctrl-C); 0: only then
    resume: str = ""  # a run folder to continue from its checkpoint.pt, with its own arguments


# Table 7's columns: the Args defaults are the OpenAI Gym column; dm_control's Humanoid* take humanoid-from-state.
TABLE7_COLUMNS = {"gym": {}, "humanoid-state": dict(unroll_length=63, eps_alpha_mu=0.16, eps_alpha_sigma=2.2e-5)}

# Defaults by task family, the same on every device, measured on 2 CPU cores (docs): a tanh-squashed Gaussian
# projected onto its bounds in every state (Otto et al. 2021's KL bounds), several passes over each batch with
# λ-returns recomputed each pass, the target refreshed after each batch, a fast PopArt.
ONE_MACHINE = dict(
    unroll_length=64, num_minibatches=1, update_epochs=5, minibatch_size=256, target_update_period=1, gae_lambda=0.95,
    learning_rate=3e-4, popart_beta=0.1, squash=True, projection=True, regression_coef=10.0, eps_alpha_mu=0.03,
    eps_alpha_sigma=1e-3,
)  # fmt: skip
FAMILY_DEFAULTS = {
    "mujoco": ("settings measured on Hopper-v4, Walker2d-v4 and HalfCheetah-v4 (docs)",
               dict(num_envs=32, batch_size=32, **ONE_MACHINE)),
    "classic": ("settings measured on Pendulum-v1 (docs)", dict(num_envs=16, batch_size=16, **ONE_MACHINE)),
}  # fmt: skip
PAPER = "the paper's settings (the Args defaults)"  # the defaults' source without a family entry


def defaults_for(args, given=()) -> tuple[str, str, dict]:
    """(family, source, values) of a run's defaults: its Table 7 column, its family's on top unless `--preset paper`."""
    humanoid = args.env_id.startswith("Humanoid") and type(env_spec(args.env_id)).__name__.startswith("Dmc")
    family, column = task_family(args.env_id), TABLE7_COLUMNS["humanoid-state" if humanoid else "gym"]
    if args.preset == "paper":
        return family, PAPER + ", forced by --preset paper", column
    source, values = FAMILY_DEFAULTS.get(family, (PAPER, {}))
    return family, source, {**column, **values}


# ---------------------------------------------------------------------------------------------------------
# The paper's math: pure functions of time-major [T, B] tensors.


def vmpo_weights(advantages, eta, eps_eta, mask=None, top_fraction=0.5):
    """The E-step, Eqs. (12)-(13), on the k = max(1, ⌊top_fraction · |D|⌋) highest advantages D̃ (by `topk`: ties
    cannot let more in): ψ(s, a) = exp(A(s, a)/η) / Σ_{D̃} exp(A/η) there and 0 elsewhere, with no gradient; L_η =
    η ε_η + η log( (1/|D̃|) Σ_{D̃} exp(A/η) ), differentiable in η only. `mask` (bool) leaves samples out of D."""
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


def gaussian_kl_parts(target_mean, target_std, mean, std):
    """Eqs. (24)-(25) for diagonal Gaussians, `[..., d] -> ([...], [...])`: KL(π_target ‖ π) of Eq. (23) split into
    KL_μ = ½ (μ − μ_t)ᵀ Σ_t⁻¹ (μ − μ_t)               (the target's covariance: only μ moves it),
    KL_Σ = ½ [ Tr(Σ⁻¹ Σ_t) − d + log(|Σ| / |Σ_t|) ]     (no mean: only σ moves it); π_target gets no gradient."""
    target_mean, target_var, var = target_mean.detach(), target_std.detach() ** 2, std**2
    kl_mu = 0.5 * ((mean - target_mean) ** 2 / target_var).sum(-1)
    kl_sigma = 0.5 * (target_var / var - 1.0 + var.log() - target_var.log()).sum(-1)
    return kl_mu, kl_sigma


def kl_constraint_loss(kl, alpha, eps_alpha, mask):
    """Eq. (14) for one KL part (Eq. 26) on the batch D (`mask`): L_α = (1/|D|) Σ_D [ α (ε_α − sg[KL]) + sg[α] KL ],
    whose first term moves α (up when the KL exceeds ε_α), the second the policy (α fixed). Returns (loss, mean KL)."""
    kl_mean = (mask * kl).sum() / mask.sum().clamp(min=1)
    return alpha * (eps_alpha - kl_mean.detach()) + alpha.detach() * kl_mean, kl_mean


def project_gaussian(mean, std, target_mean, target_std, eps_mu, eps_sigma):
    """Otto et al. (2021)'s KL projection of each state's diagonal Gaussian onto the decoupled bounds of Eqs. (24)-(25),
    `[..., d]`: where KL_μ > ε_μ the mean moves back toward μ_t to the bound, μ̃ = μ_t + (μ − μ_t) sqrt(ε_μ / KL_μ);
    where KL_Σ > ε_Σ the precision is interpolated, σ̃⁻² = σ_t⁻² + τ (σ⁻² − σ_t⁻²), with τ ∈ (0, 1) the root of
    KL_Σ(τ) = ε_Σ (bisection on log τ; KL_Σ rises with τ). Differentiable: τ's gradient by the implicit function
    theorem, one Newton step whose value is τ. Inside its bounds a Gaussian is left as it is."""
    target_mean, target_var = target_mean.detach(), target_std.detach() ** 2
    kl_mu, kl_sigma = gaussian_kl_parts(target_mean, target_std, mean, std)
    scale = (eps_mu / kl_mu.clamp(min=1e-30)).sqrt().clamp(max=1.0)
    mean = target_mean + scale[..., None] * (mean - target_mean)
    ratio = target_var / std**2  # σ_t² / σ²: KL_Σ(τ) = ½ Σ (x − log(1 + x)) with x = τ (ratio − 1)

    def kl_at(tau, q):
        x = tau[..., None] * (q - 1)
        return 0.5 * (x - x.log1p()).sum(-1)

    with torch.no_grad():
        low, high, q = torch.full_like(kl_sigma, -80.0), torch.zeros_like(kl_sigma), ratio.detach()
        for _ in range(40):
            mid = (low + high) / 2
            over = kl_at(mid.exp(), q) > eps_sigma
            low, high = torch.where(over, low, mid), torch.where(over, mid, high)
        tau = torch.where(kl_sigma > eps_sigma, low.exp(), torch.ones_like(low))
        slope = (0.5 * (q - 1) ** 2 * tau[..., None] / (1 + tau[..., None] * (q - 1))).sum(-1)  # ∂KL_Σ/∂τ
    step = (kl_at(tau, ratio) - eps_sigma) / slope.clamp(min=1e-30)
    tau = torch.where(kl_sigma > eps_sigma, tau - step, tau)
    return mean, (target_var / (1 + tau[..., None] * (ratio - 1))).sqrt()


@torch.no_grad()
def n_step_targets(values, rewards, terminated, ended, gamma, lambda_=1.0):
    """Eq. (1)'s n-step returns G_ℓ = Σ_{k=ℓ}^{n-1} (Π_{i=ℓ}^{k-1} γ_i) r_k + (Π_{i=ℓ}^{n-1} γ_i) V(x_n) for rows
    0..T-1 of unrolls `[T+1, B]` (row k: x_k and the reward and end flags that came with it), `values` unnormalised,
    γ_i = 0 after a termination; with λ < 1 the λ-returns G_ℓ = r_ℓ + γ_ℓ [(1 − λ) V(x_ℓ+1) + λ G_ℓ+1] (GAE's targets,
    the same at λ = 1). Where x_k ended an episode, step k is envpool's reset step: G_k = V(x_k), so a truncation
    bootstraps from its last x."""
    reset_step = ended[:-1]
    discounts = torch.where(reset_step, 0.0, gamma * (~terminated[1:]).float())
    rewards = torch.where(reset_step, values[:-1], rewards[1:])
    acc, out = values[-1], []
    for t in reversed(range(rewards.shape[0])):
        acc = rewards[t] + discounts[t] * ((1 - lambda_) * values[t + 1] + lambda_ * acc)
        out.append(acc)
    return torch.stack(out[::-1])


class VmpoLoss(NamedTuple):
    """vmpo_loss's result: the loss and its parts, and diagnostics (means over the real steps)."""

    loss: torch.Tensor
    value_loss: torch.Tensor
    policy_loss: torch.Tensor
    eta_loss: torch.Tensor
    alpha_mu_loss: torch.Tensor
    alpha_sigma_loss: torch.Tensor
    regression_loss: torch.Tensor  # KL(sg π_projected ‖ π): 0 without the projection
    kl_mu: torch.Tensor
    kl_sigma: torch.Tensor
    kl_psi: torch.Tensor  # KL(ψ ‖ uniform on D̃), averaged over the E-step's groups
    policy_std: torch.Tensor
    advantage_mean: torch.Tensor
    advantage_std: torch.Tensor  # the advantages' spread in PopArt units: what η is set against


def vmpo_loss(mean, std, target_mean, target_std, actions, value_norm, returns_norm, mask, eta, alpha_mu, alpha_sigma,
              eps_eta=0.01, eps_alpha_mu=0.007, eps_alpha_sigma=1.6e-5, num_minibatches=1, projection=False,
              regression_coef=0.0) -> VmpoLoss:  # fmt: skip
    """Eq. (26), L_V + L_π + L_η + L_αμ + L_αΣ in PopArt's normalised units, on a set of states `[N]`: `mean, std,
    target_mean, target_std, actions [N, d]` the online network's and π_target's Gaussians and the actions (before any
    tanh: its Jacobian does not depend on the network), `value_norm, returns_norm [N]` V and the targets (G − μ)/σ,
    `mask` the real steps (reset steps take no part). The E-step runs on `num_minibatches` contiguous groups, each ψ
    scaled by 1/num_minibatches. With `projection`, L_π takes each state's Gaussian projected onto the bounds
    (`project_gaussian`), plus `regression_coef` KL(sg π̃ ‖ π); the α terms keep the network's own KLs."""
    n = mask.sum().clamp(min=1)
    value_loss = 0.5 * (mask * (returns_norm - value_norm) ** 2).sum() / n
    advantages = returns_norm - value_norm.detach()  # (G − V)/σ
    psi, eta_loss, kl_psi = torch.zeros_like(advantages), 0.0, 0.0
    for rows in torch.arange(advantages.shape[0], device=advantages.device).tensor_split(num_minibatches):
        psi_mb, eta_loss_mb = vmpo_weights(advantages[rows], eta, eps_eta, mask[rows])
        psi[rows] = psi_mb / num_minibatches
        eta_loss = eta_loss + eta_loss_mb / num_minibatches
        top = psi_mb[psi_mb > 0].detach()
        kl_psi = kl_psi + (top * (top * top.numel()).log()).sum() / num_minibatches
    fit_mean, fit_std, regression_loss = mean, std, torch.zeros((), device=mean.device)
    if projection:  # the M-step fits π̃; KL(π̃ ‖ π), π̃ held fixed, is zero where no bound binds
        fit_mean, fit_std = project_gaussian(mean, std, target_mean, target_std, eps_alpha_mu, eps_alpha_sigma)
        regression_loss = (mask * sum(gaussian_kl_parts(fit_mean, fit_std, mean, std))).sum() / n
    log_prob = torch.distributions.Normal(fit_mean, fit_std, validate_args=False).log_prob(actions).sum(-1)
    policy_loss = -(psi * log_prob).sum()  # log N(a; μ, diag σ²) of the online (projected) Gaussian
    kl_mu, kl_sigma = gaussian_kl_parts(target_mean, target_std, mean, std)
    alpha_mu_loss, kl_mu_mean = kl_constraint_loss(kl_mu, alpha_mu, eps_alpha_mu, mask)
    alpha_sigma_loss, kl_sigma_mean = kl_constraint_loss(kl_sigma, alpha_sigma, eps_alpha_sigma, mask)
    advantage_mean = ((mask * advantages).sum() / n).detach()
    policy_std = ((mask[..., None] * std).sum() / (n * std.shape[-1])).detach()
    advantage_std = ((mask * (advantages.detach() - advantage_mean) ** 2).sum() / n).sqrt()
    loss = value_loss + policy_loss + eta_loss + alpha_mu_loss + alpha_sigma_loss + regression_coef * regression_loss
    parts = (value_loss, policy_loss, torch.as_tensor(eta_loss), alpha_mu_loss, alpha_sigma_loss, regression_loss)
    return VmpoLoss(loss, *parts, kl_mu_mean, kl_sigma_mean, torch.as_tensor(kl_psi), policy_std, advantage_mean,
                    advantage_std)  # fmt: skip


class LagrangeMultipliers(nn.Module):
    """η (Eq. 13), α_μ and α_Σ (Eq. 26), learned as they are; `project`: each ≥ η_min = α_min = 1e-8 (Sec. 4.2.2)."""

    def __init__(self, eta=1.0, alpha_mu=1.0, alpha_sigma=1.0):
        super().__init__()
        values = (eta, alpha_mu, alpha_sigma)
        self.eta, self.alpha_mu, self.alpha_sigma = (nn.Parameter(torch.tensor(float(v))) for v in values)

    @torch.no_grad()
    def project(self):
        for p in self.parameters():
            p.clamp_(min=1e-8)


class Agent(nn.Module):
    """Observation normalisation, an MLP core (512, 256; ELU), MLP heads of its last width: the Gaussian, PopArt's V."""

    MIN_STD = 1e-4

    def __init__(self, obs_dim, action_dim, hidden=(512, 256), init_std=0.5, popart_beta=1e-4, squash=False):
        super().__init__()
        self.config = {k: v for k, v in locals().items() if k not in ("self", "__class__")}  # for model.pt
        self.action_dim, self.squash = action_dim, squash
        self.obs_norm = RunningNorm(obs_dim)
        self.core = MLPTorso(obs_dim, hidden, activation=nn.ELU)
        n = self.core.out_features
        self.policy_mlp = nn.Sequential(nn.Linear(n, n), nn.ELU())
        self.policy = nn.Linear(n, 2 * action_dim)
        nn.init.zeros_(self.policy.weight)  # N(0, init_std²) in every state at the start
        nn.init.constant_(self.policy.bias, math.log(math.expm1(init_std - self.MIN_STD)))  # softplus(b) + MIN_STD = σ
        nn.init.zeros_(self.policy.bias[:action_dim])  # the mean
        self.value_mlp = nn.Sequential(nn.Linear(n, n), nn.ELU())
        self.popart = PopArt(n, 1, popart_beta)  # σ within [1e-2, 1e6] (Sec. 4.1)

    def forward(self, obs):
        """Raw `obs [..., obs_dim]` -> mean, std `[..., d]` and the value head's features (values: `self.popart`)."""
        x = self.core(self.obs_norm(obs).reshape(-1, self.obs_norm.mean.shape[0])).view(*obs.shape[:-1], -1)
        mean, raw_std = self.policy(self.policy_mlp(x)).split(self.action_dim, dim=-1)
        return mean, nn.functional.softplus(raw_std) + self.MIN_STD, self.value_mlp(x)

    def box_action(self, sample):
        """A sample of the Gaussian as an action in [-1, 1]^d: its tanh (`squash`), or itself, clipped by the env."""
        return torch.tanh(sample) if self.squash else sample


# ---------------------------------------------------------------------------------------------------------
# Acting (with the target network). Row t of an unroll: obs_t, the reward and end flags that came with it, the
# Gaussian's sample taken there (before any tanh). An unroll has T+1 rows; its row T is the next unroll's row 0.


def buffer_specs(obs_dim, action_dim, T):
    """The unroll buffers `act` fills: name → (shape of one slot, dtype)."""
    specs = {"action": ((T + 1, action_dim), torch.float32)}
    specs.update({k: ((T + 1,), torch.bool) for k in ("ended", "terminated")})
    return {**specs, "obs": ((T + 1, obs_dim), torch.float32), "reward": ((T + 1,), torch.float32)}


def act(cfg, link) -> None:
    """Algorithm 1, 'use π_θtarget to act': steps an envpool with the target network and fills unrolls."""
    n, device = cfg.num_envs, torch.device(cfg.device)
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    envs = make_env(cfg.env_id, n, cfg.seed, cfg.env_batch_size, num_threads=cfg.env_threads)
    low, high = envs.action_space.low.astype(np.float32), envs.action_space.high.astype(np.float32)
    agent = link.local_agent(n, cfg.unroll_length, device)
    tracker = EpisodeTracker(n)
    envs.async_reset()
    while True:
        obs, reward, term, trunc, info = envs.recv()
        ids = info["env_id"]
        link.refresh(agent)  # θ_target ← θ_online happened in the learner
        obs_t = torch.from_numpy(flatten_obs(obs))
        with torch.no_grad():
            mean, std, _ = agent(obs_t.to(device, non_blocking=True))  # no stream sync
            action = (mean + std * torch.randn(mean.shape, device=device, generator=generator)).cpu()
        envs.send(to_env_action(agent.box_action(action).numpy(), low, high), ids)  # they step during the bookkeeping
        row = dict(obs=obs_t, reward=torch.from_numpy(reward).float(), action=action)
        row.update(ended=torch.from_numpy(term | trunc), terminated=torch.from_numpy(term))
        link.write(ids, row)
        for _, score, length in tracker.step(ids, reward, term, trunc, info):
            link.episode_q.put((score, length))


# ---------------------------------------------------------------------------------------------------------
# Learning: the learner's step, then setup, the learner's loop (Algorithm 1), the end.


def learner_step(state, target, batch, args):
    """Algorithm 1's update, the training state's `update`-th: the observation statistics moved, π_target's Gaussian on
    the batch's states, then `update_epochs` passes over them in Adam steps on shuffled minibatches (gradients
    all-reduced; the multipliers projected after each), the value targets recomputed by the online V at each pass.
    Returns the last step's stats, with how far the updated policy moved in each state (the bounds' use)."""
    agent, multipliers, optimizer = state["agent"], state["multipliers"], state["optimizer"]
    state["update"] += 1
    agent.obs_norm.update(batch["obs"][:-1])  # rows 0..T-1: row T is the next unroll's row 0
    flat = lambda x: x[:-1].transpose(0, 1).reshape(-1, *x.shape[2:])  # noqa: E731  [T+1, B] -> [B·T], unroll by unroll
    obs, actions, mask = flat(batch["obs"]), flat(batch["action"]), ~flat(batch["ended"])
    with torch.no_grad():
        target_mean, target_std, _ = target(obs)
    n = obs.shape[0]
    steps = max(1, n // args.minibatch_size) if args.minibatch_size else 1
    eps = (args.eps_eta, args.eps_alpha_mu, args.eps_alpha_sigma)
    settings = {k: getattr(args, k) for k in "eps_eta eps_alpha_mu eps_alpha_sigma projection regression_coef".split()}
    settings["num_minibatches"] = args.num_minibatches // world_size()  # this learner's share of the E-step's groups
    stats = {}
    for epoch in range(args.update_epochs):
        returns, value_stats = value_targets(agent, batch, args, move_popart=epoch == 0)
        stats = stats or value_stats  # the first pass's: the explained variance of the batch before any step
        returns = returns.transpose(0, 1).reshape(-1)  # unroll by unroll, as `flat`
        order = torch.randperm(n, device=obs.device) if steps > 1 else torch.arange(n, device=obs.device)
        for idx in order.tensor_split(steps):
            mean, std, value_features = agent(obs[idx])
            value_norm, returns_norm = agent.popart(value_features)[..., 0], agent.popart.normalize(returns[idx], 0)
            gaussians = (mean, std, target_mean[idx], target_std[idx], actions[idx])
            duals = dict(multipliers.named_parameters())  # eta, alpha_mu, alpha_sigma
            out = vmpo_loss(*gaussians, value_norm, returns_norm, mask[idx], **duals, **settings)
            optimizer.zero_grad(set_to_none=False)
            out.loss.backward()
            reduce_gradients([*agent.parameters(), *multipliers.parameters()], mean=True)
            grad_norm = nn.utils.get_total_norm([p.grad for p in agent.parameters()])  # for the logs (none is clipped)
            check_finite(f"at update {state['update']}", loss=out.loss, gradient=grad_norm)
            optimizer.step()
            multipliers.project()
    stats.update(loss_stats(out))
    stats.update({f"stats/{k}": v.detach().clone() for k, v in multipliers.named_parameters()})
    stats |= {f"stats/{k}_ratio": stats[f"stats/{k}"] / e for k, e in zip(("kl_psi", "kl_mu", "kl_sigma"), eps)}
    with torch.no_grad():  # the updated policy against π_target in each state of the batch
        mean, std, _ = agent(obs)
        kl_mu, kl_sigma = (torch.where(mask, kl, 0.0) for kl in gaussian_kl_parts(target_mean, target_std, mean, std))
        std, mean = std[mask], mean[mask]
    stats.update({"stats/kl_mu_max_ratio": kl_mu.max() / eps[1], "stats/kl_sigma_max_ratio": kl_sigma.max() / eps[2]})
    outside = (mean.abs() > (2.0 if args.squash else 1.0)).float().mean()  # beyond the box, or where tanh saturates
    stats.update({"stats/policy_std_max": std.mean(0).max(), "stats/outside_box": outside})
    return {**stats, "stats/grad_norm": grad_norm, "stats/passes": torch.tensor(float(args.update_epochs * steps))}


@torch.no_grad()
def value_targets(agent, batch, args, move_popart=False):
    """The λ-returns (Eq. 1's n-step returns at λ = 1) of a batch of unrolls from the online V, `[T, B]`, unnormalised;
    with `move_popart`, PopArt's statistics moved toward them (V(s) unchanged). Returns them and their stats."""
    popart = agent.popart
    values = popart.unnormalize(popart(agent(batch["obs"])[2])[..., 0], 0)  # online V, unnormalised (the one task: 0)
    returns = n_step_targets(values, batch["reward"], batch["terminated"], batch["ended"], args.gamma, args.gae_lambda)
    real = ~batch["ended"][:-1]
    if move_popart:
        popart.update(returns[real], torch.zeros_like(returns[real], dtype=torch.long))
    stats = {"stats/popart_mu": popart.mu[0].clone(), "stats/popart_sigma": popart.sigma[0].clone()}
    g, v = returns[real], values[:-1][real]  # CleanRL's explained variance, 1 − Var(G − V)/Var(G); 1 on < 2 steps
    unexplained = (g - v).var(correction=0) / g.var(correction=0).clamp(min=1e-8)
    stats["losses/explained_variance"] = 1 - unexplained.nan_to_num(0.0)
    return returns, {**stats, "stats/value_mean": (real * values[:-1]).sum() / real.sum().clamp(min=1)}


def main(args: Args):
    args, resumed = resume_checkpoint(args.resume, os.path.basename(__file__), Args) if args.resume else (args, None)
    spec = check_args(args)
    rank, world, device = learner_process(args)
    obs_dim, action_dim = flat_obs_dim(spec), int(spec.action_space.shape[0])
    agent = Agent(obs_dim, action_dim, args.hidden, popart_beta=args.popart_beta, squash=args.squash).to(device)
    multipliers = LagrangeMultipliers(args.init_eta, args.init_alpha_mu, args.init_alpha_sigma).to(device)
    same_start(agent, multipliers)
    steps_per_update = args.batch_size * args.unroll_length
    num_updates = args.total_timesteps // steps_per_update
    describe = f"{device}, {world} learner(s) of {args.num_actors} actor(s), {args.num_envs} envs"
    steps = args.update_epochs * (
        max(1, steps_per_update // world // args.minibatch_size) if args.minibatch_size else 1
    )
    describe += f", {1000 * steps / steps_per_update:.1f} gradient steps per 1,000 samples"
    log = RunLog(args, resumed, describe, write=rank == 0)
    specs, cfgs = buffer_specs(obs_dim, action_dim, args.unroll_length), actor_configs(args, rank, device)
    pool, stop = ActorPool(cfgs, agent, specs, args.batch_size // world, device), Stop()
    # The training state: the online network (PopArt, observation statistics), θ_target, η, α_μ, α_Σ, Adam, updates.
    optimizer = torch.optim.Adam([*agent.parameters(), *multipliers.parameters()], lr=args.learning_rate)  # Sec. 4.3
    state = dict(agent=agent, target_agent=pool.agent, multipliers=multipliers, optimizer=optimizer, update=0)
    load_state(state, resumed)
    pool.version += resumed is not None  # the actors load the θ_target resumed
    target = copy.deepcopy(pool.agent).to(device)  # θ_target on the learner's device: the KLs' π_target
    try:
        while state["update"] < num_updates:
            batch = pool.next_batch(stop, log if rank == 0 else None, state["update"] * steps_per_update)
            if any_learner(batch is None, device):  # a stop: every learner after the same update
                break
            stats, update = learner_step(state, target, batch, args), state["update"]
            if update % args.target_update_period == 0:
                pool.publish(agent.state_dict())  # θ_target ← θ_online
                target.load_state_dict(agent.state_dict())
            log_update(log, pool, update, stats if log.due() or update == num_updates else None)
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
        log.end(step, evaluate_model(log, saved_model(args, state, step), make_eval_policy, device))
    if world > 1:
        torch.distributed.destroy_process_group()
    if state["update"] < num_updates:
        exit_stopped(log if rank == 0 else None, step, world)


def save(log, state) -> None:
    """checkpoint.pt: the training state, once found finite; model.pt with --save-model."""
    step, saved = state["update"] * log.args.batch_size * log.args.unroll_length, state_dicts(state)
    named = {f"{k}.{n}": v for k in ("agent", "multipliers") for n, v in saved[k].items() if v.is_floating_point()}
    check_finite(f"at update {state['update']}", **named)
    log.save(step, saved, saved_model(log.args, state, step) if log.args.save_model else None)


def log_update(log, pool, update, stats) -> None:
    """After each update, the actors' episodes (every learner takes them, rank 0 logs them); with `stats`, the rest."""
    episodes, step = pool.take_episodes(), update * log.args.batch_size * log.args.unroll_length
    for score, length in episodes if log.writer else ():
        log.episode(score, length, step)
    if log.writer is None or stats is None:
        return
    stats.update({"stats/target_version": pool.version.item(), "charts/learning_rate": log.args.learning_rate})
    log.scalars(stats, step)
    eta, alpha_mu, alpha_sigma, std = (stats[f"stats/{k}"] for k in ("eta", "alpha_mu", "alpha_sigma", "policy_std"))
    kl_mu, kl_sigma = stats["stats/kl_mu_max_ratio"], stats["stats/kl_sigma_max_ratio"]
    line = f"η {eta:.3f} α_μ {alpha_mu:.3f} α_Σ {alpha_sigma:.3f} σ {std:.3f} max KL/ε {kl_mu:.2f} {kl_sigma:.2f}"
    log.console(step, line)


def make_eval_policy(checkpoint, num_envs, device="cpu", greedy=False):
    """`policy(obs, rewards, first) -> actions` of a saved model (evaluate.py plays it), sampled or the mean."""
    agent = Agent(**checkpoint["agent_config"]).to(device)
    agent.load_state_dict(checkpoint["agent"])
    box = env_spec(checkpoint["env_id"]).action_space  # the task's action bounds

    @torch.no_grad()
    def policy(obs, rewards, first):
        mean, std, _ = agent(torch.as_tensor(flatten_obs(obs), device=device))
        action = mean if greedy else mean + std * torch.randn_like(mean)
        return to_env_action(agent.box_action(action).cpu().numpy(), box.low, box.high)

    return policy


def saved_model(args, state, global_step):
    """What model.pt holds (evaluate.py and `make_eval_policy` play it)."""
    model = dict(script="vmpo_mujoco", env_id=args.env_id, args=dataclasses.asdict(args), global_step=global_step)
    model.update({k: {n: v.cpu() for n, v in state[k].state_dict().items()} for k in ("agent", "multipliers")})
    return {**model, "agent_config": state["agent"].config}


def check_args(args):
    """Bad input: one clear line before any work (UsageError). Returns the task's spec."""
    spec, world, steps = env_spec(args.env_id, discrete=False), world_size(), args.batch_size * args.unroll_length
    per_actor, mb = args.num_envs // max(args.num_actors, 1), args.num_minibatches
    require(args.preset in ("family", "paper"), f"--preset {args.preset!r} is not one of family, paper")
    fits = 1 <= args.num_actors <= args.num_envs and args.num_envs % args.num_actors == 0
    require(fits, f"--num-envs {args.num_envs} must be a positive multiple of --num-actors {args.num_actors}")
    require(0 <= args.env_batch_size <= per_actor, f"--env-batch-size: 0 (half) to the envs per actor ({per_actor})")
    require(args.total_timesteps >= steps, f"--total-timesteps is less than one batch (batch x unroll = {steps} steps)")
    fits = mb >= 1 and mb % world == 0 and args.batch_size % mb == 0
    require(fits, f"--num-minibatches {mb} must divide --batch-size and be a multiple of the learners ({world})")
    positive = "batch_size unroll_length target_update_period learning_rate eps_eta eps_alpha_mu eps_alpha_sigma"
    require_in("(0, inf)", args, positive + " init_eta init_alpha_mu init_alpha_sigma update_epochs")
    require_in("[0, inf)", args, "minibatch_size regression_coef")  # 0: the whole batch in one step; no regression
    require_in("[0, 1]", args, "gamma gae_lambda")
    require(args.hidden and min(args.hidden) >= 1, f"--hidden takes positive layer sizes, got {args.hidden}")
    if args.capture_video:
        check_render(args.env_id)
    return spec


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
