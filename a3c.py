"""The asynchronous methods of Mnih, Badia, Mirza, Graves, Lillicrap, Harley, Silver, Kavukcuoglu (2016),
"Asynchronous Methods for Deep Reinforcement Learning": A3C, asynchronous advantage actor-critic, for discrete
(Atari, any envpool discrete task) and continuous actions, and the three value-based methods of Sec. 4 (one-step
Q-learning, one-step Sarsa, n-step Q-learning) for discrete actions: `--method`.

Actor-learner processes share one network in shared memory. Each copies it, acts t_max steps in its own envs,
computes its targets (A3C: n-step returns bootstrapped from its value; the value-based methods: from a shared target
network θ⁻ refreshed every I_target steps) and applies its gradient to the shared weights without locks (Hogwild),
by the paper's *shared* RMSProp, whose running average of squared gradients is in shared memory too.

| paper                                                               | here                          |
|---------------------------------------------------------------------|-------------------------------|
| Algorithm S3: sync θ' ← θ, act t_max steps, R ← r_i + γR backwards  | `train_worker`, `n_step_returns` |
| Algorithm S3: dθ ← ∇ log π(a|s)(R − V) + β∇H, dθ_v ← ∂(R − V)²/∂θ_v | `a3c_loss`                    |
| Algorithm 1: y = r + γ max_a' Q(s', a'; θ⁻); Sec. 4: Sarsa's Q(s', a') | `one_step_targets`         |
| Algorithm S2: R ← max_a Q(s_T, a; θ⁻), R ← r_i + γR backwards       | `value_targets`               |
| Algorithm 1, S2: dθ ← dθ + ∂(y − Q(s, a; θ))²/∂θ, θ⁻ ← θ every I_target | `q_loss`, `train_worker`  |
| Supp. 8: ε-greedy, ε from 1 to 0.1, 0.01, 0.5 (p 0.4, 0.3, 0.3)     | `epsilon_at`, `final_epsilon` |
| Algorithm S3: "asynchronous update of θ using dθ" (Hogwild)         | `hogwild_update`              |
| Sec. 4 Eq. (1), Supp. Eqs. (S2)-(S3): shared RMSProp                | `SharedRMSprop`               |
| Supp. 8: Atari network (16 8x8/4, 32 4x4/2, 256), softmax + value   | `Agent` (common/networks.py)  |
| Supp. 8: the value-based methods' one linear output per action      | `Agent(q_values=True)`        |
| Sec. 5.1: 256 LSTM cells after the last hidden layer                | `--lstm`                      |
| Supp. 9: 200 ReLU units, μ linear, σ² softplus, separate π and V    | `Agent`, vector observations  |
| Supp. 8-9: γ, α, t_max, β, learning rate annealed to 0              | `Args` defaults               |

What the paper leaves open (RMSProp's ε, gradient clipping, initialisation) and the defaults' measurements: docs/a3c.md.

    python a3c.py --env-id Breakout-v5 --method n-step-q
    python a3c.py --env-id HalfCheetah-v4 --num-workers 8 --lstm
"""

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
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from common.envs import EpisodeTracker, UsageError, check_render, env_spec, flat_obs_dim, flatten_obs, is_atari
from common.envs import make_env, require, require_in, task_family, to_env_action
from common.evaluation import evaluate_model, resume_checkpoint
from common.networks import LSTMCore, MLPTorso, RunningNorm, ShallowTorso, dead_units, init_output_, init_weights_


@dataclass
class Args:
    env_id: str = "Breakout-v5"  # envpool task id, discrete (Atari *-v5, CartPole-v1) or continuous (HalfCheetah-v4)
    method: Literal["a3c", "one-step-q", "one-step-sarsa", "n-step-q"] = "a3c"  # Sec. 4's four methods
    preset: Literal["family", "paper"] = "family"  # family: the env id's family defaults; paper: the paper's everywhere
    exp_name: str = "a3c"  # name of this experiment, part of the run folder's name
    seed: int = 1  # seed of the initial weights; worker w: torch seed + w, envs from seed + w·num_envs
    torch_deterministic: bool = True  # the house flag; no effect here: the workers run on the CPU, without cuDNN
    cuda: bool = False  # the house flag, refused: Hogwild workers share their parameters in CPU memory
    total_timesteps: int = 20_000_000  # environment steps over all workers (80M frames on Atari)
    num_workers: int = 0  # actor-learner processes; 0: one per CPU core (the paper: 16 threads, Supp. 8)
    num_envs: int = 1  # environments per worker, stepped together (1 in the paper)
    t_max: int = 5  # t_max (I_update of the one-step methods), steps per rollout and update (Supp. 8; --lstm: 20)
    target_update_period: int = 10_000  # I_target, steps between θ⁻ ← θ: 40k frames (Supp. 8)
    epsilon_steps: int = 1_000_000  # steps over which ε anneals from 1: 4M frames (Supp. 8)
    learning_rate: float = 1e-3  # η, initial learning rate (middle of the paper's LogUniform(1e-4, 1e-2), Supp. 8)
    rmsprop_alpha: float = 0.99  # α, RMSProp decay of the squared-gradient average g (Supp. 8)
    rmsprop_eps: float = 0.1  # ε of RMSProp, inside the square root (Eq. S3; not given in the paper)
    gamma: float = 0.99  # γ, discount (Supp. 8)
    ent_coef: float = 0.01  # β, entropy regularisation (Supp. 8)
    value_coef: float = 0.5  # weight of the value loss Σ (R − V)²
    max_grad_norm: float = 40.0  # gradient-norm clipping for pixels (not in the paper; as TorchBeast); 0: none
    lstm: bool = False  # recurrent agent: an LSTM after the last hidden layer (Sec. 5.1; Supp. 9)
    lstm_size: int = 256  # LSTM cells with --lstm (Sec. 5.1)
    hidden: int = 200  # ReLU units of the hidden layer for vector observations (Supp. 9)
    gaussian: Literal["paper", "tanh"] = "paper"  # paper: linear μ, σ² of the state (Supp. 9); tanh: tanh μ, σ learned
    scale_rewards: bool = False  # A3C: r / std of the running discounted return, clipped to ±10 (SB3's VecNormalize)
    save_model: bool = False  # write model.pt (weights, observation statistics) in the run folder
    capture_video: bool = False  # record the first evaluation episode (an animated PNG) in the run folder
    eval_episodes: int = 10  # evaluation episodes at the end of training, sampling from the policy (0: none)
    run_dir: str = "runs"  # folder of the run folders
    log_interval: float = 5.0  # seconds between console progress lines
    checkpoint_interval: float = 300.0  # seconds between checkpoints (also at the end and on Ctrl-C); 0: only then
    resume: str = ""  # a run folder to continue from its checkpoint.pt, with its own arguments


# Defaults by task family, measured in docs/a3c.md (with ε 0.1 RMSProp is plain SGD on Breakout's small gradients).
FAMILY_DEFAULTS = {
    "atari": ("the paper's settings (Supp. 8) with RMSProp ε 1e-5, measured on Breakout-v5", dict(rmsprop_eps=1e-5)),
    "mujoco": (
        "the paper's settings (Supp. 9) with 4 envs per worker, a tanh-bounded mean and a learned σ per dimension, "
        "rewards scaled by the return's std and RMSProp ε 1e-5, measured on Hopper-v4 and HalfCheetah-v4",
        dict(num_envs=4, gaussian="tanh", scale_rewards=True, rmsprop_eps=1e-5),
    ),
    "classic": (
        "the paper's settings with 8 envs per worker (2 workers: the paper's 16 actors, each with its own final ε) "
        "and a budget, measured on CartPole-v1",
        dict(num_envs=8, total_timesteps=1_000_000),
    ),
}
PAPER = "the paper's settings (the Args defaults)"  # the defaults' source without a family entry
# The Args defaults are the paper's for Atari (Supp. 8). Vector observations take Supp. 9's LSTM, no clipping, θ⁻
# every 500 steps, ε over a third of the run (measured on CartPole-v1); --lstm t_max 20. --preset paper keeps these.
VECTORS = dict(lstm_size=128, max_grad_norm=0.0, target_update_period=500)


def defaults_for(args, given=()) -> tuple[str, str, dict]:
    """(task family, the defaults' source, their values) of a run of `args`: the observations', actions' and --lstm's
    values above and, unless `--preset paper`, the family's on top (`given`: the flags on the command line)."""
    family = task_family(args.env_id)
    source, values = FAMILY_DEFAULTS.get(family, (PAPER, {}))
    if args.preset == "paper":
        source, values = PAPER + ", forced by --preset paper", {}
    total = values.get("total_timesteps", args.total_timesteps)
    if "--total-timesteps" in given:
        total = args.total_timesteps
    own = {} if is_atari(args.env_id) else dict(VECTORS, epsilon_steps=max(1, total // 3))
    own.update({} if hasattr(env_spec(args.env_id).action_space, "n") else dict(ent_coef=1e-4))  # Supp. 9's β
    return family, source, {**own, **(dict(t_max=20) if args.lstm else {}), **values}


# ---------------------------------------------------------------------------------------------------------
# The paper's math: pure functions of time-major [T, B] tensors.


@torch.no_grad()
def n_step_returns(rewards, discounts, bootstrap_value):
    """Algorithm S3: R ← V(s_t), then R ← r_i + γ_i R for i = t−1 down to t_start, γ_i = γ (1 − done_i): every step
    gets the longest return the rollout allows. `[T, B]` rewards and discounts, bootstrap_value `[B]`."""
    returns = [bootstrap_value]
    for t in reversed(range(rewards.shape[0])):
        returns.insert(0, rewards[t] + discounts[t] * returns[0])
    return torch.stack(returns[:-1])


def a3c_loss(log_probs, entropies, values, rewards, terminated, ended, bootstrap_value, gamma, ent_coef, value_coef):
    """Algorithm S3's accumulated gradients as one loss on a rollout `[T, B]`, averaged over the B environments:

        L = Σ_t [ −log π(a_t|s_t) (R_t − V(s_t)) − β H(π(·|s_t)) + value_coef (R_t − V(s_t))² ]

    At envpool's reset steps (`ended`) no loss, and R_t = V(s_t): a truncation bootstraps. Returns (loss, stats)."""
    values_sg = values.detach()
    discounts = torch.where(ended, 0.0, gamma * (~terminated).float())
    returns = n_step_returns(torch.where(ended, values_sg, rewards), discounts, bootstrap_value)
    mask = (~ended).float()
    advantages = returns - values_sg
    B = values.shape[1]
    policy_loss = -(mask * log_probs * advantages).sum() / B
    entropy = (mask * entropies).sum() / B
    value_loss = (mask * (returns - values) ** 2).sum() / B
    loss = policy_loss - ent_coef * entropy + value_coef * value_loss
    n = mask.sum().clamp(min=1)
    return loss, {
        "losses/policy_loss": policy_loss.detach(),
        "losses/value_loss": value_loss.detach(),
        "losses/entropy": (entropy * B / n).detach(),
        "stats/advantage_mean": (mask * advantages).sum() / n,
        "stats/value_mean": (mask * values_sg).sum() / n,
    }


def one_step_targets(rewards, discounts, next_q_target, next_actions=None):
    """Algorithm 1's y = r + γ max_a' Q(s', a'; θ⁻), or with `next_actions` (a' taken at s') one-step Sarsa's
    y = r + γ Q(s', a'; θ⁻) (Sec. 4). `next_q_target` `[T, B, A]`: θ⁻'s values at s_{t+1}."""
    if next_actions is None:
        return rewards + discounts * next_q_target.max(-1).values
    return rewards + discounts * next_q_target.gather(-1, next_actions.long().unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def value_targets(method, rewards, terminated, ended, q_target, next_actions, gamma):
    """Targets from θ⁻'s values `q_target` `[T+1, B, A]` at s_0..s_T: `one_step_targets`, or n-step Q-learning's
    R ← r_i + γ R from R = max_a Q(s_T, a; θ⁻) (Algorithm S2), R_t = max_a Q(s_t, a; θ⁻) at reset steps (`ended`)."""
    discounts = torch.where(ended, 0.0, gamma * (~terminated).float())
    if method != "n-step-q":
        return one_step_targets(rewards, discounts, q_target[1:], next_actions)
    v = q_target.max(-1).values
    return n_step_returns(torch.where(ended, v[:-1], rewards), discounts, v[-1])


def q_loss(q_taken, targets, ended):
    """Algorithm 1's and S2's accumulated dθ ← dθ + ∂(y − Q(s, a; θ'))²/∂θ' as one loss, Σ_t (y_t − Q(s_t, a_t))²
    averaged over the B environments, none at envpool's reset steps (`ended`). Returns (loss, stats)."""
    mask = (~ended).float()
    loss = (mask * (targets - q_taken) ** 2).sum() / q_taken.shape[1]
    q_mean = (mask * q_taken.detach()).sum() / mask.sum().clamp(min=1)
    return loss, {"losses/td_loss": loss.detach(), "stats/q_mean": q_mean}


EVAL_EPSILON = 0.05  # the value-based methods' evaluation policy: ε-greedy, DQN's ε (greedy with evaluate.py --greedy)


def final_epsilon(n, generator=None) -> torch.Tensor:
    """Each of n actors' final ε: 0.1, 0.01 or 0.5 with probabilities 0.4, 0.3, 0.3 (Supp. 8 draws one per
    actor-learner thread; here each environment of a worker is an actor with its own exploration policy)."""
    draws = torch.multinomial(torch.tensor((0.4, 0.3, 0.3)), n, replacement=True, generator=generator)
    return torch.tensor((0.1, 0.01, 0.5))[draws]


def epsilon_at(step, final, anneal_steps):
    """ε after `step` steps of all workers: linear from 1 to `final` over `anneal_steps`, then `final` (Supp. 8)."""
    return final + (1.0 - final) * max(0.0, 1.0 - step / anneal_steps)


def epsilon_greedy(q, epsilon, generator=None):
    """The action of the largest Q-value `[..., A]` with probability 1 − ε, else a uniform one (Algorithm 1)."""
    explore = torch.rand(q.shape[:-1], generator=generator) < epsilon
    return torch.where(explore, torch.randint(q.shape[-1], q.shape[:-1], generator=generator), q.argmax(-1))


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
# The agent.


class Body(nn.Module):
    """A torso, then (with `lstm_size`) an LSTM fed its features alone: `[T, B, ...]` -> `[T, B, F]`."""

    def __init__(self, obs_shape, hidden=200, lstm_size=0):
        super().__init__()
        if len(obs_shape) == 3:  # orthogonal init: with PyTorch's default the torso starts nearly state-blind on Atari
            self.torso = init_weights_(ShallowTorso(obs_shape))
        else:
            self.torso = MLPTorso(int(math.prod(obs_shape)), (hidden,), activation=nn.ReLU)
        self.core = LSTMCore(self.torso.out_features, 0, lstm_size, action_reward_inputs=False) if lstm_size else None
        self.out_features = lstm_size or self.torso.out_features

    def forward(self, obs, first, state):
        T, B = first.shape
        x = self.torso(obs.reshape(T * B, *obs.shape[2:])).view(T, B, -1)
        if self.core is not None:
            x, state = self.core(x, None, None, first, state)
        return x, state


class Agent(nn.Module):
    """A softmax policy (Supp. 8) or a Gaussian: "paper", a linear μ and a spherical σ² = softplus(linear) + 1e-5 of
    the state (Supp. 9); "tanh", μ = tanh(linear) in the action box, a learned log σ per dimension (docs/a3c.md: a
    linear μ drifts outside the box). One body for π and V on pixels (Supp. 8), two on normalised vectors (Supp. 9).
    `q_values`: the value-based methods' Q(s, ·; θ) (Supp. 8), one body and one linear output per action, V = max_a Q.
    `forward` maps `[T, B, ...]` to `pi` (logits or Q `[T, B, A]`, or μ then σ `[T, B, 2d]`), values and state."""

    def __init__(self, obs_shape, num_actions=0, action_dim=0, hidden=200, lstm_size=0, gaussian="paper",
                 scale_rewards=False, q_values=False):  # fmt: skip
        super().__init__()
        pixels = len(obs_shape) == 3
        self.config = dict(obs_shape=tuple(obs_shape), num_actions=num_actions, action_dim=action_dim, hidden=hidden)
        self.config.update(lstm_size=lstm_size, gaussian=gaussian, scale_rewards=scale_rewards, q_values=q_values)
        self.return_norm = RunningNorm(1) if scale_rewards else None  # statistics of the discounted return
        self.action_dim = action_dim
        self.obs_norm = RunningNorm(int(math.prod(obs_shape))) if not pixels else None
        self.body = Body(obs_shape, hidden, lstm_size)
        self.value_body = Body(obs_shape, hidden, lstm_size) if (action_dim or not pixels) and not q_values else None
        n = self.body.out_features
        state_std = action_dim and gaussian == "paper"
        self.policy = nn.Linear(n, action_dim + 1 if state_std else action_dim or num_actions)
        self.log_std = None
        if action_dim and gaussian == "tanh":
            self.log_std = nn.Parameter(torch.full((action_dim,), -0.5))  # σ ≈ 0.6 at first (Tianshou's A2C, PPO)
            init_output_(self.policy, 0.01)  # μ ≈ 0 at the start, whatever the observation
        self.value = None if q_values else nn.Linear(n, 1)
        if pixels:  # CleanRL's readouts (near-uniform first policy; values, Q too, at gain 1); vectors keep PyTorch's
            init_output_(self.policy, 1.0 if q_values else 0.01)
        if pixels and not q_values:
            init_output_(self.value, 1.0)

    def initial_state(self, batch_size):
        bodies = (self.body, self.value_body)
        return tuple(b.core.initial_state(batch_size) for b in bodies if b is not None and b.core is not None)

    def forward(self, obs, first, state=()):
        obs = self.obs_norm(obs) if self.obs_norm is not None else obs
        bodies = [b for b in (self.body, self.value_body) if b is not None]  # the policy's, then the value's
        features = [body(obs, first, state[i] if state else None) for i, body in enumerate(bodies)]
        pi = self.policy(features[0][0])
        if self.log_std is not None:
            pi = torch.cat([torch.tanh(pi), self.log_std.exp().expand_as(pi)], dim=-1)
        elif self.action_dim:
            mean, raw_var = pi.split(self.action_dim, dim=-1)
            pi = torch.cat([mean, (F.softplus(raw_var) + 1e-5).sqrt().expand_as(mean)], dim=-1)
        values = pi.max(-1).values if self.value is None else self.value(features[-1][0]).squeeze(-1)
        return pi, values, tuple(s for _, s in features) if state else ()

    def log_prob_entropy(self, pi, actions):
        """log π(a|s) and the entropy H(π(·|s)), both `[...]`; the Gaussian's entropy is Σ_i ½ (log(2πσ_i²) + 1),
        for the paper's spherical one d · ½ (log(2πσ²) + 1) (Supp. 9)."""
        if self.action_dim:
            gaussian = torch.distributions.Normal(*pi.chunk(2, dim=-1), validate_args=False)
            return gaussian.log_prob(actions).sum(-1), gaussian.entropy().sum(-1)
        log_p = F.log_softmax(pi, dim=-1)
        return log_p.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1), -(log_p.exp() * log_p).sum(-1)

    @torch.no_grad()
    def sample(self, pi, greedy=False, epsilon=EVAL_EPSILON):
        """An action of π, or ε-greedy on the Q-values (Algorithm 1); `greedy`: the most probable, the mean, the max."""
        if self.value is None:
            return epsilon_greedy(pi, 0.0 if greedy else epsilon)
        if self.action_dim:
            mean, std = pi[..., : self.action_dim], pi[..., self.action_dim :]
            return mean if greedy else mean + std * torch.randn_like(mean)
        if greedy:
            return pi.argmax(-1)
        return torch.multinomial(F.softmax(pi.reshape(-1, pi.shape[-1]), -1), 1).view(pi.shape[:-1])


# ---------------------------------------------------------------------------------------------------------
# Acting and learning: a worker runs Algorithm S3 (A3C), or Algorithm 1 or S2 (the value-based methods).


def train_worker(worker_id, args, shared, target, optimizer, counter, obs_lock, msg_q, halt=None, started=None):
    """One actor-learner thread, a process here: sync θ' ← θ, act t_max steps, update the shared θ (Algorithm S3; with
    the shared θ⁻ `target`, Algorithm 1, Sec. 4's Sarsa or S2). It starts with the others (`started`), sends
    its episodes to `msg_q` and stops once `halt` is set."""
    n, T, value_based = args.num_envs, args.t_max, target is not None
    torch.manual_seed(args.seed + worker_id)
    envs = make_env(args.env_id, n, args.seed + worker_id * n, training=True, num_threads=1)
    local = Agent(**shared.config)
    continuous, pixels = local.action_dim > 0, len(local.config["obs_shape"]) == 3
    if continuous:
        low, high = envs.action_space.low.astype(np.float32), envs.action_space.high.astype(np.float32)
    final = final_epsilon(n) if value_based else None  # each environment's final ε (Supp. 8)
    sarsa_action = None  # one-step Sarsa: a', chosen at the last rollout's s_T, is the next rollout's first action
    tracker = EpisodeTracker(n)
    obs = obs_tensor(envs.reset()[0])
    ended = torch.zeros(n, dtype=torch.bool)  # obs is the last one of an episode: the next step is a reset step
    first = torch.ones(n, dtype=torch.bool)  # obs starts an episode (the LSTM state is zeroed there)
    state = local.initial_state(n)
    last_report = 0.0
    discounted_return = np.zeros(n)  # --scale-rewards: each environment's discounted return so far
    if started is not None:
        started.wait()  # every worker set up: they take their steps of the budget together, none left to one
    while counter.value < args.total_timesteps and not (halt and halt.is_set()):
        copy_network(local, shared, obs_lock)  # θ' ← θ
        synced_at = counter.value
        epsilon = epsilon_at(synced_at, final, args.epsilon_steps) if value_based else None
        start_state = state  # (acting runs without gradients: the state carries none)
        rollout = []  # rows 0..T-1: obs, first, action, reward, terminated, ended
        returns_seen = []
        with torch.no_grad():  # act; the loss takes one batched pass over the rollout afterwards
            for t in range(T):
                out, _, state = local(obs[None], first[None], state)  # π's parameters, or the Q-values
                check_finite(f"while acting at step {counter.value}", policy=out)
                action = sarsa_action if t == 0 and sarsa_action is not None else local.sample(out[0], epsilon=epsilon)
                env_action = to_env_action(action.numpy(), low, high) if continuous else action.numpy()
                next_obs, reward, term, trunc, info = envs.step(env_action)
                for _, score, length in tracker.step(info["env_id"], reward, term, trunc, info):
                    msg_q.put(("episode", counter.value, (score, length)))
                if local.return_norm is not None:
                    discounted_return = discounted_return * args.gamma + reward
                    returns_seen.append(torch.as_tensor(discounted_return))
                    reward = scale_rewards(reward, local.return_norm.var)
                    discounted_return = np.where(term | trunc, 0.0, discounted_return)  # a new array: R kept above
                rollout.append([torch.as_tensor(v) for v in (obs, first, action, reward, term, ended)])
                first, ended = ended, torch.as_tensor(term | trunc)
                obs = obs_tensor(next_obs)
        rows_obs, rows_first, actions, rewards, terminated, ends = (torch.stack(column) for column in zip(*rollout))
        # the rollout's rows and the bootstrap observation s_T, through θ' from the rollout's first state
        all_obs, all_first = torch.cat([rows_obs, obs[None]]), torch.cat([rows_first, first[None]])
        out, values, _ = local(all_obs, all_first, start_state)
        if value_based:
            q_target = target(all_obs, all_first)[0].detach()  # θ⁻'s values at s_0..s_T
            if args.method == "one-step-sarsa":  # a' at s_T, ε-greedy on θ' (taken first in the next rollout)
                sarsa_action = local.sample(out[-1], epsilon=epsilon)
            next_actions = torch.cat([actions[1:], sarsa_action[None]]) if sarsa_action is not None else None
            targets = value_targets(args.method, rewards.float(), terminated, ends, q_target, next_actions, args.gamma)
            loss, stats = q_loss(out[:-1].gather(-1, actions.long().unsqueeze(-1)).squeeze(-1), targets, ends)
            stats["stats/epsilon"] = epsilon.mean()  # over the worker's environments
        else:
            log_probs, entropies = local.log_prob_entropy(out[:-1], actions)
            coefs = dict(gamma=args.gamma, ent_coef=args.ent_coef, value_coef=args.value_coef)
            rollout_end = dict(terminated=terminated, ended=ends, bootstrap_value=values[-1].detach())
            loss, stats = a3c_loss(log_probs, entropies, values[:-1], rewards.float(), **rollout_end, **coefs)
        with counter.get_lock():
            step = counter.value
            counter.value += T * n
        # η annealed by the steps of all workers (a shared counter, which LambdaLR's per-process count is not)
        lr = args.learning_rate * max(0.0, 1.0 - step / args.total_timesteps)
        optimizer.param_groups[0]["lr"] = lr
        grad_norm = hogwild_update(local, shared, optimizer, loss, args.max_grad_norm)
        with obs_lock:  # the shared statistics take this rollout's observations (and returns)
            if shared.obs_norm is not None:
                shared.obs_norm.update(rows_obs)
            if shared.return_norm is not None:
                shared.return_norm.update(torch.stack(returns_seen)[..., None])
        if value_based and (step + T * n) // args.target_update_period > step // args.target_update_period:
            copy_network(target, shared, obs_lock)  # θ⁻ ← θ every I_target steps of all workers (Algorithm 1)
        if worker_id == 0 and (time.time() - last_report >= 1.0 or counter.value >= args.total_timesteps):
            lag = (step - synced_at) / (T * n)  # other workers' updates meanwhile
            stats.update({"charts/learning_rate": lr, "stats/grad_norm": grad_norm, "stats/policy_lag": lag})
            torso_in = rows_obs.flatten(0, 1) if pixels else local.obs_norm(rows_obs.flatten(0, 1))
            stats["stats/active_units"] = 1 - dead_units(local.body.torso(torso_in))  # 0: the torso has died
            if continuous:
                stats["stats/policy_std"] = out[:-1, :, local.action_dim :].detach().mean()
            msg_q.put(("stats", step + T * n, {k: float(v) for k, v in stats.items()}))
            last_report = time.time()
    msg_q.put(("done", counter.value, worker_id))


# ---------------------------------------------------------------------------------------------------------
# The run: setup, the workers (the paper's loop runs in them), the end.


def main(args: Args):
    args, resumed = resume_checkpoint(args.resume, os.path.basename(__file__), Args) if args.resume else (args, None)
    args, spec = check_args(args)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    pixels, discrete = is_atari(args.env_id), hasattr(spec.action_space, "n")
    obs_shape = tuple(spec.observation_space.shape) if pixels else (flat_obs_dim(spec),)
    num_actions, action_dim = (spec.action_space.n, 0) if discrete else (0, spec.action_space.shape[0])
    q_values = args.method != "a3c"  # the value-based methods' Q-network
    heads = dict(gaussian=args.gaussian, scale_rewards=args.scale_rewards and not q_values, q_values=q_values)
    agent = Agent(obs_shape, num_actions, int(action_dim), args.hidden, args.lstm_size if args.lstm else 0, **heads)
    target = copy.deepcopy(agent).requires_grad_(False) if q_values else None  # θ⁻ ← θ (Algorithm 1)
    optimizer = SharedRMSprop(agent.parameters(), args.learning_rate, args.rmsprop_alpha, args.rmsprop_eps)
    parts = dict(agent=agent, target=target, optimizer=optimizer)  # θ (and the observation statistics), θ⁻, g
    for name, part in ((k, v) for k, v in parts.items() if v is not None):
        if resumed is not None:
            part.load_state_dict(resumed[name])
        part.share_memory()  # read and written by every worker
    # The training state: views of the shared tensors; model.pt: what evaluate.py and `make_eval_policy` play.
    state = {name: None if part is None else part.state_dict() for name, part in parts.items()}
    model = dict(script="a3c", env_id=args.env_id, args=dataclasses.asdict(args), agent_config=agent.config)
    model["agent"] = state["agent"]
    if not discrete:
        box = spec.action_space
        model.update(action_low=box.low.astype(np.float32).tolist(), action_high=box.high.astype(np.float32).tolist())
    network = "LSTM" if args.lstm else "feed-forward"
    describe = f"{args.method}, {args.num_workers} workers x {args.num_envs} env(s), t_max {args.t_max}, {network}"
    describe += f", θ⁻ every {args.target_update_period} steps" if target is not None else ""
    log = RunLog(args, resumed, describe)

    def save(step):  # the shared state as the workers leave it (read without locks, as they read it)
        check_finite(f"at step {step}", **state["agent"])
        log.save(step, state, dict(model, global_step=step) if args.save_model else None)

    step = run_workers(train_worker, (agent, target, optimizer), log, save)  # the paper's loop runs in the workers
    log.end(step, evaluate_model(log, dict(model, global_step=step), make_eval_policy), num_workers=args.num_workers)


def make_eval_policy(checkpoint, num_envs, device="cpu", greedy=False):
    """`policy(obs, rewards, first) -> actions` of a saved model for evaluate.py, keeping its LSTM state: sampled (or
    the most probable / the mean), or for the value-based methods ε-greedy with ε = EVAL_EPSILON (or greedy)."""
    agent = Agent(**checkpoint["agent_config"]).to(device).eval()
    agent.load_state_dict(checkpoint["agent"])
    state = tuple((h.to(device), c.to(device)) for h, c in agent.initial_state(num_envs))
    low, high = checkpoint.get("action_low"), checkpoint.get("action_high")

    @torch.no_grad()
    def policy(obs, rewards, first):
        nonlocal state
        first_t = torch.as_tensor(first, device=device).bool()[None]
        out, _, state = agent(obs_tensor(obs).to(device)[None], first_t, state)
        action = agent.sample(out[0].cpu(), greedy).numpy()
        return to_env_action(action, np.asarray(low), np.asarray(high)) if agent.action_dim else action

    return policy


def check_args(args):
    """Bad input: one clear line before any work (UsageError). Returns the arguments (--num-workers 0: one per core)
    and the env spec."""
    spec = env_spec(args.env_id)
    require(not args.cuda, "--cuda is not available in a3c.py: its Hogwild workers share parameters in CPU memory")
    if args.capture_video:
        check_render(args.env_id)
    require_in("[1, inf)", args, "num_envs t_max hidden lstm_size target_update_period epsilon_steps")
    require_in("(0, inf)", args, "learning_rate rmsprop_eps")
    require_in("[0, inf)", args, "num_workers value_coef ent_coef max_grad_norm")
    require_in("[0, 1)", args, "rmsprop_alpha")
    require_in("[0, 1]", args, "gamma")
    rollout = f"one rollout (t-max x num-envs = {args.t_max * args.num_envs} steps)"
    require(args.total_timesteps >= args.t_max * args.num_envs, f"--total-timesteps is less than {rollout}")
    if args.method != "a3c":  # the value-based methods
        what = f"--method {args.method}"
        require(hasattr(spec.action_space, "n"), f"{what} takes discrete actions, {args.env_id} has continuous ones")
        require(not args.lstm, f"{what} is feed-forward, as in the paper; --lstm is A3C's (Sec. 5.1)")
    return dataclasses.replace(args, num_workers=args.num_workers or os.cpu_count() or 1), spec


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
