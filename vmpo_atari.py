"""V-MPO for discrete actions (Atari and any envpool discrete task).

Song, Abdolmaleki, Springenberg, Clark, Soyer, Rae, Noury, Ahuja, Liu, Tirumala, Heess, Belov, Riedmiller,
Botvinick (2020), "V-MPO: On-Policy Maximum a Posteriori Policy Optimization for Discrete and Continuous
Control".

An approximate policy iteration: a *target* network acts in the environments and stays fixed for T_target
learning steps; meanwhile the *online* network learns its value function from n-step returns and improves its
policy in two steps. The E-step builds a non-parametric distribution ψ over the batch's state-action pairs:
the top half of the advantages, weighted by exp(A/η), with the temperature η a Lagrange multiplier that keeps
ψ within ε_η (in KL) of the data. The M-step fits the policy to ψ by weighted maximum likelihood, inside a KL
trust region KL(π_target ‖ π_online) < ε_α enforced by a second multiplier α. A PopArt value head keeps the
value loss on the same scale whatever the game's reward scale, so no reward clipping is needed.

| paper                                                           | here                                     |
|-----------------------------------------------------------------|------------------------------------------|
| Algorithm 1: target network, refreshed every T_target steps      | `pool.publish` every `--target-update-period` |
| Eq. (1) n-step returns G^(n) bootstrapped from the online V      | `n_step_returns`, `n_step_targets`       |
| Eq. (1) L_V, advantages A = G − V; Sec. 4.1 PopArt               | `vmpo_loss`, `batch_loss`, common/popart |
| Eq. (12) ψ over the top half of the advantages, L_π              | `vmpo_weights` -> psi, `vmpo_loss`        |
| Eq. (13) temperature loss L_η                                    | `vmpo_weights` -> eta_loss               |
| Eq. (14) KL trust region L_α with stop-gradients                 | `categorical_kl`, `kl_constraint_loss`   |
| Sec. 4.2.2: η, α ≥ η_min = α_min = 1e-8 after every step         | `LagrangeMultipliers` (`--multipliers`)  |
| Fig. 1b, App. F: ResNet (64, 128, 128), LSTM, 256-unit MLP heads | `Agent`                                  |
| Tables 1 and 6: initial η, α; ε_η, ε_α; γ; T_target              | `Args` defaults                          |

Choices the paper leaves open, and what is done here:
- Losses are means: ψ sums to one over the batch, L_V = 1/(2|D|) Σ (V − G)², the KL is averaged over |D|.
- The value loss is computed in PopArt's normalised space, and the advantages too: A = (G − V)/σ. This makes η
  comparable across tasks (multi-task) and across training; the top-half selection and ψ are unchanged by
  any positive scaling except through η, which adapts.
- PopArt's statistics are updated with the batch's returns first, then the loss is taken with the new
  statistics (van Hasselt et al. 2016, Algorithm 1).
- The actors act with the target network, so the logits they store are π_target's: the KL of Eq. (14) is taken
  against them, with no second forward pass. Unrolls collected just before a target refresh and consumed
  just after it (a fraction of about lag/T_target, logged as `stats/stale_fraction`) use the previous
  target's logits, the policy that actually produced them.
- The multipliers (`--multipliers`, `--dual-learning-rate`). The paper's form (`paper`): η and α are plain parameters
  projected to at least 1e-8 after every step, learned by the networks' Adam at 1e-4. Adam moves a scalar by about its
  learning rate an update, so from Table 1's α = 5 it takes about 50,000 updates to reach 0: the paper's runs of
  hundreds of thousands of updates can afford that, a shorter run keeps a trust region far tighter than ε_α. The
  Atari family's default departs from the paper here, as Acme's MPO does:
  η = softplus(η̃) + 1e-8 and α likewise, with η̃, α̃ in a parameter group of their own at learning rate 1e-2, so
  that they reach the values their constraints ask for within a few hundred updates (README, "Atari on two cores").
- Initialisation (`--init`; the paper gives only the zero policy readout): orthogonal with gain √2 and zero
  biases, the PopArt readout gain 1 (CleanRL's). With PyTorch's default the torso's features barely differ between
  Atari frames (spread across states about 8e-4 on Breakout against 1.2e-2), so the policy learns per-action biases
  first. `stats/logits_std_across_states` and `stats/dead_units` (torso units off on the whole minibatch) show it.
- Without a GPU (no CUDA device, or `--no-cuda`) the Atari family runs CPU settings, measured on Breakout-v5 (README):
  the shallow torso without LSTM, 32 x 20-step batches in one minibatch, T_target = 10 learning steps, learning
  rate 1e-3, and Table 6's multi-task end-of-life episodes and γ = 0.99. The paper's ResNet + LSTM and 128 x 63-step
  batches run at about 11 steps per second on 2 CPU cores; `--preset paper` still runs them.
- For single-task Atari the paper uses a Transformer-XL core; this script has the multi-task agent's LSTM
  (Appendix F) or no core (`--no-use-lstm`). Table 6's single-task settings are the defaults: γ = 0.997, no
  reward clipping, no end-of-life episodes; `--reward-clip --episodic-life --gamma 0.99 --target-update-period
  100` gives the multi-task settings.
- The batch is split into `--num-minibatches` minibatches (8 by default), each taking its own top half and
  normalising ψ within itself, with gradients averaged: what the paper's 8 TPU replicas did (Appendix F,
  implementation note). They run one after the other in a learner process (this also bounds the memory of
  the wide ResNet), or spread over the learner processes under torchrun. PopArt's statistics take one step of
  β / (minibatches per process) per minibatch (to first order one step of β per learning step).

Multi-task (`--env-ids Pong-v5 Breakout-v5 ...`, or a preset: `atari57`, `atari5`; Table 4's one agent for all
games): actor a plays game a mod G (`--num-actors` a multiple of the number of games G, so every game gets the
same share of the actors), every game with the full set of 18 actions, and each unroll carries its game's task id.
The policy does not see it; PopArt does, with one normalised value output and one pair of statistics μ, σ per
game, so that the advantages (G − V)/σ of all games share one scale in the top-half selection and ψ. Table 6's
multi-task settings are flags: `--reward-clip --episodic-life --gamma 0.99 --target-update-period 100`.

envpool resets an environment on the step *after* an episode ends; that step is no transition and is masked
out of every loss. Its n-step return is set to V(x_k), so that a time-limit truncation bootstraps from the value
of the last observation; termination has discount 0.

    python vmpo_atari.py --env-id Breakout-v5
    torchrun --nproc_per_node 2 vmpo_atari.py --env-id Pong-v5 --num-envs 128
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from common.actor_pool import (
    ActorPool,
    act_recurrent,
    actor_configs,
    check_games,
    check_pool_args,
    recurrent_buffer_specs,
)
from common.checkpoint import NonFiniteError, check_finite, check_finite_parameters, save_checkpoint, save_model
from common.envs import UsageError, env_spec, is_atari
from common.evaluation import recurrent_policy
from common.networks import LSTMCore, check_channels, grad_norms_by_layer, init_output_, init_weights_, make_torso
from common.popart import PopArt
from common.processes import WorkerError
from common.run import (
    Interrupt,
    RunLog,
    average_gradients,
    broadcast_parameters,
    cli,
    learner_failed,
    learner_interrupted,
    learner_process,
    log_learner_stats,
    loss_stats,
    resume_args,
)


@dataclass
class Args:
    env_id: str = "Breakout-v5"
    """envpool task id (any discrete-action task: Atari *-v5, CartPole-v1, ...)"""
    env_ids: tuple[str, ...] = ()
    """several Atari games at once, one agent (Table 4), or a preset: atari57, atari5; replaces --env-id"""
    preset: Literal["family", "paper"] = "family"
    """family: the defaults of the env id's task family (FAMILY_DEFAULTS; Atari: the paper's); paper: the paper's
    settings (the defaults below) for every task"""
    exp_name: str = "vmpo_atari"
    """name of this experiment, part of the run folder's name"""
    seed: int = 1
    """seed of torch, numpy and the environments (actor a of learner r uses seed + 1000 r + a)"""
    torch_deterministic: bool = True
    """torch.backends.cudnn.deterministic"""
    cuda: bool = True
    """learner and actors' inference on the GPU when there is one"""
    total_timesteps: int = 50_000_000
    """environment steps in all (200M frames at action repeat 4)"""
    num_envs: int = 64
    """environments per learner process, split evenly over its actors"""
    env_batch_size: int = 0
    """envs returned per envpool step (async when below envs per actor); 0: half of each actor's envs"""
    num_actors: int = 1
    """actor processes per learner process"""
    unroll_length: int = 63
    """n, unroll length (Appendix F, Atari)"""
    batch_size: int = 128
    """B, unrolls per learning step, over all learner processes (Appendix F, Atari)"""
    num_minibatches: int = 8
    """the batch is split into this many minibatches (over all learner processes), each with its own top half
    and ψ normalisation, gradients averaged: the paper's 8 TPU replicas (App. F, implementation note)"""
    target_update_period: int = 1000
    """T_target, learning steps between target-network refreshes (Table 6, single-task; 100 multi-task)"""
    learning_rate: float = 1e-4
    """Adam learning rate for everything (Sec. 4.3)"""
    adam_eps: float = 1e-8
    """Adam ε (the paper's TensorFlow default)"""
    max_grad_norm: float = 0.0
    """global gradient-norm clipping threshold; 0: none (the paper mentions none)"""
    gamma: float = 0.997
    """γ, agent discount (Table 6, single-task; 0.99 multi-task)"""
    eps_eta: float = 0.1
    """ε_η, bound of the temperature dual: KL of ψ from the data (Table 6)"""
    eps_alpha: float = 0.007
    """ε_α, bound of KL(π_target ‖ π_online) (Table 6: log-uniform in [0.005, 0.01); its geometric middle)"""
    init_eta: float = 1.0
    """initial η, temperature (Table 1)"""
    init_alpha: float = 5.0
    """initial α, KL multiplier (Table 1)"""
    min_multiplier: float = 1e-8
    """η_min = α_min: the projection of η and α after every step (Sec. 4.2.2), or the floor added to softplus"""
    multipliers: Literal["paper", "softplus"] = "paper"
    """paper: η and α are parameters projected to ≥ η_min after every step (Sec. 4.2.2); softplus: η = softplus(η̃) +
    η_min and α likewise, the parameters η̃, α̃ unconstrained (Acme's MPO)"""
    dual_learning_rate: float = 0.0
    """learning rate of a separate Adam for η and α; 0: they share the networks' Adam and learning rate (Sec. 4.3)"""
    top_fraction: float = 0.5
    """fraction of the batch's highest advantages used in the E-step (Sec. 4.2.1, 'top-k')"""
    popart_beta: float = 1e-4
    """PopArt statistics step size (Sec. 4.1)"""
    popart_scale_lower: float = 1e-2
    """PopArt lower bound of σ (Sec. 4.1)"""
    popart_scale_upper: float = 1e6
    """PopArt upper bound of σ (Sec. 4.1)"""
    reward_clip: bool = False
    """Atari: clip training rewards to [-1, 1] (Table 6: no clipping single-task, [-1, 1] multi-task)"""
    episodic_life: bool = False
    """Atari: a lost life ends the training episode, discount 0 (Table 6: not single-task, yes multi-task)"""
    network: Literal["deep", "shallow"] = "deep"
    """torso for pixels: deep ResNet (App. F) or the shallow A3C network; vectors get an MLP"""
    channels: tuple[int, ...] = ()
    """conv channels; empty: (64, 128, 128) for the deep ResNet (App. F), (16, 32) for the shallow torso"""
    use_lstm: bool = True
    """LSTM core fed the previous action and reward (Fig. 1b); --no-use-lstm for a feed-forward agent"""
    lstm_size: int = 256
    """LSTM hidden units (App. F)"""
    head_hidden: int = 256
    """hidden units of the policy and value MLP heads (App. F)"""
    init: Literal["orthogonal", "sonnet", "torch"] = "orthogonal"
    """weight initialisation (the paper gives only the zero policy readout, App. F): orthogonal, gain √2 and zero
    biases (CleanRL); sonnet, truncated normal σ = 1/√fan_in; torch, PyTorch's defaults (state-blind on Atari)"""
    mlp_hidden: tuple[int, ...] = (64, 64)
    """hidden layers of the MLP torso for vector observations"""
    save_model: bool = False
    """write model.pt (weights, PopArt statistics and what evaluation needs) in the run folder"""
    capture_video: bool = False
    """record the first evaluation episode as an animated PNG under the run folder"""
    eval_episodes: int = 10
    """evaluation episodes at the end of training (0: none)"""
    run_dir: str = "runs"
    """folder of the run folders"""
    log_interval: float = 5.0
    """seconds between console progress lines"""
    learner_threads: int = 0
    """torch threads of a learner process; 0: half the CPU cores (the other half steps the envs)"""
    checkpoint_interval: float = 300.0
    """seconds between checkpoints (runs/<run>/checkpoint.pt: weights, target network version, optimiser, η and
    α, PopArt, counters; written atomically); also written at the end and on Ctrl-C; 0: only then"""
    resume: str = ""
    """a run folder to continue from its checkpoint, with its own arguments; curves continue in its folder"""


# Defaults by task family (common/families.py); a flag on the command line wins. Atari runs the paper's settings
# (the Args defaults above). Classic control: measured on CartPole-v1, seeds 1-3 (README, "Defaults by task
# family"); the paper's settings (T_target 1000, learning rate 1e-4) are for billions of Atari frames.
FAMILY_DEFAULTS = {
    "atari": (
        "the paper's Atari settings (Appendix F, Tables 1 and 6) with Acme's multipliers (the docstring)",
        dict(multipliers="softplus", dual_learning_rate=1e-2),
    ),
    "atari_cpu": (
        "the CPU Atari settings measured on Breakout-v5 (README)",
        dict(
            network="shallow",
            use_lstm=False,
            num_envs=32,
            batch_size=32,
            num_minibatches=1,
            unroll_length=20,
            target_update_period=10,
            learning_rate=1e-3,
            multipliers="softplus",
            dual_learning_rate=1e-2,
            episodic_life=True,
            gamma=0.99,
        ),
    ),
    "classic": (
        "settings measured on CartPole-v1 (README)",
        dict(
            total_timesteps=300_000,
            num_envs=16,
            batch_size=16,
            num_minibatches=1,
            unroll_length=20,
            use_lstm=False,
            gamma=0.99,
            target_update_period=10,
            learning_rate=1e-3,
        ),
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


def vmpo_loss(
    logits,
    target_logits,
    actions,
    value_norm,
    returns_norm,
    ended,
    eta,
    alpha,
    eps_eta=0.1,
    eps_alpha=0.007,
    top_fraction=0.5,
) -> VmpoLoss:
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

    def __init__(
        self,
        obs_shape,
        num_actions,
        network="deep",
        channels=(),
        use_lstm=True,
        lstm_size=256,
        head_hidden=256,
        mlp_hidden=(64, 64),
        num_tasks=1,
        popart_beta=1e-4,
        popart_scale_lower=1e-2,
        popart_scale_upper=1e6,
        init="orthogonal",
    ):
        super().__init__()
        self.config = dict(
            obs_shape=tuple(obs_shape),
            num_actions=num_actions,
            network=network,
            channels=tuple(channels),
            use_lstm=use_lstm,
            lstm_size=lstm_size,
            head_hidden=head_hidden,
            mlp_hidden=tuple(mlp_hidden),
            num_tasks=num_tasks,
            popart_beta=popart_beta,
            popart_scale_lower=popart_scale_lower,
            popart_scale_upper=popart_scale_upper,
            init=init,
        )
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
# The run: setup, the paper's loop, the end.


def main(args: Args):
    args, resumed = resume_args(args)
    spec, games = check_args(args)
    multitask = len(games) > 0
    args = dataclasses.replace(args, env_ids=tuple(games))
    rank, world, device = learner_process(args)
    obs_shape = spec.observation_space.shape
    num_actions = 18 if multitask else int(spec.action_space.n)  # the full Atari action set for many games
    atari = is_atari(games[0] if multitask else args.env_id)
    agent = Agent(
        obs_shape,
        num_actions,
        args.network,
        args.channels if len(obs_shape) == 3 else (),
        args.use_lstm,
        args.lstm_size,
        args.head_hidden,
        args.mlp_hidden,
        max(1, len(games)),
        args.popart_beta,
        args.popart_scale_lower,
        args.popart_scale_upper,
        args.init,
    ).to(device)
    multipliers = LagrangeMultipliers(args.init_eta, args.init_alpha, args.multipliers, args.min_multiplier).to(device)
    params = list(agent.parameters()) + list(multipliers.parameters())
    broadcast_parameters(params, world)
    optimizer = make_optimizer(args, agent, multipliers)
    start_update, target_state = 0, None
    if resumed is not None:
        agent.load_state_dict(resumed["agent"])
        multipliers.load_state_dict(resumed["multipliers"])
        optimizer.load_state_dict(resumed["optimizer"])
        start_update, target_state = resumed["update"], resumed["target_agent"]
    task_name = f"{len(games)}games" if multitask else args.env_id
    describe = f"device {device}, {world} learner process(es), {args.num_actors * world} actor process(es), "
    describe += f"{args.num_envs * world} envs{', ' + str(len(games)) + ' games' if multitask else ''}"
    log = RunLog(args, FAMILY_DEFAULTS, task_name, resumed, describe, write=rank == 0)
    steps_per_update = args.batch_size * args.unroll_length
    num_updates = args.total_timesteps // steps_per_update
    chunks = args.num_minibatches // world  # minibatches of this learner process, one after the other
    global_step, last_checkpoint = log.start_step, time.time()

    def checkpoint(update):
        if rank == 0:
            check_finite_parameters(f"at update {update}", agent=agent, multipliers=multipliers)
            if args.save_model:  # a run stopped early can be evaluated too
                save_model(saved_model(args, agent, multipliers, games, atari, global_step), log.path)
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
        if popart_before is not None:  # the update in progress is dropped, with what its loss did to PopArt
            agent.popart.load_state_dict(popart_before)
        return checkpoint(done_update)

    # Ctrl-C or SIGTERM: stop at once, dropping the update in progress (on a CPU one update of the default ResNet
    # + LSTM takes minutes), and save the last completed update's state. Only the few lines that change the
    # training state (the optimiser step to the target refresh) finish first.
    interrupt, pool = Interrupt(), None
    update = done_update = start_update
    popart_before = None
    try:
        specs = recurrent_buffer_specs(spec.observation_space, num_actions, args)
        env_options = dict(episodic_life=args.episodic_life, reward_clip=args.reward_clip)
        cfgs = actor_configs(args, rank, device, args.env_ids, **env_options)
        pool = ActorPool(act, cfgs, agent, specs, args.batch_size // world, device)
        if target_state is not None:  # the target network the run was acting with
            pool.publish(target_state)
        for update in range(start_update + 1, num_updates + 1):
            batch = pool.next_batch(  # a progress line also while the batch is being collected
                lambda ready: rank == 0 and log.collecting(global_step, ready, pool.batch_size, args.unroll_length)
            )
            popart_before = {k: v.clone() for k, v in agent.popart.state_dict().items()}  # the loss moves PopArt
            optimizer.zero_grad(set_to_none=False)
            stats, logits, obs = minibatch_gradients(agent, multipliers, batch, args, chunks)
            if world > 1:
                average_gradients(params, world)
            log_due = rank == 0 and (log.due() or update == num_updates)
            layer_norms = grad_norms_by_layer(agent) if log_due else {}  # before clipping, only when logged
            grad_norm = nn.utils.clip_grad_norm_(
                agent.parameters(), args.max_grad_norm if args.max_grad_norm > 0 else float("inf")
            )
            where = f"at update {update} (step {update * steps_per_update})"
            check_finite(where, gradient=grad_norm, **{k.split("/")[-1]: v for k, v in stats.items()})
            with interrupt.commit():
                optimizer.step()
                multipliers.project()
                stale = (batch["version"][:-1] != pool.version.item()).float().mean()
                if update % args.target_update_period == 0:
                    pool.publish(agent.state_dict())  # θ_target ← θ_online
                global_step = update * steps_per_update
                log.first_update(global_step)
                done_update, popart_before = update, None
            if 0 < args.checkpoint_interval <= time.time() - last_checkpoint:
                checkpoint(update)
                last_checkpoint = time.time()
            episodes = list(pool.episodes)
            pool.episodes.clear()
            if rank != 0:
                continue
            for score, length, task in episodes:
                log.episode(score, length, global_step, *([games[task]] if multitask else []))
            if log_due:
                stats.update({"stats/stale_fraction": stale, "stats/target_version": pool.version.item()})
                stats["charts/learning_rate"] = args.learning_rate
                log_learner_stats(log, agent, games or [args.env_id], stats, layer_norms, logits, obs, global_step)
                log.console(
                    global_step,
                    f"entropy {stats['stats/entropy'].item():.2f} | η {stats['stats/eta'].item():.3f} "
                    f"α {stats['stats/alpha'].item():.3f} KL {stats['stats/kl'].item():.4f}",
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
        log.end(
            saved_model(args, agent, multipliers, games, atari, global_step), make_eval_policy, end_time, device, games
        )
    if world > 1:
        torch.distributed.destroy_process_group()


def make_eval_policy(checkpoint, num_envs, device="cpu", greedy=False):
    """A callable `policy(obs, rewards, first) -> actions` for `common/evaluation.py` (it keeps the LSTM state and
    the previous action itself); rewards are clipped as in training."""
    agent = Agent(**checkpoint["agent_config"]).to(device)
    agent.load_state_dict(checkpoint["agent"])
    return recurrent_policy(agent, num_envs, device, greedy, checkpoint["reward_clip"])


# ---------------------------------------------------------------------------------------------------------
# Acting (with the target network). Row t of an unroll holds obs_t, the reward and end flags that came with
# obs_t, the action taken at obs_t and the target policy's logits. An unroll has T+1 rows; its last row is the
# next unroll's first.


def act(actor_id, cfg, link):
    """Algorithm 1, 'use π_θtarget to act': steps an envpool with the target network and fills unrolls
    (the loop: common/actor_pool.py)."""
    act_recurrent(link, cfg)


# ---------------------------------------------------------------------------------------------------------
# Learning and process plumbing.


def check_args(args):
    """Bad input: one clear line before any work (UsageError). Returns the spec of the (first) game and the games
    of a multi-task run (presets expanded; empty for one game)."""
    games = check_games(args)
    spec = env_spec(games[0] if games else args.env_id, discrete=True)
    check_pool_args(args)
    if args.target_update_period < 1:
        raise UsageError(f"--target-update-period must be at least 1, got {args.target_update_period}")
    if not 0 < args.top_fraction <= 1:
        raise UsageError(f"--top-fraction must be in (0, 1], got {args.top_fraction}")
    for name in ("eps_eta", "eps_alpha", "init_eta", "init_alpha", "learning_rate"):
        if not getattr(args, name) > 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not 0 <= args.gamma <= 1:
        raise UsageError(f"--gamma must be in [0, 1], got {args.gamma}")
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
    out = vmpo_loss(
        logits,
        batch["logits"],
        batch["action"],
        value_norm,
        returns_norm,
        batch["ended"],
        eta,
        alpha,
        args.eps_eta,
        args.eps_alpha,
        args.top_fraction,
    )
    n = real.sum().clamp(min=1)
    stats = {
        **loss_stats(out),
        "stats/eta": eta.detach(),
        "stats/alpha": alpha.detach(),
        "stats/value_mean": (real * values[:-1]).sum() / n,
        "stats/popart_mu": popart.mu[0].clone(),
        "stats/popart_sigma": popart.sigma[0].clone(),
    }
    return out, stats


def minibatch_gradients(agent, multipliers, batch, args, chunks):
    """Accumulates the gradient of vmpo_loss over the batch's `chunks` minibatches of columns, one after the
    other. Returns the stats averaged over them, and the last minibatch's logits and observations."""
    stats = {}
    for cols in torch.arange(batch["obs"].shape[1], device=batch["obs"].device).chunk(chunks):
        mb = {k: v[cols] if k in ("core_h", "core_c") else v[:, cols] for k, v in batch.items()}
        state = (mb["core_h"], mb["core_c"]) if args.use_lstm else ()
        logits, value_features, _ = agent(mb["obs"], mb["prev_action"], mb["reward"], mb["first"], state)
        out, mb_stats = batch_loss(logits, value_features, mb, agent, multipliers, args, args.popart_beta / chunks)
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
    """What model.pt holds (common/evaluation.py plays it)."""
    return {
        "script": "vmpo_atari",
        "env_id": games[0] if games else args.env_id,
        "env_ids": list(games),
        "full_action_space": bool(games),
        "args": dataclasses.asdict(args),
        "agent_config": agent.config,
        "agent": {k: v.cpu() for k, v in agent.state_dict().items()},
        "multipliers": {k: v.cpu() for k, v in multipliers.state_dict().items()},
        "reward_clip": atari and args.reward_clip,
        "global_step": global_step,
    }


if __name__ == "__main__":
    cli(Args, main, FAMILY_DEFAULTS)
