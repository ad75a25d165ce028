"""P3S-TD3, population-guided parallel policy search with TD3 learners, continuous actions (MuJoCo): Jung, Park,
Sung (2020), "Population-Guided Parallel Policy Search for Reinforcement Learning" (ICLR 2020), on top of TD3:
Fujimoto, van Hoof, Meger (2018), "Addressing Function Approximation Error in Actor-Critic Methods".

N identical TD3 learners, each acting in its own copy of the environment, write their experience into one shared
replay and learn from uniform minibatches of all of it. Every M time steps the learner with the best mean return
over its last E_r training episodes becomes the best learner b; a frozen copy of its policy π_b guides the others
for the next M steps through an extra term in their policy loss, β·E_s[½‖π_i(s) − π_b(s)‖²]. β adapts so that the
other learners stay about d_search = max(ρ·D_change, d_min) away from π_b. With one learner this is plain TD3.

| paper                                                              | here                                   |
|--------------------------------------------------------------------|----------------------------------------|
| Alg. 1 lines 5-11: N learners act in their own envs, one replay D  | `main`, `SharedReplay`                 |
| Eq. (80): y = r + γ min_j Q'_j(s', π'(s') + clip(ε))                | `smoothed_target_action`, `td3_target` |
| Eq. (83): L(θ_j) = E[(y − Q_j(s, a))²]                              | `critic_loss`                          |
| Eq. (84): L(φ_i) = E[−Q_1(s, π_i(s)) + 1{i≠b} β ½‖π_i(s) − π_b(s)‖²] | `p3s_actor_loss`, `policy_distance`  |
| Eq. (82): target networks θ' ← (1 − τ)θ' + τθ every d updates      | `soft_update`, `Learners.update`       |
| Alg. 1 lines 24-26: every M steps select b on the last E_r returns | `synchronise`, `select_best`           |
| Eq. (6) = Eq. (76): β ← 2β or β/2 against max{ρ D_change, d_min}    | `adapt_beta`                           |
| Sec. 3: D_spread and D_change over the non-best learners            | `Learners.period_distances`            |
| App. I: 400-300 ReLU networks, tanh policy, Adam 1e-3, τ, B, σ, c   | `Actor`, `TwinQ`, `Args` defaults      |
| Sec. 4.2: delayed MuJoCo, rewards given every f_reward = 20 steps   | `DelayedReward`, `--reward-delay`      |
| Sec. 4.1: every R_eval steps each learner's 10 episodes, best mean | `evaluate_learners`, `--eval-interval` |

The N learners' networks are stacked (`Linears`: weights `[N, out, in]`): one update of all is N separate TD3
updates. One process runs Algorithm 1 (`main`), the learners in lockstep; `--total-timesteps` counts the steps of
all learners (the paper's x axis). Where the authors' code, which made the paper's curves, departs from the text,
the defaults follow the code (N updates per learner step, a longer start, D averaged over action dimensions and over
the period's updates, no guidance before the first selection, Xavier weights) and `--preset paper` the text.

    python p3s_td3.py --env-id HalfCheetah-v4
    python p3s_td3.py --env-id Hopper-v4 --reward-delay 20 --num-learners 1   # TD3 on delayed Hopper
"""

import copy
import dataclasses
import hashlib
import itertools
import json
import math
import os
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn as nn

from common.envs import EpisodeTracker, UsageError, check_render, env_spec, flat_obs_dim, flatten_obs, make_env
from common.envs import require, require_in, task_family, to_env_action
from common.evaluation import evaluate, resume_checkpoint
from common.networks import batched_mlp


@dataclass
class Args:
    env_id: str = "HalfCheetah-v4"  # envpool continuous-action task (Hopper-v4, Walker2d-v4, Ant-v4, Pendulum-v1, ...)
    preset: Literal["family", "paper"] = "family"  # family: the env id's family defaults; paper: the paper's everywhere
    exp_name: str = "p3s_td3"  # name of this experiment, part of the run folder's name
    seed: int = 1  # seed of the common initial weights, the noise and the sampling
    torch_deterministic: bool = True  # torch.backends.cudnn.deterministic
    cuda: bool = True  # the learners' networks and the replay on the GPU when there is one
    threads: int = 0  # torch threads of the updates on a CPU; 0: the cores or 1, the faster as the run goes (docs)
    total_timesteps: int = 1_000_000  # environment steps of all learners together (the paper's Figs. 3-4: 1M)
    num_learners: int = 4  # N, learners (Sec. 4.1), updated together as one batch; 1 is plain TD3
    num_envs: int = 1  # environment copies per learner (1 in the paper)
    updates_per_step: int = 4  # updates of a learner per interaction of its own: N (authors' code; the text: 1)
    t_initial: int = 3000  # T_initial, random-action steps per learner: HalfCheetah's of N = 4 (`defaults_for`)
    learning_starts: int = 10_000  # rows of D before the first update (authors' code); 0: after T_initial (text)
    distance: Literal["mean", "sum"] = "mean"  # D's ½Δa² over action dimensions: mean (authors' code), sum (text)
    guide_first_period: bool = False  # guide toward the initial policy before the first selection (text: Alg. 1, l. 1)
    best_period: int = 250  # M, time steps between selections of the best learner and updates of β (Sec. 4.1)
    recent_episodes: int = 10  # E_r, recent training episodes whose mean return ranks a learner (Sec. 4.1)
    rho: float = 2.0  # ρ, the search radius as a multiple of D_change (Sec. 4.1)
    d_min: float = 0.05  # d_min, minimum search radius: HalfCheetah's (App. I; other tasks: `defaults_for`)
    beta_init: float = 1.0  # β at the start (Algorithm 1, line 2), in [1e-3, 1e3], `adapt_beta`'s bounds
    buffer_size: int = 1_000_000  # size of the shared replay D, all learners together (App. I)
    batch_size: int = 100  # B, minibatch size (App. I)
    learning_rate: float = 1e-3  # Adam step size of the policies and the Q-functions (App. I)
    gamma: float = 0.99  # γ, discount (App. I)
    tau: float = 0.005  # τ, target smoothing factor (Eq. 82, App. I)
    policy_delay: int = 2  # d, Q updates per policy and target update (App. G)
    exploration_noise: float = 0.1  # σ of the Gaussian exploration noise (App. I)
    policy_noise: float = 0.2  # σ of the target policy smoothing noise (Eq. 80, App. I)
    noise_clip: float = 0.5  # c, clipping of the target policy smoothing noise (Eq. 80, App. I)
    hidden: tuple[int, ...] = (400, 300)  # hidden layers of the policy and each Q-function, ReLU (App. I)
    bf16: bool = False  # the hidden layers' matmuls in bfloat16, outputs float32 (a CPU with AVX512_BF16/AMX: docs)
    reward_delay: int = 0  # f_reward: rewards given every f_reward steps or at the episode's end (Sec. 4.2: 20)
    save_model: bool = False  # write model.pt (every learner's policy, the best one first) in the run folder
    capture_video: bool = False  # record the first evaluation episode (an animated PNG) in the run folder
    eval_episodes: int = 10  # evaluation episodes per learner; the score is the best learner's mean (Sec. 4.1)
    eval_interval: int = 4000  # R_eval, steps of all learners between evaluations (Sec. 4.1); 0: only at the end
    run_dir: str = "runs"  # folder of the run folders
    log_interval: float = 5.0  # seconds between console progress lines
    checkpoint_interval: float = 300.0  # seconds between checkpoints (after a time step); also at the end, on a stop
    resume: str = ""  # a run folder to continue from its checkpoint.pt, with its own arguments


# App. I: T_initial (Sec. 4.1) and d_min per task. The authors' code (github.com/wyjung0625/p3s) updates once D holds
# n_initial rows (examples/variants_p3s.py, sampler.py:240-243), acting at random for whole 1000-step epochs per
# learner until epoch x 1000 >= n_initial // N (base.py:108-111); the text's T_initial is n_initial // 4.
N_INITIAL = {"Hopper": 1000, "Walker2d": 1000, "HalfCheetah": 10000, "Ant": 10000}
D_MIN = {"Hopper": 0.05, "Walker2d": 0.02, "HalfCheetah": 0.05, "Ant": 0.02}
D_MIN_DELAYED = {"Hopper": 0.02, "Walker2d": 0.02, "HalfCheetah": 0.02, "Ant": 0.05}


# `--preset paper` reads the text where the authors' code (the defaults) departs from it (docs/p3s_td3.md).
PAPER_TEXT = dict(distance="sum", guide_first_period=True)

# Defaults by task family (a flag the user gives wins): MuJoCo, the paper's; classic control, measured on Pendulum-v1.
FAMILY_DEFAULTS = {
    "mujoco": ("the paper's MuJoCo settings as its authors' code runs them (Sec. 4.1, App. I)", {}),
    "classic": (
        "settings measured on Pendulum-v1",
        dict(total_timesteps=20_000, num_learners=2, t_initial=1000, learning_starts=2000),
    ),
}
PAPER = "the paper's settings as its authors' code runs them (the Args defaults)"  # defaults outside a family
PAPER_FORCED = "the paper's text (Sec. 4.1, App. H-I) where the authors' code departs from it, forced by --preset paper"


def defaults_for(args, given=()) -> tuple[str, str, dict]:
    """(task family, the defaults' source, their values) of a run of `args` (`given`: the flags given): the task's d_min
    and start, the authors' code's (N updates per learner step, p3s_td3.py:147) or under --preset paper the text's (one
    update per step, none before T_initial), the family's on top. Other tasks: HalfCheetah's start, d_min 0.05."""
    family, text = task_family(args.env_id), args.preset == "paper"
    source, values = (PAPER_FORCED, PAPER_TEXT) if text else FAMILY_DEFAULTS.get(family, (PAPER, {}))
    n = args.num_learners if "--num-learners" in given else values.get("num_learners", args.num_learners)
    name = args.env_id.split("-")[0]
    d_min = (D_MIN_DELAYED if args.reward_delay > 1 else D_MIN).get(name, 0.05)
    n_initial = N_INITIAL.get(name, 10000)
    t_initial, starts = (n_initial // 4, 0) if text else (1000 * math.ceil(n_initial // max(n, 1) / 1000), n_initial)
    own = dict(t_initial=t_initial, learning_starts=starts, d_min=d_min, updates_per_step=1 if text else n)
    return family, source, {**own, **values}


# ---------------------------------------------------------------------------------------------------------
# The paper's math: pure functions of tensors `[B, ...]` (a minibatch), or `[N, B, ...]` (one minibatch per
# learner of the population): the reductions run over the minibatch only, one value per learner.


def adapt_beta(beta, d_spread, d_change, rho, d_min, beta_min=1e-3, beta_max=1e3) -> float:
    """Eq. (76) (= Eq. 6), d_search = max{ρ D_change, d_min}: β ← 2β if D_spread > 1.5 d_search (the others drift too
    far from π_b: pull harder), β ← β/2 if D_spread < d_search / 1.5 (they hug π_b: let them search), else β; kept
    within [beta_min, beta_max]."""
    d_search = max(rho * d_change, d_min)
    if d_spread > d_search * 1.5:
        beta = beta * 2.0
    elif d_spread < d_search / 1.5:
        beta = beta / 2.0
    return float(min(max(beta, beta_min), beta_max))


def select_best(recent_returns, previous_best: int) -> int:
    """Algorithm 1, line 25: the learner whose last E_r training returns (the lists given) have the highest mean; one
    with none cannot be chosen; ties go to the lower index; with no returns at all, the previous best stays."""
    scores = [float(np.mean(r)) if len(r) else -math.inf for r in recent_returns]
    return previous_best if all(s == -math.inf for s in scores) else int(np.argmax(scores))


def policy_distance(actions, other_actions, reduction="mean"):
    """D(π, π') = ½‖π(s) − π'(s)‖² (Sec. 3.2) averaged over the minibatch. App. H calls it the mean square difference:
    `reduction` "mean" averages ½Δa² over the action dimensions, as the authors' code does
    (deterministic_policy.py:72-73) and App. I's d_min values assume; "sum" is the formula's squared norm."""
    half_sq = 0.5 * (actions - other_actions) ** 2
    return (half_sq.mean(-1) if reduction == "mean" else half_sq.sum(-1)).mean(-1)


def smoothed_target_action(target_actions, noise_std, noise_clip, generator=None):
    """Eq. (80)'s target policy smoothing: π'(s') + ε with ε ~ clip(N(0, σ²), −c, c), then kept in [-1, 1]."""
    noise = torch.randn(target_actions.shape, generator=generator, device=target_actions.device) * noise_std
    return (target_actions + noise.clamp(-noise_clip, noise_clip)).clamp(-1.0, 1.0)


def td3_target(rewards, terminated, next_q1, next_q2, gamma):
    """Eq. (80): y = r + γ (1 − terminated) min_j Q'_j(s', ã'), no gradient. Truncated episodes bootstrap."""
    return (rewards + gamma * (1.0 - terminated.float()) * torch.minimum(next_q1, next_q2)).detach()


def critic_loss(q1, q2, targets):
    """Eq. (83) for both Q-functions, summed: E[(y − Q_1)²] + E[(y − Q_2)²]."""
    return ((q1 - targets) ** 2).mean(-1) + ((q2 - targets) ** 2).mean(-1)


def p3s_actor_loss(q1_of_policy, policy_actions, best_actions, beta, guided, reduction="mean"):
    """Eq. (84): E_s[−Q_1(s, π_i(s))] + 1{i≠b} β E_s[½‖π_i(s) − π_b(s)‖²], `guided` = 1{i≠b} (per learner: the best
    one has TD3's loss, Eq. 81), `best_actions` from the frozen π_b. Returns the loss and the distance (logged for
    every learner); `reduction` is `policy_distance`'s."""
    distance = policy_distance(policy_actions, best_actions.detach(), reduction)
    loss = -q1_of_policy.mean(-1)
    loss = torch.where(torch.as_tensor(guided, device=loss.device), loss + beta * distance, loss)
    return loss, distance.detach()


@torch.no_grad()
def soft_update(target: nn.Module, source: nn.Module, tau: float) -> None:
    """Eq. (82): θ' ← (1 − τ) θ' + τ θ (one fused operation over all the parameters)."""
    torch._foreach_lerp_(list(target.parameters()), list(source.parameters()), tau)


class DelayedReward:
    """Delayed MuJoCo (Zheng et al. 2018, Sec. 4.2): the agent gets 0 while the rewards add up, and their sum every
    `delay` steps of an episode or at its end, so an episode's total is unchanged; `delay` 0 or 1 changes nothing."""

    def __init__(self, num_envs: int, delay: int):
        self.delay, self.acc, self.count = delay, np.zeros(num_envs, np.float64), np.zeros(num_envs, np.int64)

    def __call__(self, rewards, episode_end, real):
        """`rewards`, `episode_end` and `real` (False at envpool's reset steps, which count for nothing) per env."""
        self.acc += np.where(real, rewards, 0.0)
        self.count += real
        give = real & ((self.count >= self.delay) | episode_end)
        out = np.where(give, self.acc, 0.0).astype(np.float32)
        self.acc[give], self.count[give] = 0.0, 0
        return out


# ---------------------------------------------------------------------------------------------------------
# The networks (App. I): 400-300 ReLU, a tanh policy and two Q-functions of (s, a), for N learners side by side
# (`batched_mlp`: weights `[N, out, in]`), all starting alike (Algorithm 1, line 1); the shared replay; the learners.


def mlp_forward(net, x, bf16, out):
    """`net` on x; with `bf16` its hidden layers in bfloat16 (autocast) and its last `out` modules (the output layer,
    its activation) in float32: bfloat16 resolves a Q-value of 300 to ±1, the size of a late TD error (docs)."""
    if not bf16:
        return net(x)
    with torch.autocast(x.device.type, torch.bfloat16):
        x = net[:-out](x)
    return net[-out:](x.float())


class Actor(nn.Module):
    """Deterministic policies π_φi(s) in [-1, 1]^d of N learners, `[N, B, obs] -> [N, B, d]` (N = 1: model.pt's)."""

    def __init__(self, obs_dim, action_dim, hidden=(400, 300), num_learners=1, bf16=False):
        super().__init__()
        self.config, self.bf16 = dict(obs_dim=obs_dim, action_dim=action_dim, hidden=tuple(hidden)), bf16
        self.net = batched_mlp([obs_dim, *hidden, action_dim], num_learners, nn.Tanh())

    def forward(self, obs):
        return mlp_forward(self.net, obs, self.bf16, 2)

    def learner_state(self, i):
        """Learner i's policy as the state of an `Actor` with N = 1, on the CPU (model.pt loads anywhere)."""
        return {k: v[i : i + 1].detach().to("cpu", copy=True) for k, v in self.state_dict().items()}


class TwinQ(nn.Module):
    """Q_θ1 and Q_θ2 of N learners, each an MLP of the concatenated state and action: `[N, B, ...] -> [N, B]`."""

    def __init__(self, obs_dim, action_dim, hidden=(400, 300), num_learners=1, bf16=False):
        super().__init__()
        self.bf16, sizes = bf16, [obs_dim + action_dim, *hidden, 1]
        self.q1, self.q2 = (batched_mlp(sizes, num_learners) for _ in ("q1", "q2"))

    def forward(self, obs, actions):
        x = torch.cat([obs, actions], -1)
        return mlp_forward(self.q1, x, self.bf16, 1).squeeze(-1), mlp_forward(self.q2, x, self.bf16, 1).squeeze(-1)

    def q1_only(self, obs, actions):
        return mlp_forward(self.q1, torch.cat([obs, actions], -1), self.bf16, 1).squeeze(-1)


class SharedReplay:
    """One replay D for all learners: learner i writes into its own ring of capacity // N rows, `sample` draws
    uniformly from every row written; the write counts live on the CPU, so neither waits for the device."""

    FIELDS = ("obs", "actions", "rewards", "next_obs", "terminated")  # a row, in `add`'s and `sample`'s order

    def __init__(self, capacity, num_learners, obs_dim, action_dim, device="cpu"):
        self.num_learners, self.part, self.device = num_learners, capacity // num_learners, torch.device(device)
        shapes = dict(obs=(obs_dim,), actions=(action_dim,), rewards=(), next_obs=(obs_dim,), terminated=())
        for k, shape in shapes.items():  # [N, capacity // N, ...]: learner i's ring at [i]
            setattr(self, k, torch.zeros(num_learners, self.part, *shape, device=self.device))
        self.writes = torch.zeros(num_learners, dtype=torch.int64)  # rows ever written by each learner

    def add(self, learners, obs, actions, rewards, next_obs, terminated):
        """Rows `[k, ...]`, row j written by learner `learners[j]` (a CPU tensor `[k]`); each learner's rows go to
        the next places of its ring, in order (k may be 0)."""
        mine = nn.functional.one_hot(learners, self.num_learners)  # [k, N]
        rank = (mine.cumsum(0) - 1).gather(1, learners[:, None])[:, 0]  # earlier rows of the same learner
        rows = torch.stack([learners, (self.writes[learners] + rank) % self.part]).to(self.device, non_blocking=True)
        for k, v in zip(self.FIELDS, (obs, actions, rewards, next_obs, terminated)):  # copies without a stream sync
            getattr(self, k)[rows[0], rows[1]] = v.to(self.device, non_blocking=True)
        self.writes += mine.sum(0)

    def sizes(self):
        return self.writes.clamp(max=self.part)

    def sample(self, shape, generator=None):
        """A uniform minibatch of `shape` (e.g. (N, B)) over all rows written so far: (obs, actions, rewards, next_obs,
        terminated) and the index of the learner that wrote each row (on the CPU)."""
        sizes = self.sizes()
        ends = sizes.cumsum(0)
        u = torch.randint(int(ends[-1]), shape, generator=generator)
        writer = torch.searchsorted(ends, u.flatten(), right=True).view(shape)
        rows = torch.stack([writer, u - (ends[writer] - sizes[writer])]).to(self.device, non_blocking=True)
        return tuple(getattr(self, k)[rows[0], rows[1]] for k in self.FIELDS), writer

    def state_dict(self):
        """Every learner's rows and write count, for a checkpoint (on the CPU)."""
        rows = [{k: getattr(self, k)[i, :size].cpu() for k in self.FIELDS} for i, size in enumerate(self.sizes())]
        return [{"writes": int(writes), **part} for writes, part in zip(self.writes, rows)]

    def load_state_dict(self, parts):
        for i, part in enumerate(parts):
            for k in self.FIELDS:
                getattr(self, k)[i, : len(part[k])] = part[k].to(self.device)
            self.writes[i] = part["writes"]


class Learners:
    """The N TD3 learners, parameters stacked (`Linears`): policies, Q-functions, targets, Adam, π_old (each policy
    at the period's start) and the frozen π_b (one network). The summed losses give each learner's parameters its own
    gradient and Adam works element by element, so one update of all N is N independent TD3 updates."""

    def __init__(self, num_learners, obs_dim, action_dim, args: Args, device="cpu", generator=None):
        self.args, self.device, self.generator, self.num_learners = args, torch.device(device), generator, num_learners
        nets = (args.hidden, num_learners, args.bf16)
        self.actor = Actor(obs_dim, action_dim, *nets).to(self.device)
        self.qf = TwinQ(obs_dim, action_dim, *nets).to(self.device)
        self.actor_target, self.qf_target = copy.deepcopy(self.actor), copy.deepcopy(self.qf)
        self.old_actor = copy.deepcopy(self.actor)  # π_old, each learner's policy at the start of the period
        self.best_actor = Actor(obs_dim, action_dim, args.hidden, bf16=args.bf16).to(self.device)  # π_b, frozen
        self.best_actor.load_state_dict(self.actor.learner_state(0))  # Algorithm 1, line 1: φ_b = φ_i at start
        for frozen in (self.actor_target, self.qf_target, self.best_actor, self.old_actor):
            frozen.requires_grad_(False)
        # fused: one kernel per parameter tensor for the whole population (faster on CPU: docs/p3s_td3.md)
        self.actor_opt = torch.optim.Adam(self.actor.parameters(), lr=args.learning_rate, fused=True)
        self.qf_opt = torch.optim.Adam(self.qf.parameters(), lr=args.learning_rate, fused=True)
        self.updates = 0
        # Σ over the period's policy steps of each learner's D(π_i, π_b) and D(π_i, π_old,i), and their count
        self.period_sums = torch.zeros(2, num_learners, device=self.device)
        self.period_count = 0

    @torch.no_grad()
    def act(self, obs, noise_std):
        """π_i(s) + N(0, σ²), kept in [-1, 1] (Algorithm 1, line 9), for every learner's states `[N, n, obs]`."""
        a = self.actor(obs.to(self.device, non_blocking=True))
        if noise_std > 0:
            a = a + noise_std * torch.randn(a.shape, generator=self.generator, device=self.device)
        return a.clamp(-1.0, 1.0)

    def update(self, batch, beta, guided):
        """One step of every learner's Q-functions (Eq. 83), each on its own minibatch `[N, B, ...]`, and every d-th of
        the policies (Eq. 84, `guided` = 1{i≠b}) and the targets (Eq. 82). Returns each learner's statistics."""
        obs, actions, rewards, next_obs, terminated = (x.to(self.device, non_blocking=True) for x in batch)
        a = self.args
        with torch.no_grad():
            next_pi = self.actor_target(next_obs)
            next_actions = smoothed_target_action(next_pi, a.policy_noise, a.noise_clip, self.generator)
            y = td3_target(rewards, terminated, *self.qf_target(next_obs, next_actions), a.gamma)
        q1, q2 = self.qf(obs, actions)
        qf_loss = critic_loss(q1, q2, y)
        self.qf_opt.zero_grad(set_to_none=True)
        qf_loss.sum().backward()
        self.qf_opt.step()
        self.updates += 1
        stats = {"qf_loss": qf_loss.detach(), "q1_mean": q1.detach().mean(-1)}
        if self.updates % a.policy_delay == 0:
            pi = self.actor(obs)
            with torch.no_grad():  # π_b (one network) on every learner's states
                best = self.best_actor(obs.reshape(1, -1, obs.shape[-1])).reshape(pi.shape)
            self.qf.q1.requires_grad_(False)  # the policy's gradient flows through Q_1, which gets none of its own
            q1_of_pi = self.qf.q1_only(obs, pi)
            self.qf.q1.requires_grad_(True)
            actor_loss, distance = p3s_actor_loss(q1_of_pi, pi, best, beta, guided, a.distance)
            if self.num_learners > 1:  # the terms of D_spread and D_change (Sec. 3.2)
                with torch.no_grad():
                    old = policy_distance(pi.detach(), self.old_actor(obs), a.distance)
                self.period_sums += torch.stack([distance, old])
                self.period_count += 1
            self.actor_opt.zero_grad(set_to_none=True)
            actor_loss.sum().backward()
            self.actor_opt.step()
            soft_update(self.qf_target, self.qf, a.tau)
            soft_update(self.actor_target, self.actor, a.tau)
            stats.update(actor_loss=actor_loss.detach(), guidance_distance=distance)
        return stats

    def period_distances(self):
        """E_s D(π_i, π_b) and E_s D(π_i, π_old,i) per learner (Sec. 3.2), averaged over the period's policy steps, each
        on its own minibatch, as the authors' code does (base.py:240-243, p3s_td3.py:341-347); None before any."""
        return self.period_sums / self.period_count if self.period_count else None

    @torch.no_grad()
    def adopt(self, best):
        """Start a period: π_b ← a frozen copy of learner `best`'s policy; π_old ← every learner's policy now."""
        self.best_actor.load_state_dict(self.actor.learner_state(best))
        self.old_actor.load_state_dict(self.actor.state_dict())
        self.period_sums.zero_()
        self.period_count = 0

    NETS = ("actor", "qf", "actor_target", "qf_target", "best_actor", "old_actor", "actor_opt", "qf_opt")

    def state_dict(self):
        period = {"period_sums": self.period_sums.cpu(), "period_count": self.period_count}
        return {**{k: getattr(self, k).state_dict() for k in self.NETS}, "updates": self.updates, **period}

    def load_state_dict(self, state):
        for k in self.NETS:
            getattr(self, k).load_state_dict(state[k])
        self.period_sums.copy_(state["period_sums"])
        self.updates, self.period_count = state["updates"], state["period_count"]


def greedy_policy(actor, low, high):
    """`evaluate`'s `policy(obs, rewards, first)` of the N noiseless policies of `actor`: learner i plays share i."""
    N, device = actor.net[0].weight.shape[0], actor.net[0].weight.device

    @torch.no_grad()
    def policy(obs, rewards, first):
        obs = torch.from_numpy(flatten_obs(obs)).to(device)
        a = actor(obs.view(N, len(obs) // N, -1)).reshape(len(obs), -1)
        return to_env_action(a.cpu().numpy(), low, high)

    return policy


def evaluate_learners(actor, env_id, episodes, seed, low, high):
    """Sec. 4.1's evaluation: each learner's policy now, `episodes` episodes in envs of its own; each one's mean."""
    N = actor.net[0].weight.shape[0]
    scores = evaluate(lambda num_envs: greedy_policy(actor, low, high), env_id, N * episodes, N * episodes, seed)
    return np.asarray(scores).reshape(N, episodes).mean(1).tolist()


def synchronise(state, args, log, step) -> None:
    """Algorithm 1, lines 24-26: β by Eq. (76) on D_spread and D_change, the non-best learners' mean `period_distances`
    (kept if the period had no policy step); the new best b; π_b copied, π_old started. The selection is a line of
    population.jsonl and its curves."""
    learners, best, beta = state["learners"], state["best"], state["beta"]
    distances = learners.period_distances()
    others = [i for i in range(args.num_learners) if i != best]
    d_spread = d_change = d_search = math.nan
    if distances is not None:
        d_spread, d_change = float(distances[0][others].mean()), float(distances[1][others].mean())
        d_search = max(args.rho * d_change, args.d_min)
        beta = adapt_beta(beta, d_spread, d_change, args.rho, args.d_min)
    new_best = select_best(state["recent"], best)
    learners.adopt(new_best)
    scores = [float(np.mean(r)) if r else math.nan for r in state["recent"]]
    state.update(best=new_best, beta=beta, generation=state["generation"] + 1)
    sync = dict(best=new_best, previous_best=best, beta=beta, d_spread=d_spread, d_change=d_change, scores=scores)
    with open(os.path.join(log.path, "population.jsonl"), "a") as f:
        f.write(json.dumps({"step": step, **sync, "d_search": d_search}) + "\n")
    curves = dict(beta=beta, d_spread=d_spread, d_change=d_change, d_search=d_search, best_learner=new_best)
    log.scalars({f"stats/{k}": v for k, v in curves.items()}, step)
    if any(state["recent"]):
        log.scalars({"charts/best_recent_return": max(s for s in scores if not math.isnan(s))}, step)


# ---------------------------------------------------------------------------------------------------------
# The run: setup, Algorithm 1 for all N learners in lockstep (act, store, update, evaluate, select), the end.


def main(args: Args):
    args, resumed = resume_checkpoint(args.resume, os.path.basename(__file__), Args) if args.resume else (args, None)
    check_args(args)
    N, n, M, R, E = args.num_learners, args.num_envs, args.best_period, args.eval_interval, args.eval_episodes
    device = "cuda" if args.cuda and torch.cuda.is_available() else "cpu"
    method = f"P3S-TD3 with {N} learners" if N > 1 else "TD3 (one learner)"
    delayed = f", rewards delayed by {args.reward_delay}" if args.reward_delay > 1 else ""
    log, stop = RunLog(args, resumed, f"{method} x {n} env(s) on {device}{delayed}"), Stop()
    cores = len(os.sched_getaffinity(0)) if device == "cpu" else 1  # a GPU's kernels need one thread to launch them
    threads = ThreadChoice([args.threads] if args.threads else [cores, 1])
    torch.set_flush_denormal(True)  # Adam's tiny second moments as 0: slow denormals on x86 (docs: "Speed on a CPU")
    envs = make_env(args.env_id, N * n, args.seed, num_threads=min(N * n, len(os.sched_getaffinity(0))))
    obs_dim, action_dim = flat_obs_dim(envs.spec), int(envs.action_space.shape[0])
    low, high = envs.action_space.low.astype(np.float32), envs.action_space.high.astype(np.float32)
    state = training_state(args, obs_dim, action_dim, device, resumed)  # the envs start new episodes
    learners, replay, counts, cpu_generator = (state[k] for k in ("learners", "replay", "counts", "cpu_generator"))
    guided = guided_learners(state, args, device)
    owner = torch.arange(N).repeat_interleave(n)  # the learner of each env: learner i's are the i-th n
    tracker, delayed = EpisodeTracker(N * n), DelayedReward(N * n, args.reward_delay)
    obs = torch.from_numpy(flatten_obs(envs.reset()[0]))
    ended = np.zeros(N * n, bool)  # the last observation ended an episode: the next step is envpool's reset step
    last_t, step, stats, last_eval = args.total_timesteps // (N * n), state["t"] * N * n, {}, ""
    try:
        for t in range(state["t"] + 1, last_t + 1):  # time steps t of Algorithm 1
            state["t"], step = t, t * N * n
            if t <= args.t_initial:  # line 7: uniform random actions
                actions = torch.rand(N * n, action_dim, generator=cpu_generator) * 2.0 - 1.0
            else:  # line 9: π_i(s) + N(0, σ²)
                actions = learners.act(obs.view(N, n, obs_dim), args.exploration_noise).reshape(N * n, -1).cpu()
            next_obs, rewards, term, trunc, info = envs.step(to_env_action(actions.numpy(), low, high))
            next_obs = torch.from_numpy(flatten_obs(next_obs))
            # line 10: (s, a, r, s') into D, not envpool's reset steps; the rewards delayed by f_reward (Sec. 4.2)
            agent_rewards = delayed(rewards, term | trunc, ~ended)
            keep, rewards_t, term_t = (torch.from_numpy(x) for x in (~ended, agent_rewards, term.astype(np.float32)))
            replay.add(*(x[keep] for x in (owner, obs, actions, rewards_t, next_obs, term_t)))
            counts["rewarded"] += torch.bincount(owner[keep], torch.from_numpy(agent_rewards != 0)[keep].float(), N)
            for env, score, length in tracker.step(info["env_id"], rewards, term, trunc, info):
                state["recent"][env // n].append(score)
                log.episode(score, length, step, f"learner_{env // n}")
            ended, obs = term | trunc, next_obs
            learning = learn(state, args, guided, stats, threads)  # lines 13-22
            if E and (R and step // R > (step - N * n) // R or t == last_t):  # every R_eval steps, the end (Sec. 4.1)
                state["means"] = evaluate_learners(learners.actor, args.env_id, E, args.seed + 10_000, low, high)
                last_eval = log_evaluation(log, step, state["means"])
            if t % M == 0 and N > 1 and learning:  # lines 24-26: every M steps
                synchronise(state, args, log, step)
                guided = guided_learners(state, args, device)
            if (stopping := stop.requested) or log.save_due() or t == last_t:  # one read of the flag: saved, stopped
                save(log, state)
            if stopping:
                exit_stopped(log, step)
            if log.due():
                log_learners(log, step, state, stats, guided, last_eval)
    except NonFiniteError as e:
        exit_failed(e, log.path)
    if args.capture_video:  # one episode of the best policy
        model = saved_model(args, state, step)
        evaluate(lambda k: make_eval_policy(model, k), args.env_id, 1, 1, args.seed + 10_000, log.path)
    log.console(step)
    log.end(step, max(state["means"], default=None), **summary(log, state))


def guided_learners(state, args, device):
    """1{i≠b} of the policy loss: none before the first selection (the authors' code) but with --guide-first-period."""
    before = state["generation"] == 0 and not args.guide_first_period
    return (torch.arange(args.num_learners, device=device) != state["best"]) & (args.num_learners > 1) & (not before)


def learn(state, args, guided, stats, threads) -> bool:
    """Algorithm 1, lines 13-22, each update on a fresh minibatch: once D holds `learning_starts` rows (the authors'
    code, base.py:118-123) or, with 0, after the random phase (the text). Returns whether they have started."""
    N, replay, counts, starts = args.num_learners, state["replay"], state["counts"], args.learning_starts
    learning = int(replay.sizes().sum()) >= starts if starts > 0 else state["t"] > args.t_initial
    started = time.perf_counter()
    for _ in range(args.num_envs * args.updates_per_step if learning else 0):
        batch, writers = replay.sample((N, args.batch_size), state["cpu_generator"])
        counts["foreign"] += (writers != torch.arange(N)[:, None]).sum(1)
        stats.update(state["learners"].update(batch, state["beta"], guided))
    if learning:  # one host sync for the step's updates; `save` checks the networks before a checkpoint
        check_finite(f"at update {state['learners'].updates}", **stats)
        threads.record(time.perf_counter() - started, started)
    return learning


def training_state(args, obs_dim, action_dim, device, resumed) -> dict:
    """The training state (Algorithm 1, lines 1-2), built here or loaded from `--resume`'s checkpoint."""
    torch.manual_seed(args.seed)  # the same initial weights for every learner (Algorithm 1, line 1)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    N, generator = args.num_learners, torch.Generator(device=device).manual_seed(args.seed + 1)  # acting, smoothing
    state = dict(learners=Learners(N, obs_dim, action_dim, args, device, generator))
    state.update(replay=SharedReplay(args.buffer_size, N, obs_dim, action_dim, device), recent=[[] for _ in range(N)])
    state.update(t=0, best=0, beta=args.beta_init, generation=0, means=[], generator=generator)
    state["counts"] = {k: torch.zeros(N, dtype=torch.float64) for k in ("foreign", "rewarded")}  # rows per learner
    state["cpu_generator"] = torch.Generator().manual_seed(args.seed + 1)  # random actions, minibatches
    load_state(state, {"means": [], **resumed} if resumed else None)  # older checkpoints: no evaluation kept
    state["recent"] = [deque(r, maxlen=args.recent_episodes) for r in state["recent"]]
    return state


def save(log, state) -> None:
    """checkpoint.pt: the training state, its networks found finite; model.pt with --save-model."""
    step, saved = state["t"] * log.args.num_learners * log.args.num_envs, state_dicts(state)
    check_finite(f"at step {step}", **{f"{n}.{k}": v for n in ("actor", "qf") for k, v in saved["learners"][n].items()})
    model = saved_model(log.args, state, step) if log.args.save_model else None
    log.save(step, {**saved, "recent": [list(r) for r in state["recent"]]}, model)


def log_learners(log, step, state, stats, guided, last_eval) -> None:
    """Every --log-interval seconds: the console line and every learner's statistics."""
    N, counts = log.args.num_learners, state["counts"]
    selected = f"best {state['best']} | beta {state['beta']:.3g}" if N > 1 else ""
    log.console(step, " | ".join(filter(None, (selected, last_eval))))
    foreign = counts["foreign"] / max(state["learners"].updates * log.args.batch_size, 1)  # of the rows it sampled
    extra = dict(beta=torch.full((N,), state["beta"]), guided=guided.float(), foreign_sample_fraction=foreign)
    for k, values in {**stats, **extra}.items():  # a value per learner
        group = "losses" if k.endswith("loss") else "stats"
        log.scalars({f"{group}/learner_{i}/{k}": v for i, v in enumerate(values.tolist())}, step)


def summary(log, state) -> dict:
    """summary.json's own entries: per learner, its last evaluation and training returns, its updates and samples."""
    N, counts = log.args.num_learners, state["counts"]
    last_10 = [float(np.mean(g[-10:])) if g else None for g in (log.groups.get(f"learner_{i}") for i in range(N))]
    foreign = counts["foreign"] / max(state["learners"].updates * log.args.batch_size, 1)
    out = dict(num_learners=N, eval_mean_return_per_learner=state["means"])
    out.update(mean_episodic_return_last_10_per_learner=last_10, best_learner=state["best"], beta=state["beta"])
    out.update(updates_per_learner=[state["learners"].updates] * N, foreign_sample_fraction=foreign.tolist())
    return dict(out, rewarded_fraction=(counts["rewarded"] / state["replay"].writes.clamp(min=1)).tolist())


def make_eval_policy(checkpoint, num_envs, device="cpu", greedy=True):
    """`policy(obs, rewards, first) -> actions` of a saved model (evaluate.py plays it): the best learner's policy,
    `checkpoint["actor"]`, without noise (TD3 evaluates so: `greedy` changes nothing)."""
    actor = Actor(**checkpoint["actor_config"]).to(device)
    actor.load_state_dict(checkpoint["actor"])
    return greedy_policy(actor, np.asarray(checkpoint["action_low"]), np.asarray(checkpoint["action_high"]))


def check_args(args) -> None:
    """Bad input: one clear line before any work (UsageError)."""
    env_spec(args.env_id, discrete=False)
    at_least_1 = "num_learners num_envs updates_per_step best_period recent_episodes batch_size policy_delay"
    require_in("[1, inf)", args, at_least_1)
    at_least_0 = "threads t_initial learning_starts d_min reward_delay exploration_noise policy_noise noise_clip"
    require_in("[0, inf)", args, at_least_0 + " eval_episodes eval_interval")
    require_in("(0, inf)", args, "learning_rate rho")
    require_in("[0.001, 1000]", args, "beta_init")  # β's bounds
    require_in("(0, 1]", args, "tau")
    require_in("[0, 1]", args, "gamma")
    require(args.hidden and min(args.hidden) >= 1, f"--hidden needs positive layer sizes, got {args.hidden}")
    rows = args.batch_size * args.num_learners  # each learner's share of D holds a minibatch at least
    require(args.buffer_size >= rows, f"--buffer-size {args.buffer_size}: at least --batch-size x learners, {rows}")
    first = args.learning_starts or args.num_learners * args.num_envs * args.t_initial  # the step of the first update
    ends = f"--total-timesteps {args.total_timesteps} ends before the first update at step {first}"
    require(args.total_timesteps > first, f"{ends}: give more, or a smaller --t-initial or --learning-starts")
    if args.capture_video:
        check_render(args.env_id)


def saved_model(args, state, step):
    """model.pt: every learner's policy and, as `actor` (played by evaluate.py), the last evaluation's best, else b."""
    learners, box = state["learners"], env_spec(args.env_id).action_space
    best = int(np.argmax(state["means"])) if state["means"] else state["best"]
    actors = [learners.actor.learner_state(i) for i in range(args.num_learners)]
    model = dict(script="p3s_td3", env_id=args.env_id, args=dataclasses.asdict(args))
    model.update(actor_config=learners.actor.config, actor=actors[best], actors=actors, best_learner=best)
    low, high = box.low.astype(np.float32).tolist(), box.high.astype(np.float32).tolist()
    return {**model, "global_step": step, "action_low": low, "action_high": high}


def log_evaluation(log, step, means) -> str:
    """An evaluation: evaluations.jsonl, each learner's curve, the score (the best mean) and its console text."""
    with open(os.path.join(log.path, "evaluations.jsonl"), "a") as f:
        f.write(json.dumps({"step": step, "eval_return": max(means), "per_learner": means}) + "\n")
    log.scalars({f"charts/learner_{i}/eval_return": m for i, m in enumerate(means)}, step)
    log.scalars({"charts/eval_return": max(means)}, step)
    return f"eval {max(means):.1f} at {step}"


# ---------------------------------------------------------------------------------------------------------
# Speed on a CPU, not the paper's: the updates' thread count, chosen by timing them (docs/p3s_td3.md).


class ThreadChoice:
    """torch's thread count for the updates on a CPU, the faster per time step of `options` (the cores, 1) as the run
    goes: each timed for `window` seconds, the other again every `every` seconds. Alone on the machine the cores are
    faster; beside other busy processes each kernel waits for its slowest thread, and one is (docs/p3s_td3.md)."""

    def __init__(self, options, window=3.0, every=60.0):
        self.options, self.window, self.every = list(dict.fromkeys(options)), window, every
        self.per_step, self.spent, self.steps, self.tried = {}, 0.0, 0, 0.0
        torch.set_num_threads(self.options[0])

    def record(self, seconds, now) -> None:  # a time step's updates took `seconds`, from `now` (time.perf_counter)
        self.spent, self.steps = self.spent + seconds, self.steps + 1
        if len(self.options) == 1 or self.spent < self.window:
            return
        current = torch.get_num_threads()
        self.per_step[current], self.spent, self.steps = self.spent / self.steps, 0.0, 0
        other = self.options[1 - self.options.index(current)]
        if other not in self.per_step or now - self.tried >= self.every:
            choice, self.tried = other, now  # time the other choice (again)
        else:
            choice = min(self.options, key=self.per_step.get)
        torch.set_num_threads(choice)


# ---------------------------------------------------------------------------------------------------------
# The run machinery: one text, copied verbatim into every script that needs it (tests/test_common.py checks that
# the copies are identical). Besides its arguments it reads the script's own `Args` (and `args.network` where there
# is one), `defaults_for`, `main`, `make_eval_policy`, `act` and `__file__`, by name.


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
