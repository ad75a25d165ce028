"""IMPALA with V-trace.

Espeholt, Soyer, Munos, Simonyan, Mnih, Ward, Doron, Firoiu, Harley, Dunning, Legg, Kavukcuoglu (2018),
"IMPALA: Scalable Distributed Deep-RL with Importance Weighted Actor-Learner Architectures".

Actors step many environments with a copy of the policy that may be several learner updates old and send
whole unrolls, with the behaviour policy's logits, to a learner that trains on batches of them. V-trace
corrects for the lag: its value targets use truncated importance weights ρ_t = min(ρ̄, π/μ) and
c_t = λ min(c̄, π/μ), and the policy gradient uses ρ_t (r_t + γ v_{t+1} − V(x_t)).

| paper                                                         | here                                     |
|---------------------------------------------------------------|------------------------------------------|
| Eq. (1) V-trace target v_s; Remark 1 (recursion); Remark 2 (λ) | `vtrace` -> vs                           |
| Sec. 4.2 policy gradient ρ_s ∇log π (r_s + γ v_{s+1} − V(x_s)) | `vtrace` -> pg_advantages, `learner_loss` |
| Sec. 4.2 value loss (v_s − V(x_s))², entropy bonus             | `learner_loss`                            |
| Fig. 1, Sec. 3: actors send unrolls + μ, learner batches       | `act`, common/actor_pool.py               |
| Fig. 3: shallow / deep (ResNet) agent, optional LSTM           | `Agent` (parts in common/networks.py)     |
| Table G.1 Atari hyperparameters                                | `Args` defaults                           |
| Sec. 5.3 multi-task Atari (one agent, 57 games); PopArt-IMPALA | `--env-ids`, `--popart` (common/popart.py) |

Losses are *summed* over time and batch, as in the paper (Table D.1 note) and its reference code, with the
value loss baseline_cost · ½ Σ (v_s − V(x_s))²; the learning rate, entropy and baseline costs are the
paper's for that choice.

Two choices outside the paper, both measured on Breakout-v5 (README, "Atari on two cores"):
- Initialisation (`--init`): orthogonal with gain √2 and zero biases, policy readout gain 0.01, value readout 1
  (CleanRL, Cleanba). With PyTorch's default the shallow torso's features barely differ between Atari frames
  (logits spread across states ~7e-4), whatever the policy first learns is a per-action bias, and the entropy
  cost pulls it back: the policy stays at ln |A|. `stats/logits_std_across_states` and `stats/dead_units` show it.
- Optimiser (`--optimizer`): PyTorch's RMSProp (mean square from 0, ε outside the square root), as Cleanba runs
  IMPALA. The paper's code ran TensorFlow's (mean square from 1, ε inside the root: `RMSpropTF`, kept as an
  option); its first few hundred steps are about lr·g, a warm-up that left the policy state-blind for 200k steps
  of a 400k-step run.
Without a GPU (no CUDA device, or `--no-cuda`) the Atari family takes four times Table G.1's learning rate, 2.4e-3,
chosen on Breakout-v5 at 1M steps (README, "Atari on two cores"); with a GPU it runs Table G.1 as it is.
`--optimizer adam` (RLlib's optimiser) is there for comparison.
The learning rate anneals linearly to 0 over the paper's 200M frames (50M steps) on Atari whatever the run's
length (`--lr-anneal-steps`), so that a short run has the paper's learning rate at every step: annealed over its
own 1M steps instead, a Breakout run had half the average learning rate and half the return at 750k steps.

envpool resets an environment on the step *after* an episode ends (that step ignores the action and gives
reward 0). Such a step is no transition: it gets no gradient, and V-trace gets discount 0 and reward V(x_k)
there, so that its target is exactly V(x_k) and nothing crosses from one episode into the next. A time-limit
truncation therefore bootstraps from the value of the last observation; only termination (or, for Atari in
training, a lost life) has discount 0.

Multi-task (`--env-ids Pong-v5 Breakout-v5 ...`, or a preset: `atari57`, `atari5`): one agent, one set of weights,
all games at once, as in Sec. 5.3. Actor a plays game a mod G (so `--num-actors` is a multiple of the number
of games G: every game gets the same share of the actors and envs), every game with the full set of 18 Atari
actions, and each unroll carries its game's task id. The policy does not see the task id; the value does:
with PopArt (Hessel et al. 2019, "Multi-task deep reinforcement learning with PopArt"; on by default in
multi-task mode, `--popart on|off`) the value head has one normalised output per game and per-game statistics
μ, σ of the V-trace targets. V-trace runs on unnormalised values σ n + μ; the value loss is taken in normalised
space, ½((v_s − μ)/σ − n(x_s))², and the policy-gradient advantage is divided by σ, so that every game weighs the
same in the update whatever its reward scale. The statistics move after each gradient step toward the batch's
V-trace targets (outputs preserved).

Processes: each learner process (one, or K under torchrun with gradient averaging by DDP) starts
`--num-actors` actor processes. Actors write unrolls into shared-memory slots and pass slot numbers
through queues; the learner publishes its weights to shared memory after every update. Acting and
learning overlap; the lag is logged as `stats/policy_lag`. A dead actor ends the run with its traceback; an
actor whose learner died exits by itself.

    python impala_vtrace.py --env-id Breakout-v5
    torchrun --nproc_per_node 2 impala_vtrace.py --env-id Pong-v5 --network deep --use-lstm
"""

from __future__ import annotations

import dataclasses
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
from common.networks import (
    LSTMCore,
    check_channels,
    PolicyValueHeads,
    grad_norms_by_layer,
    init_output_,
    init_weights_,
    make_torso,
)
from common.popart import PopArt
from common.processes import WorkerError
from common.run import (
    Interrupt,
    RunLog,
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
    """several Atari games at once, one agent (Sec. 5.3), or a preset: atari57, atari5; replaces --env-id"""
    preset: Literal["family", "paper"] = "family"
    """family: the defaults of the env id's task family (FAMILY_DEFAULTS; Atari: the paper's); paper: the paper's
    settings (the defaults below) for every task"""
    popart: Literal["auto", "on", "off"] = "auto"
    """PopArt value normalisation, one value output and statistics per game (PopArt-IMPALA, Hessel et al. 2019);
    auto: on with --env-ids, off for one game"""
    popart_beta: float = 3e-4
    """PopArt statistics step size (Hessel et al. 2019)"""
    exp_name: str = "impala_vtrace"
    """name of this experiment, part of the run folder's name"""
    seed: int = 1
    """seed of torch, numpy and the environments (actor a of learner r uses seed + 1000 r + a)"""
    torch_deterministic: bool = True
    """torch.backends.cudnn.deterministic"""
    cuda: bool = True
    """learner and actors' inference on the GPU when there is one"""
    total_timesteps: int = 50_000_000
    """environment steps in all (200M frames at action repeat 4, Sec. 5.3 / Table C.1)"""
    num_envs: int = 32
    """environments per learner process, split evenly over its actors"""
    env_batch_size: int = 0
    """envs returned per envpool step (async when below envs per actor); 0: half of each actor's envs"""
    num_actors: int = 1
    """actor processes per learner process"""
    unroll_length: int = 20
    """n, unroll length (Table G.1)"""
    batch_size: int = 32
    """unrolls per learner batch, over all learner processes (Table G.1)"""
    learning_rate: float = 6e-4
    """learning rate (Table G.1)"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to 0 over training (Table G.1)"""
    lr_anneal_steps: int = 0
    """steps over which the learning rate anneals to 0; 0: Atari 50M (the paper's 200M frames, Table G.1, so that a
    shorter run has the paper's learning rate at every step), other tasks the run's own length; at least the run"""
    optimizer: Literal["rmsprop_torch", "rmsprop_tf", "rmsprop_optax", "adam"] = "rmsprop_torch"
    """rmsprop_tf: RMSProp with ε inside the square root and the mean square starting at 1, as TensorFlow (the
    paper's code) computes it; rmsprop_optax: ε inside the root, mean square from 0 (optax, as Cleanba runs it);
    rmsprop_torch: torch.optim.RMSprop (mean square from 0, ε outside the root); adam: torch.optim.Adam
    (`--adam-eps`)"""
    adam_eps: float = 1e-8
    """Adam ε (with --optimizer adam)"""
    rmsprop_decay: float = 0.99
    """RMSProp decay (the paper's code default; Table G.1 gives momentum and ε)"""
    rmsprop_eps: float = 0.01
    """RMSProp ε (Table G.1)"""
    rmsprop_momentum: float = 0.0
    """RMSProp momentum (Table G.1)"""
    max_grad_norm: float = 40.0
    """global gradient-norm clipping threshold (Table G.1)"""
    gamma: float = 0.99
    """γ, discount (Table G.1)"""
    baseline_cost: float = 0.5
    """baseline loss scaling (Table G.1)"""
    entropy_cost: float = 0.01
    """entropy regulariser (Table G.1)"""
    clip_rho_threshold: float = 1.0
    """ρ̄, truncation of ρ_t in the V-trace target (Sec. 5.2.2)"""
    clip_pg_rho_threshold: float = 1.0
    """ρ̄ of the policy-gradient importance weight (Sec. 4.2, 5.2.2)"""
    clip_c_threshold: float = 1.0
    """c̄, truncation of the trace coefficients c_i (Sec. 5.2.2)"""
    vtrace_lambda: float = 1.0
    """λ of Remark 2 (1: plain V-trace)"""
    network: Literal["shallow", "deep"] = "shallow"
    """torso for pixels: shallow (Fig. 3 left) or deep ResNet (Fig. 3 right); vectors get an MLP"""
    channels: tuple[int, ...] = ()
    """conv channels; empty: (16, 32) shallow, (16, 32, 32) deep (Fig. 3)"""
    use_lstm: bool = False
    """LSTM core fed the previous action and reward (Fig. 3; the paper's Atari agents are feed-forward)"""
    lstm_size: int = 256
    """LSTM hidden units (Fig. 3)"""
    mlp_hidden: tuple[int, ...] = (64, 64)
    """hidden layers of the MLP torso for vector observations"""
    init: Literal["orthogonal", "sonnet", "torch"] = "orthogonal"
    """weight initialisation (the paper gives none): orthogonal, gain √2 with a 0.01 policy readout (CleanRL);
    sonnet, truncated normal σ = 1/√fan_in and zero biases as in the paper's code; torch, PyTorch's defaults"""
    save_model: bool = False
    """write model.pt (weights and what evaluation needs) in the run folder"""
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
    """seconds between checkpoints (runs/<run>/checkpoint.pt: weights, optimiser, PopArt, counters; written
    atomically); also written at the end and on Ctrl-C; 0: only then"""
    resume: str = ""
    """a run folder to continue from its checkpoint, with its own arguments; curves continue in its folder"""


# Defaults by task family (common/families.py); a flag on the command line wins. Atari runs the paper's settings
# (the Args defaults above). Classic control: measured on CartPole-v1, seeds 1-3 (README, "Defaults by task
# family"); the paper's settings are for 50M Atari steps and learn CartPole far more slowly.
FAMILY_DEFAULTS = {
    "atari": ("the paper's Atari settings (Table G.1)", {}),
    "atari_cpu": ("the CPU Atari settings measured on Breakout-v5 (README)", dict(learning_rate=2.4e-3)),
    "classic": (
        "settings measured on CartPole-v1 (README)",
        dict(total_timesteps=300_000, num_envs=16, batch_size=8, learning_rate=3e-3, baseline_cost=0.1),
    ),
}


# ---------------------------------------------------------------------------------------------------------
# The paper's math: pure functions of time-major [T, B] tensors.


@torch.no_grad()
def vtrace(
    log_rhos,
    discounts,
    rewards,
    values,
    bootstrap_value,
    clip_rho_threshold=1.0,
    clip_pg_rho_threshold=1.0,
    clip_c_threshold=1.0,
    lambda_=1.0,
):
    """V-trace targets v_s (Eq. 1 via Remark 1, with λ of Remark 2) and policy-gradient advantages
    ρ_s (r_s + γ_s v_{s+1} − V(x_s)) (Sec. 4.2).

    log_rhos = log π(a_t|x_t) − log μ(a_t|x_t), discounts = γ (1 − done_t), rewards and values `[T, B]`;
    bootstrap_value = V(x_T) `[B]`. A threshold of None means no truncation. Returns (vs, pg_advantages).
    """
    rhos = torch.exp(log_rhos)
    clipped_rhos = rhos if clip_rho_threshold is None else rhos.clamp(max=clip_rho_threshold)
    cs = lambda_ * (rhos if clip_c_threshold is None else rhos.clamp(max=clip_c_threshold))
    values_tp1 = torch.cat([values[1:], bootstrap_value.unsqueeze(0)])
    deltas = clipped_rhos * (rewards + discounts * values_tp1 - values)
    acc = torch.zeros_like(bootstrap_value)
    vs_minus_v = []
    for t in reversed(range(values.shape[0])):  # v_s − V(x_s) = δ_s + γ_s c_s (v_{s+1} − V(x_{s+1}))
        acc = deltas[t] + discounts[t] * cs[t] * acc
        vs_minus_v.append(acc)
    vs = values + torch.stack(vs_minus_v[::-1])
    vs_tp1 = torch.cat([vs[1:], bootstrap_value.unsqueeze(0)])
    pg_rhos = rhos if clip_pg_rho_threshold is None else rhos.clamp(max=clip_pg_rho_threshold)
    return vs, pg_rhos * (rewards + discounts * vs_tp1 - values)


class VtraceLoss(NamedTuple):
    """learner_loss's result: the loss and its three parts (sums over time and batch), diagnostics (means over the
    real steps) and the unnormalised V-trace targets v_s `[T, B]` (PopArt's update takes them)."""

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
    logits,
    values,
    actions,
    behaviour_logits,
    rewards,
    terminated,
    ended,
    gamma,
    baseline_cost=0.5,
    entropy_cost=0.01,
    clip_rho_threshold=1.0,
    clip_pg_rho_threshold=1.0,
    clip_c_threshold=1.0,
    vtrace_lambda=1.0,
    task=None,
    popart_mu=None,
    popart_sigma=None,
) -> VtraceLoss:
    """The V-trace actor-critic loss (Sec. 4.2), summed over time and batch.

    Rows 0..T of the unrolls, `[T+1, B]` (`logits`, `behaviour_logits` `[T+1, B, A]`); row T only bootstraps.
    Row k holds x_k, the reward and end flags that came with it (`rewards`, `terminated`, and `ended`: x_k ended
    an episode, so step k is envpool's reset step), the action taken at x_k and μ's logits there; transition k
    goes from row k to row k+1. With PopArt (`task` `[T+1, B]` and the per-task statistics `popart_mu`,
    `popart_sigma`), `values` are the normalised outputs `[T+1, B, num_tasks]`: each row reads its task's output
    n, V = σ n + μ enters V-trace, the value loss is ½((v_s − μ)/σ − n)² and the policy-gradient advantage is
    divided by σ (PopArt-IMPALA).
    """
    if task is not None:
        values = values.gather(-1, task.unsqueeze(-1)).squeeze(-1)
        mu, sigma = popart_mu[task], popart_sigma[task]
    else:
        mu, sigma = torch.zeros_like(values), torch.ones_like(values)
    logp_all = F.log_softmax(logits[:-1], dim=-1)
    actions = actions[:-1].unsqueeze(-1)
    logp = logp_all.gather(-1, actions).squeeze(-1)
    behaviour_logp = F.log_softmax(behaviour_logits[:-1], dim=-1).gather(-1, actions).squeeze(-1)
    log_rhos = logp.detach() - behaviour_logp

    v = values.detach() * sigma + mu  # unnormalised values
    reset_step = ended[:-1]  # row k ended an episode: step k is envpool's reset step
    discounts = torch.where(reset_step, 0.0, gamma * (~terminated[1:]).float())
    rewards = torch.where(reset_step, v[:-1], rewards[1:])  # zero TD error: v_k = V(x_k)
    vs, pg_adv = vtrace(
        log_rhos,
        discounts,
        rewards,
        v[:-1],
        v[-1],
        clip_rho_threshold,
        clip_pg_rho_threshold,
        clip_c_threshold,
        vtrace_lambda,
    )
    mask = (~reset_step).float()
    pg_loss = -(mask * pg_adv / sigma[:-1] * logp).sum()
    baseline_loss = baseline_cost * 0.5 * (mask * ((vs - mu[:-1]) / sigma[:-1] - values[:-1]) ** 2).sum()
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    entropy_loss = -entropy_cost * (mask * entropy).sum()
    n = mask.sum().clamp(min=1)
    rhos = log_rhos.exp()
    return VtraceLoss(
        loss=pg_loss + baseline_loss + entropy_loss,
        policy_loss=pg_loss,
        value_loss=baseline_loss,
        entropy_loss=entropy_loss,
        entropy=(mask * entropy).sum() / n,
        rho_mean=(mask * rhos).sum() / n,
        rho_clipped_fraction=(mask * (rhos > clip_rho_threshold)).sum() / n,
        value_mean=(mask * v[:-1]).sum() / n,
        vs=vs,
    )


def batch_loss(logits, values, batch, args, popart=None) -> VtraceLoss:
    """learner_loss on a batch of unrolls with the run's hyperparameters."""
    return learner_loss(
        logits,
        values,
        batch["action"],
        batch["logits"],
        batch["reward"],
        batch["terminated"],
        batch["ended"],
        args.gamma,
        args.baseline_cost,
        args.entropy_cost,
        args.clip_rho_threshold,
        args.clip_pg_rho_threshold,
        args.clip_c_threshold,
        args.vtrace_lambda,
        *((batch["task"], popart.mu, popart.sigma) if popart is not None else ()),
    )


class RMSpropTF(torch.optim.Optimizer):
    """RMSProp as TensorFlow computes it, which the paper's code used (Table G.1's decay, ε and momentum):

        ms  ← ρ ms + (1 − ρ) g²          ms starts at `initial_scale` (TensorFlow: 1; optax: 0)
        mom ← μ mom + lr g / √(ms + ε)   ε inside the square root
        θ   ← θ − mom

    torch.optim.RMSprop starts ms at 0 and adds ε outside the root, so its first steps are about lr/√(1 − ρ) =
    10·lr on every weight whose gradient is well above ε, however small. With ε inside the root a step is at
    most lr·g/√ε = 10·lr·g. Starting ms at 1 makes the first steps about lr·g, growing to the usual lr·g/√E[g²] as
    ms forgets its start (a warm-up over a few times 1/(1 − ρ) = 100 updates).
    """

    def __init__(self, params, lr=6e-4, alpha=0.99, eps=0.01, momentum=0.0, initial_scale=1.0):
        super().__init__(params, dict(lr=lr, alpha=alpha, eps=eps, momentum=momentum, initial_scale=initial_scale))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["square_avg"] = torch.full_like(p, group["initial_scale"])
                    state["momentum_buffer"] = torch.zeros_like(p)
                ms, mom = state["square_avg"], state["momentum_buffer"]
                ms.mul_(group["alpha"]).addcmul_(p.grad, p.grad, value=1 - group["alpha"])
                mom.mul_(group["momentum"]).addcdiv_(p.grad, (ms + group["eps"]).sqrt_(), value=group["lr"])
                p.sub_(mom)


# ---------------------------------------------------------------------------------------------------------
# The agent (Fig. 3).


class Agent(nn.Module):
    """Torso, optional LSTM, a softmax policy and a value: one linear value, or with `popart` a PopArt layer with
    one normalised output per task (`num_tasks`)."""

    def __init__(
        self,
        obs_shape,
        num_actions,
        network="shallow",
        channels=(),
        use_lstm=False,
        lstm_size=256,
        mlp_hidden=(64, 64),
        num_tasks=1,
        popart=False,
        popart_beta=3e-4,
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
            mlp_hidden=tuple(mlp_hidden),
            num_tasks=num_tasks,
            popart=popart,
            popart_beta=popart_beta,
            init=init,
        )
        self.torso = make_torso(obs_shape, network, channels or None, mlp_hidden)
        self.core = LSTMCore(self.torso.out_features, num_actions, lstm_size) if use_lstm else None
        features = self.core.out_features if use_lstm else self.torso.out_features
        if popart:
            self.policy = nn.Linear(features, num_actions)
            self.popart = PopArt(features, num_tasks, popart_beta)
        else:
            self.heads = PolicyValueHeads(features, num_actions)
            self.popart = None
        init_weights_(self, init)
        if init == "orthogonal":
            init_output_(self.heads.policy if self.popart is None else self.policy, 0.01)
            init_output_(self.heads.value if self.popart is None else self.popart.linear, 1.0)

    def initial_state(self, batch_size, device=None):
        return self.core.initial_state(batch_size, device) if self.core is not None else ()

    def forward(self, obs, prev_action, prev_reward, first, state=()):
        """Time-major inputs `[T, B, ...]`; returns logits `[T, B, A]`, values `[T, B]` (with PopArt: normalised,
        `[T, B, num_tasks]`) and the core state."""
        T, B = first.shape
        x = self.torso(obs.reshape(T * B, *obs.shape[2:]))
        if self.core is not None:
            x, state = self.core(x.view(T, B, -1), prev_action, prev_reward, first, state)
        if self.popart is not None:
            return self.policy(x).view(T, B, -1), self.popart(x).view(T, B, -1), state
        logits, values = self.heads(x)
        return logits.view(T, B, -1), values.view(T, B), state


# ---------------------------------------------------------------------------------------------------------
# The run: setup, the paper's loop, the end.


def main(args: Args):
    args, resumed = resume_args(args)
    spec, games = check_args(args)
    multitask = len(games) > 0
    use_popart = args.popart == "on" or (args.popart == "auto" and multitask)
    args = dataclasses.replace(args, env_ids=tuple(games), popart="on" if use_popart else "off")
    rank, world, device = learner_process(args)
    obs_shape = spec.observation_space.shape
    num_actions = 18 if multitask else int(spec.action_space.n)  # the full Atari action set for many games
    atari = is_atari(games[0] if multitask else args.env_id)
    agent = Agent(
        obs_shape,
        num_actions,
        args.network,
        args.channels,
        args.use_lstm,
        args.lstm_size,
        args.mlp_hidden,
        max(1, len(games)),
        use_popart,
        args.popart_beta,
        args.init,
    ).to(device)
    broadcast_parameters(agent.parameters(), world)
    model = agent
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(agent, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = make_optimizer(args, agent.parameters())
    start_update = 0
    if resumed is not None:
        agent.load_state_dict(resumed["agent"])
        optimizer.load_state_dict(resumed["optimizer"])
        start_update = resumed["update"]
    task_name = f"{len(games)}games" if multitask else args.env_id
    log = RunLog(
        args,
        FAMILY_DEFAULTS,
        task_name,
        resumed,
        f"device {device}, {world} learner process(es), {args.num_actors * world} actor process(es), "
        f"{args.num_envs * world} envs{', ' + str(len(games)) + ' games' if multitask else ''}"
        f"{', PopArt' if use_popart else ''}",
        write=rank == 0,
    )
    steps_per_update = args.batch_size * args.unroll_length
    num_updates = args.total_timesteps // steps_per_update
    anneal_steps = args.lr_anneal_steps or (50_000_000 if atari else args.total_timesteps)
    anneal_updates = max(num_updates, anneal_steps // steps_per_update)
    global_step, last_checkpoint = log.start_step, time.time()

    def checkpoint(update):
        if rank == 0:
            check_finite_parameters(f"at update {update}", agent=agent)
            if args.save_model:  # a run stopped early can be evaluated too
                save_model(saved_model(args, agent, games, atari, global_step), log.path)
            state = dict(agent=agent.state_dict(), optimizer=optimizer.state_dict(), update=update)
            save_checkpoint(log.state(global_step, args, **state), log.path)
        return global_step

    # Ctrl-C or SIGTERM: stop at once, dropping the update in progress (the deep network's update on a CPU takes
    # seconds), and save the last completed update's state; only the lines that change the training state (the
    # optimiser step to the weights' publication) finish first.
    interrupt, pool = Interrupt(), None
    update = done_update = start_update
    try:
        specs = recurrent_buffer_specs(spec.observation_space, num_actions, args)
        cfgs = actor_configs(args, rank, device, args.env_ids)
        pool = ActorPool(act, cfgs, agent, specs, args.batch_size // world, device)
        for update in range(start_update + 1, num_updates + 1):
            lr = args.learning_rate * (1 - (update - 1) / anneal_updates) if args.anneal_lr else args.learning_rate
            for g in optimizer.param_groups:
                g["lr"] = lr
            batch = pool.next_batch(  # a progress line also while the batch is being collected
                lambda ready: rank == 0 and log.collecting(global_step, ready, pool.batch_size, args.unroll_length)
            )
            state = (batch["core_h"], batch["core_c"]) if args.use_lstm else ()
            logits, values, _ = model(batch["obs"], batch["prev_action"], batch["reward"], batch["first"], state)
            out = batch_loss(logits, values, batch, args, agent.popart)
            loss, vs, stats = out.loss, out.vs, loss_stats(out)
            optimizer.zero_grad(set_to_none=True)
            (loss * world).backward()  # DDP averages over processes: keep the sum over the global batch
            log_due = rank == 0 and (log.due() or update == num_updates)
            layer_norms = grad_norms_by_layer(agent) if log_due else {}  # before clipping, only when logged
            grad_norm = nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
            where = f"at update {update} (step {update * steps_per_update})"
            check_finite(where, loss=loss, gradient=grad_norm, **{k.split("/")[-1]: v for k, v in stats.items()})
            with interrupt.commit():
                optimizer.step()
                if agent.popart is not None:  # toward this batch's targets, per game; outputs preserved
                    real = ~batch["ended"][:-1]
                    agent.popart.update(vs[real], batch["task"][:-1][real])
                done_update = update
                policy_lag = (pool.version.item() - batch["version"][:-1].float().mean()).item()
                pool.publish(agent.state_dict())
                global_step = update * steps_per_update
                log.first_update(global_step)
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
                stats.update({"charts/learning_rate": lr, "stats/policy_lag": policy_lag, "stats/grad_norm": grad_norm})
                log_learner_stats(
                    log, agent, games or [args.env_id], stats, layer_norms, logits, batch["obs"], global_step
                )
                entropy = stats["stats/entropy"].item()
                log.console(global_step, f"entropy {entropy:.2f} | lag {policy_lag:.1f}")
    except (WorkerError, NonFiniteError) as e:
        learner_failed(e, log.path, pool)
    except KeyboardInterrupt:
        save = (lambda: checkpoint(done_update)) if done_update > start_update else None
        learner_interrupted(pool, interrupt, save, log, os.path.basename(__file__), world)
    pool.close()
    end_time = time.time()
    checkpoint(num_updates)
    if rank == 0:
        log.end(saved_model(args, agent, games, atari, global_step), make_eval_policy, end_time, device, games)
    if world > 1:
        torch.distributed.destroy_process_group()


def make_eval_policy(checkpoint, num_envs, device="cpu", greedy=False):
    """A callable `policy(obs, rewards, first) -> actions` for `common/evaluation.py` (it keeps the LSTM state and
    the previous action itself); rewards are clipped as in training."""
    agent = Agent(**checkpoint["agent_config"]).to(device)
    agent.load_state_dict(checkpoint["agent"])
    return recurrent_policy(agent, num_envs, device, greedy, checkpoint["reward_clip"])


# ---------------------------------------------------------------------------------------------------------
# Acting. Row t of an unroll holds obs_t, the reward and end flags that came with obs_t, the action taken at
# obs_t and its behaviour logits. An unroll has T+1 rows; its last row is the next unroll's first.


def act(actor_id, cfg, link):
    """Fig. 1's actor: steps its envs with the latest published policy μ and writes unrolls with μ's logits
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
    if args.lr_anneal_steps < 0:
        raise UsageError(f"--lr-anneal-steps must be 0 (automatic) or a number of steps, got {args.lr_anneal_steps}")
    check_channels(args.network, args.channels)
    if not 0 < args.popart_beta <= 1:
        raise UsageError(f"--popart-beta must be in (0, 1], got {args.popart_beta}")
    return spec, games


def make_optimizer(args, params):
    """RMSProp as TensorFlow's (ε inside the square root, the mean square starting at 1: `rmsprop_tf`), as optax's
    (starting at 0: `rmsprop_optax`), or PyTorch's (`rmsprop_torch`)."""
    if args.optimizer == "adam":
        return torch.optim.Adam(params, lr=args.learning_rate, eps=args.adam_eps)
    kwargs = dict(lr=args.learning_rate, alpha=args.rmsprop_decay, eps=args.rmsprop_eps, momentum=args.rmsprop_momentum)
    if args.optimizer in ("rmsprop_tf", "rmsprop_optax"):
        return RMSpropTF(params, initial_scale=1.0 if args.optimizer == "rmsprop_tf" else 0.0, **kwargs)
    return torch.optim.RMSprop(params, **kwargs)


def saved_model(args, agent, games, atari, global_step):
    """What model.pt holds (common/evaluation.py plays it)."""
    return {
        "script": "impala_vtrace",
        "env_id": games[0] if games else args.env_id,
        "env_ids": list(games),
        "full_action_space": bool(games),
        "args": dataclasses.asdict(args),
        "agent_config": agent.config,
        "agent": {k: v.cpu() for k, v in agent.state_dict().items()},
        "reward_clip": atari,
        "global_step": global_step,
    }


if __name__ == "__main__":
    cli(Args, main, FAMILY_DEFAULTS)
