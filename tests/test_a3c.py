"""a3c.py: n-step returns and the loss against Algorithm S3, shared RMSProp across processes, the Hogwild
update, the agent, and the script end to end."""

import copy
import dataclasses
import json
import math
import multiprocessing
import os
import queue
import signal

import numpy as np
import pytest
import torch
import torch.nn as nn

import a3c
from a3c import SharedRMSprop, a3c_loss, hogwild_update, n_step_returns
from tests.helpers import assert_every_steps_return_scaled, evaluate_cli, events, events_tags, flags
from tests.helpers import kill_resume_stop, learning_rate_logged, learns, run_script


# --------------------------------------------------------------------------------------------------------
# Math: Algorithm S3 written as plain loops.


def random_rollout(T=7, B=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(T, B, generator=g, dtype=torch.float64)
    terminated = torch.rand(T, B, generator=g) < 0.15
    terminated[2, 0] = True  # an episode end inside the rollout
    reset = torch.zeros(T, B, dtype=torch.bool)
    reset[1:] = terminated[:-1]  # envpool's reset step follows an episode end
    reset[5, 1] = True  # a time-limit truncation at step 4 of env 1: not terminated, next step resets
    terminated[5, 1] = False
    terminated[reset] = False  # a reset step gives reward 0 and never ends an episode
    rewards[reset] = 0.0
    values = torch.randn(T, B, generator=g, dtype=torch.float64)
    bootstrap = torch.randn(B, generator=g, dtype=torch.float64)
    return rewards, terminated, reset, values, bootstrap


def test_n_step_returns_match_plain_sum():
    """R_t = Σ_{k=t}^{T-1} (Π_{i=t}^{k-1} γ_i) r_k + (Π_{i=t}^{T-1} γ_i) V(s_T), summed directly."""
    rewards, terminated, _, _, bootstrap = random_rollout()
    discounts = 0.9 * (~terminated).double()
    T, B = rewards.shape
    expected = torch.zeros(T, B, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            total, coef = 0.0, 1.0
            for k in range(t, T):
                total += coef * float(rewards[k, b])
                coef *= float(discounts[k, b])
            expected[t, b] = total + coef * float(bootstrap[b])
    torch.testing.assert_close(n_step_returns(rewards, discounts, bootstrap), expected)
    assert terminated.any() and expected[2, 0] == rewards[2, 0]  # nothing crosses an episode end


def loss_gradients_reference(rewards, terminated, reset, values, bootstrap, gamma, beta, value_coef):
    """Algorithm S3 per environment: R ← V(s_T); for i = T−1..0: R ← r_i + γR (R ← r_i at a terminal step);
    dθ += ∇log π(a_i|s_i)(R − V(s_i)) + β∇H, dθ_v += value_coef ∂(R − V(s_i))²/∂θ_v. A reset step (envpool's
    step after an episode end) is no transition: it adds nothing, and R restarts from V of its observation (the
    last one of the episode, so a truncated episode bootstraps from it). Returns ∂L/∂log π, ∂L/∂H, ∂L/∂V for the
    loss L = −(objective), averaged over environments."""
    T, B = rewards.shape
    d_logp, d_ent, d_v = (torch.zeros(T, B, dtype=torch.float64) for _ in range(3))
    for b in range(B):
        R = float(bootstrap[b])
        for i in reversed(range(T)):
            if reset[i, b]:
                R = float(values[i, b])
                continue
            R = float(rewards[i, b]) + (0.0 if terminated[i, b] else gamma * R)
            adv = R - float(values[i, b])
            d_logp[i, b] = -adv / B
            d_ent[i, b] = -beta / B
            d_v[i, b] = value_coef * 2 * (float(values[i, b]) - R) / B
    return d_logp, d_ent, d_v


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a3c_loss_gradients_match_algorithm_s3(seed):
    rewards, terminated, reset, values, bootstrap = random_rollout(seed=seed)
    T, B = rewards.shape
    log_probs = torch.randn(T, B, dtype=torch.float64, requires_grad=True)
    entropies = torch.rand(T, B, dtype=torch.float64, requires_grad=True)
    v = values.clone().requires_grad_()
    loss, _ = a3c_loss(log_probs, entropies, v, rewards, terminated, reset, bootstrap, 0.95, 0.01, 0.5)
    loss.backward()
    d_logp, d_ent, d_v = loss_gradients_reference(rewards, terminated, reset, values, bootstrap, 0.95, 0.01, 0.5)
    torch.testing.assert_close(log_probs.grad, d_logp)
    torch.testing.assert_close(entropies.grad, d_ent)
    torch.testing.assert_close(v.grad, d_v)
    assert (log_probs.grad[reset] == 0).all() and (v.grad[reset] == 0).all()


def test_truncation_bootstraps_from_the_last_observation():
    """Env 0 truncated at step 1 (the reset step is 2): the return at step 1 is r_1 + γ V(s_2), s_2 being the
    episode's last observation; after a termination it is r_1 alone."""
    T, B = 4, 2
    rewards = torch.tensor([[1.0, 1.0], [2.0, 2.0], [0.0, 0.0], [1.0, 1.0]])
    reset = torch.tensor([[False, False], [False, False], [True, True], [False, False]])
    terminated = torch.tensor([[False, False], [False, True], [False, False], [False, False]])
    values = torch.tensor([[0.0, 0.0], [0.0, 0.0], [10.0, 10.0], [0.0, 0.0]], requires_grad=True)
    log_probs = torch.zeros(T, B, requires_grad=True)
    loss, _ = a3c_loss(log_probs, torch.zeros(T, B), values, rewards, terminated, reset, torch.zeros(B), 0.5, 0.0, 0.5)
    loss.backward()
    advantages = -log_probs.grad * B  # V = 0 at steps 0, 1: the advantage is the return there
    assert advantages[1, 0] == pytest.approx(2.0 + 0.5 * 10.0) and advantages[1, 1] == pytest.approx(2.0)
    assert advantages[0, 0] == pytest.approx(1.0 + 0.5 * 7.0) and advantages[0, 1] == pytest.approx(2.0)


# --------------------------------------------------------------------------------------------------------
# The value-based methods (Algorithm 1, Sec. 4's Sarsa, Algorithm S2) written as plain loops.


def random_q_rollout(seed=0, A=3):
    rewards, terminated, reset, _, _ = random_rollout(seed=seed)
    T, B = rewards.shape
    g = torch.Generator().manual_seed(100 + seed)
    q_target = torch.randn(T + 1, B, A, generator=g, dtype=torch.float64)  # θ⁻'s values at s_0..s_T
    actions = torch.randint(A, (T + 1, B), generator=g)  # a_0..a_T (a_T: Sarsa's a' at s_T)
    return rewards, terminated, reset, q_target, actions


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("method", ["one-step-q", "one-step-sarsa"])
def test_one_step_targets_match_algorithm_1(seed, method):
    """Algorithm 1 per step: y = r for a terminal s', else r + γ max_a' Q(s', a'; θ⁻); Sarsa (Sec. 4): r + γ
    Q(s', a'; θ⁻), a' the action taken at s'. A step before envpool's reset step (a truncation) bootstraps from
    the episode's last observation; the reset step's own target is not used (no loss there)."""
    rewards, terminated, reset, q_target, actions = random_q_rollout(seed)
    T, B = rewards.shape
    gamma, sarsa = 0.9, method == "one-step-sarsa"
    expected = torch.zeros(T, B, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            nxt = float(q_target[t + 1, b, actions[t + 1, b]]) if sarsa else float(q_target[t + 1, b].max())
            expected[t, b] = float(rewards[t, b]) + (0.0 if terminated[t, b] else gamma * nxt)
    got = a3c.value_targets(method, rewards, terminated, reset, q_target, actions[1:] if sarsa else None, gamma)
    torch.testing.assert_close(got[~reset], expected[~reset])
    direct = a3c.one_step_targets(rewards, gamma * (~terminated).double(), q_target[1:], actions[1:] if sarsa else None)
    torch.testing.assert_close(direct[~reset], expected[~reset])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_n_step_q_targets_match_algorithm_s2(seed):
    """Algorithm S2 per environment: R ← max_a Q(s_T, a; θ⁻) (0 past a terminal state); for i = T−1..0: R ← r_i +
    γR. A reset step is no transition: R restarts there from max_a Q of its observation (the episode's last), so a
    truncated episode bootstraps from it."""
    rewards, terminated, reset, q_target, _ = random_q_rollout(seed)
    T, B = rewards.shape
    gamma = 0.95
    expected = torch.zeros(T, B, dtype=torch.float64)
    for b in range(B):
        R = float(q_target[T, b].max())
        for i in reversed(range(T)):
            if reset[i, b]:
                R = float(q_target[i, b].max())
                continue
            R = float(rewards[i, b]) + (0.0 if terminated[i, b] else gamma * R)
            expected[i, b] = R
    got = a3c.value_targets("n-step-q", rewards, terminated, reset, q_target, None, gamma)
    torch.testing.assert_close(got[~reset], expected[~reset])
    if not terminated[4, 1]:  # a truncation at step 4 of env 1: the bootstrap is θ⁻'s value of s_5, its last state
        assert reset[5, 1] and got[4, 1] == pytest.approx(float(rewards[4, 1]) + gamma * float(q_target[5, 1].max()))


def test_q_loss_gradient_is_the_accumulated_td_gradient():
    """dθ ← dθ + ∂(y − Q(s_i, a_i; θ'))²/∂θ' summed over the rollout (Algorithms 1, S2), averaged over the
    environments; nothing at reset steps; the targets carry no gradient."""
    rewards, terminated, reset, q_target, actions = random_q_rollout(0)
    T, B = rewards.shape
    q_taken = torch.randn(T, B, dtype=torch.float64, requires_grad=True)
    targets = a3c.value_targets("n-step-q", rewards, terminated, reset, q_target, None, 0.99)
    loss, stats = a3c.q_loss(q_taken, targets, reset)
    loss.backward()
    expected = torch.where(reset, 0.0, 2 * (q_taken.detach() - targets) / B)
    torch.testing.assert_close(q_taken.grad, expected)
    assert float(stats["losses/td_loss"]) == pytest.approx(float(((q_taken - targets)[~reset] ** 2).sum() / B))


def test_epsilon_schedule_and_each_workers_final_value():
    """Supp. 8: ε from 1 down to the actor's final value over the annealing steps, then flat; the final value is
    0.1, 0.01 or 0.5 with probabilities 0.4, 0.3, 0.3, drawn for each actor (each environment of a worker);
    ε-greedy takes the greedy action with probability 1 − ε, an ε per row where ε is a tensor."""
    assert a3c.epsilon_at(0, 0.1, 1000) == 1.0 and a3c.epsilon_at(500, 0.1, 1000) == pytest.approx(0.55)
    assert a3c.epsilon_at(1000, 0.01, 1000) == pytest.approx(0.01) and a3c.epsilon_at(5000, 0.5, 1000) == 0.5
    g = torch.Generator().manual_seed(0)
    draws = a3c.final_epsilon(20_000, g)
    for value, p in zip((0.1, 0.01, 0.5), (0.4, 0.3, 0.3)):
        assert float((draws == value).double().mean()) == pytest.approx(p, abs=0.015)
    torch.testing.assert_close(a3c.epsilon_at(500, draws[:3], 1000), 0.5 + 0.5 * draws[:3])  # one ε per actor
    q = torch.tensor([[0.0, 2.0, 1.0]]).expand(20_000, 3)
    torch.manual_seed(0)
    for epsilon in (0.0, 0.3, 1.0):
        counts = torch.bincount(a3c.epsilon_greedy(q, epsilon), minlength=3).double() / len(q)
        expected = torch.tensor([epsilon / 3, 1 - epsilon + epsilon / 3, epsilon / 3], dtype=torch.float64)
        torch.testing.assert_close(counts, expected, atol=0.012, rtol=0)
    per_row = torch.tensor([0.0, 1.0]).repeat(10_000)  # actors greedy and uniform, side by side
    actions = a3c.epsilon_greedy(q, per_row)
    assert (actions[per_row == 0] == 1).all() and float((actions[per_row == 1] != 1).double().mean()) > 0.6


def test_target_network_follows_the_shared_weights_every_i_target_steps():
    """Algorithm 1: θ⁻ ← θ (the observation statistics with it) when the steps of all workers pass a multiple of
    I_target, and not before; the worker's updates move θ meanwhile. One worker, in this process."""
    argv = ["--env-id", "CartPole-v1", "--method", "one-step-q", "--target-update-period", "10", "--num-envs", "1"]
    args = a3c.parse_args([*argv, "--num-workers", "1", "--total-timesteps", "10"])
    args, _ = a3c.check_args(args)
    agent = a3c.Agent((4,), 2, hidden=args.hidden, q_values=True)
    target = copy.deepcopy(agent)
    initial = copy.deepcopy(agent.state_dict())
    optimizer = a3c.SharedRMSprop(agent.parameters(), 1e-2)
    counter, lock, msg_q = multiprocessing.Value("q", 0), multiprocessing.Lock(), queue.Queue()

    def same(a, b):
        return all(torch.equal(a[k], b[k]) for k in a)

    a3c.train_worker(0, dataclasses.replace(args, total_timesteps=5), agent, target, optimizer, counter, lock, msg_q)
    assert counter.value == 5 and same(target.state_dict(), initial) and not same(agent.state_dict(), initial)
    a3c.train_worker(0, args, agent, target, optimizer, counter, lock, msg_q)  # steps 5..10: passes 10
    assert counter.value == 10 and same(target.state_dict(), agent.state_dict())
    assert float(target.obs_norm.count) == float(agent.obs_norm.count) > 0


def test_q_agent_outputs_one_value_per_action():
    """Supp. 8: the value-based methods' network is A3C's body with one linear output per action; `values` is
    max_a Q; the running statistics normalise vector observations as A3C's agent does."""
    agent = a3c.Agent((4,), 2, hidden=16, q_values=True)
    obs, first = torch.randn(3, 5, 4), torch.zeros(3, 5, dtype=torch.bool)
    q, v, state = agent(obs, first)
    assert q.shape == (3, 5, 2) and state == () and torch.equal(v, q.max(-1).values)
    assert agent.obs_norm is not None and a3c.Agent((4, 84, 84), 6, q_values=True).obs_norm is None


# --------------------------------------------------------------------------------------------------------
# Shared RMSProp and the Hogwild update.


def rmsprop_reference(theta, grads, lr, alpha, eps):
    """Eqs. (S2)-(S3) in numpy, g bias-corrected: g = αg + (1 − α)Δθ², θ ← θ − η Δθ / √(g / (1 − α^t) + ε)."""
    g = np.zeros_like(theta)
    for t, d in enumerate(grads, 1):
        g = alpha * g + (1 - alpha) * d * d
        theta = theta - lr * d / np.sqrt(g / (1 - alpha**t) + eps)
    return theta, g


def test_shared_rmsprop_matches_eq_s2_s3():
    p = nn.Parameter(torch.randn(5, 3, dtype=torch.float64))
    theta0 = p.detach().numpy().copy()
    opt = SharedRMSprop([p], lr=0.01, alpha=0.9, eps=0.1)
    grads = [np.random.default_rng(i).normal(size=(5, 3)) * 3 for i in range(4)]
    for d in grads:
        p.grad = torch.as_tensor(d)
        opt.step()
    theta, g = rmsprop_reference(theta0, grads, 0.01, 0.9, 0.1)
    np.testing.assert_allclose(p.detach().numpy(), theta, rtol=1e-12)
    np.testing.assert_allclose(opt.state[p]["square_avg"].numpy(), g, rtol=1e-12)
    assert opt.state[p]["step"].item() == 4


def test_shared_rmsprop_is_adam_without_momentum_where_eps_is_zero():
    """With ε = 0 (where ε inside and outside the root agree) the bias-corrected shared RMSProp is PyTorch's
    Adam(betas=(0, α), eps=0), step for step."""
    torch.manual_seed(0)
    ours, adams = (nn.Parameter(torch.randn(4, 3, dtype=torch.float64)) for _ in range(2))
    adams.data.copy_(ours.data)
    opt, adam = SharedRMSprop([ours], lr=0.01, alpha=0.99, eps=0.0), torch.optim.Adam([adams], 0.01, (0.0, 0.99), 0.0)
    for _ in range(5):
        ours.grad = torch.randn(4, 3, dtype=torch.float64)
        adams.grad = ours.grad.clone()
        opt.step()
        adam.step()
        torch.testing.assert_close(ours.detach(), adams.detach(), rtol=1e-12, atol=1e-12)


def test_shared_rmsprop_first_step_is_of_the_learning_rates_size():
    """The start the correction fixes: with ε = 1e-5 and α = 0.99 the first step moves each weight by η (|Δθ| ≫ √ε),
    not by η/√(1 − α) = 10η as the uncorrected g = (1 − α)Δθ² would."""
    p = nn.Parameter(torch.zeros(1000, dtype=torch.float64))
    opt = SharedRMSprop([p], lr=1e-3, alpha=0.99, eps=1e-5)
    p.grad = torch.randn(1000, dtype=torch.float64)
    opt.step()
    np.testing.assert_allclose(p.detach().abs().median().item(), 1e-3, rtol=0.05)


def _rmsprop_child(model, optimizer, grad, report):
    """One worker: report the statistics it sees, then take one step with `grad` on the shared weights."""
    p = model.weight
    report.put(optimizer.state[p]["square_avg"].numpy().copy())  # by value: the process ends right after
    p.grad = grad
    optimizer.step()


def test_shared_rmsprop_one_set_of_statistics_across_processes():
    """Two processes step one shared optimiser in turn: the second sees the first's g, and the parent sees both
    updates of g and θ, exactly as Eqs. (S2)-(S3) applied twice."""
    ctx = torch.multiprocessing.get_context("spawn")
    model = nn.Linear(4, 3, bias=False).double()
    model.share_memory()
    opt = SharedRMSprop(model.parameters(), lr=0.05, alpha=0.9, eps=0.1).share_memory()
    theta0 = model.weight.detach().numpy().copy()
    grads = [torch.randn(3, 4, dtype=torch.float64) for _ in range(2)]
    report = ctx.Queue()
    seen = []
    for grad in grads:
        proc = ctx.Process(target=_rmsprop_child, args=(model, opt, grad, report))
        proc.start()
        seen.append(report.get(timeout=120))
        proc.join(timeout=120)
        assert proc.exitcode == 0
    theta, g = rmsprop_reference(theta0, [d.numpy() for d in grads], 0.05, 0.9, 0.1)
    assert (seen[0] == 0).all() and opt.state[model.weight]["step"].item() == 2  # t: shared too
    np.testing.assert_allclose(seen[1], 0.1 * grads[0].numpy() ** 2, rtol=1e-12)  # the first's g
    np.testing.assert_allclose(opt.state[model.weight]["square_avg"].numpy(), g, rtol=1e-12)
    np.testing.assert_allclose(model.weight.detach().numpy(), theta, rtol=1e-12)


class RecordingRMSprop(SharedRMSprop):
    """Records the gradients the optimiser applies."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.applied = []

    def step(self, closure=None):
        self.applied.append([p.grad.clone() for g in self.param_groups for p in g["params"]])
        super().step()


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.5])
def test_hogwild_update_applies_the_last_rollouts_gradient(max_grad_norm):
    """The gradient applied to the shared weights is that of the worker's latest rollout (clipped), not a sum
    over its rollouts and not a stale first one (the PyTorch 2 `.grad` pitfall); θ moves by Eq. (S3) with it."""
    torch.manual_seed(0)
    shared = a3c.Agent((4,), num_actions=2)
    local = a3c.Agent((4,), num_actions=2)
    opt = RecordingRMSprop(shared.parameters(), lr=0.01, alpha=0.99, eps=0.1)
    grads = []
    for rollout in range(3):
        local.load_state_dict(shared.state_dict())
        obs = torch.randn(5, 3, 4) * (rollout + 1)
        pi, values, _ = local(obs, torch.zeros(5, 3, dtype=torch.bool))
        loss = (pi**2).sum() + (values * (rollout + 1)).sum()
        expected = torch.autograd.grad(loss, list(local.parameters()), retain_graph=True)
        if max_grad_norm > 0:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(e) for e in expected]))
            expected = [e * min(1.0, max_grad_norm / (float(norm) + 1e-6)) for e in expected]
        before = [p.detach().clone() for p in shared.parameters()]
        square_avg = [opt.state[p]["square_avg"].clone() for p in shared.parameters()]
        hogwild_update(local, shared, opt, loss, max_grad_norm)
        for applied, e in zip(opt.applied[-1], expected):
            torch.testing.assert_close(applied, e)
        for p, p0, g0, e in zip(shared.parameters(), before, square_avg, expected):
            g = 0.99 * g0 + 0.01 * e * e
            torch.testing.assert_close(p.detach(), p0 - 0.01 * e / torch.sqrt(g / (1 - 0.99 ** (rollout + 1)) + 0.1))
        grads.append(expected)
    # the rollouts' gradients differ, so a sum or a stale gradient would have failed the checks above
    assert not torch.allclose(grads[0][0], grads[2][0])
    assert all(p.grad is None for p in shared.parameters())


# --------------------------------------------------------------------------------------------------------
# The agent.


@pytest.mark.parametrize("gaussian", ["paper", "tanh"])
def test_gaussian_policy_log_prob_and_entropy(gaussian):
    """Continuous policy: N(μ, diag σ²), log-probabilities and entropy against torch's MultivariateNormal.
    softplus (the paper's, Supp. 9): one σ² = softplus(·) + 1e-5 of the state for all d dimensions, entropy
    d · ½ (log(2πσ²) + 1). tanh: μ = tanh(linear) within [-1, 1], σ_i = exp(log σ_i), the same in every state,
    starting at exp(−0.5)."""
    torch.manual_seed(0)
    agent = a3c.Agent((6,), action_dim=3, gaussian=gaussian)
    pi, values, _ = agent(torch.randn(4, 5, 6), torch.zeros(4, 5, dtype=torch.bool))
    assert pi.shape == (4, 5, 6) and values.shape == (4, 5)
    mean, std = pi[..., :3], pi[..., 3:]
    actions = agent.sample(pi)
    log_prob, entropy = agent.log_prob_entropy(pi, actions)
    ref = torch.distributions.MultivariateNormal(mean, covariance_matrix=torch.diag_embed(std**2))
    torch.testing.assert_close(log_prob, ref.log_prob(actions), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, ref.entropy(), rtol=1e-5, atol=1e-5)
    if gaussian == "paper":
        torch.testing.assert_close(std, std[..., :1].expand_as(std))  # spherical
        torch.testing.assert_close(entropy, 3 * 0.5 * (torch.log(2 * math.pi * std[..., 0] ** 2) + 1))
        first = torch.zeros(1, 1, dtype=torch.bool)
        raw = agent.policy(agent.body(agent.obs_norm(torch.zeros(1, 1, 6)), first, None)[0])[..., 3]
        torch.testing.assert_close(
            agent(torch.zeros(1, 1, 6), first)[0][..., 3] ** 2, nn.functional.softplus(raw) + 1e-5
        )
    else:
        torch.testing.assert_close(std, torch.full_like(std, math.exp(-0.5)))  # the same in every state
        with torch.no_grad():
            agent.log_std.copy_(torch.tensor([-1.0, 0.0, 0.5]))
        std = agent(torch.randn(2, 3, 6), torch.zeros(2, 3, dtype=torch.bool))[0][..., 3:]
        torch.testing.assert_close(std, torch.tensor([-1.0, 0.0, 0.5]).exp().expand(2, 3, 3))
        assert agent.policy.weight.abs().max() < 0.05  # the mean layer ×0.01: μ ≈ 0 at the start
        with torch.no_grad():
            agent.policy.bias.copy_(torch.tensor([-50.0, 0.3, 50.0]))
        first = torch.zeros(1, 1, dtype=torch.bool)
        torch.testing.assert_close(
            agent(torch.zeros(1, 1, 6), first)[0][0, 0, :3],
            torch.tanh(torch.tensor([-50.0, 0.3, 50.0])),
            atol=0.02,
            rtol=0,
        )


@pytest.mark.parametrize("actions", [dict(action_dim=2), dict(num_actions=3)])
def test_vector_policy_and_value_share_no_parameters(actions):
    """Supp. 9: the policy and value networks share no parameters: the value loss moves no policy weight. Vector
    observations with discrete actions (CartPole-v1) are built the same way (docs/a3c.md)."""
    agent = a3c.Agent((6,), **actions)
    _, values, _ = agent(torch.randn(3, 2, 6), torch.zeros(3, 2, dtype=torch.bool))
    values.sum().backward()
    assert all(p.grad is None for p in [*agent.body.parameters(), *agent.policy.parameters()])
    assert all(p.grad is not None for p in agent.value_body.parameters())


def test_discrete_policy_log_prob_and_entropy():
    torch.manual_seed(0)
    agent = a3c.Agent((4, 84, 84), num_actions=4)
    pi, _, _ = agent(torch.randint(0, 255, (2, 3, 4, 84, 84), dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.bool))
    actions = agent.sample(pi)
    log_prob, entropy = agent.log_prob_entropy(pi, actions)
    ref = torch.distributions.Categorical(logits=pi)
    torch.testing.assert_close(log_prob, ref.log_prob(actions))
    torch.testing.assert_close(entropy, ref.entropy())
    assert (agent.sample(pi, greedy=True) == pi.argmax(-1)).all()
    assert sum(isinstance(m, nn.Conv2d) for m in agent.modules()) == 2  # 16 8x8/4, 32 4x4/2 (Supp. 8)
    assert agent.value_body is None  # pixels: the policy and the value share the torso (Supp. 8)


@pytest.mark.parametrize("action_dim", [0, 2])
def test_lstm_rollout_pass_equals_step_by_step_acting(action_dim):
    """The worker acts step by step and computes its loss in one pass over the rollout from the rollout's first
    state: both give the same policy and values, with the state zeroed where an episode starts."""
    torch.manual_seed(0)
    agent = a3c.Agent((5,), num_actions=0 if action_dim else 3, action_dim=action_dim, lstm_size=16)
    T, B = 6, 3
    obs, first = torch.randn(T, B, 5), torch.zeros(T, B, dtype=torch.bool)
    first[3, 1] = True
    state0 = tuple((torch.randn(B, 16), torch.randn(B, 16)) for _ in agent.initial_state(B))
    assert len(state0) == 2  # vector observations: a policy body and a value body, each with its LSTM
    state, steps = state0, []
    for t in range(T):
        pi, v, state = agent(obs[t : t + 1], first[t : t + 1], state)
        steps.append((pi[0], v[0]))
    pi_all, v_all, _ = agent(obs, first, state0)
    torch.testing.assert_close(pi_all, torch.stack([s[0] for s in steps]))
    torch.testing.assert_close(v_all, torch.stack([s[1] for s in steps]))
    zero = tuple((torch.zeros(B, 16), torch.zeros(B, 16)) for _ in state0)  # the zeroed state at t = 3, env 1
    pi_restart, _, _ = agent(obs[3:], first[3:], tuple((h.clone(), c.clone()) for h, c in zero))
    torch.testing.assert_close(pi_all[3:, 1], pi_restart[:, 1])


# --------------------------------------------------------------------------------------------------------
# The script end to end.


@pytest.mark.e2e
@pytest.mark.parametrize("extra", [[], ["--lstm"]])
def test_smoke_qbert(tmp_path, extra):
    """A3C from pixels, feed-forward and LSTM: the run, its curves and its model.pt played by the run's own evaluation.
    On Qbert, whose episodes end whatever a policy plays (270-1,040 steps for any one action repeated), not Breakout,
    where a policy that has stopped pressing FIRE plays out its 27,000 steps (acer's --bf16 run, once in a loaded suite:
    entropy 0.51 at its last update)."""
    argv = "--env-id Qbert-v5 --num-workers 2 --total-timesteps 1500 --eval-episodes 1 --save-model --log-interval 1"
    run = run_script("a3c.py", flags(argv, extra), tmp_path)
    summary = json.load(open(os.path.join(run, "summary.json")))
    t_max = 20 if extra else 5
    assert 1500 <= summary["total_timesteps"] < 1500 + 2 * t_max  # one shared counter over both workers
    assert summary["num_workers"] == 2 and summary["eval_mean_return"] is not None
    saved = json.load(open(os.path.join(run, "args.json")))
    assert saved["t_max"] == t_max and saved["max_grad_norm"] == 40.0  # the defaults for pixels, as run
    assert saved["task_family"] == "atari" and saved["rmsprop_eps"] == 1e-5
    tags = events_tags(run)
    assert {"charts/SPS", "charts/learning_rate", "losses/value_loss", "losses/policy_loss", "losses/entropy"} <= tags
    assert {"stats/grad_norm", "stats/policy_lag"} <= tags
    acc = events(run)
    for e in acc.Scalars("charts/learning_rate"):  # logged at the step after the update: annealed linearly to 0
        assert e.value == pytest.approx(1e-3 * (1 - (e.step - t_max) / 1500), rel=1e-5)
    assert len(acc.Scalars("charts/learning_rate")) >= 2  # worker 0's first and last update at least


@pytest.mark.e2e
def test_smoke_halfcheetah(tmp_path):
    argv = "--env-id HalfCheetah-v4 --num-workers 2 --num-envs 2 --total-timesteps 3000 --eval-episodes 1 --save-model"
    run = run_script("a3c.py", flags(argv), tmp_path)
    checkpoint = torch.load(os.path.join(run, "model.pt"), weights_only=False)
    assert checkpoint["agent_config"]["action_dim"] == 6
    stats = checkpoint["agent"]
    assert stats["obs_norm.count"] >= 2900  # both workers folded their observations into the shared statistics
    assert stats["obs_norm.var"].min() > 0 and not torch.allclose(stats["obs_norm.mean"], torch.zeros(17).double())
    assert "stats/policy_std" in events_tags(run)


@pytest.mark.e2e
def test_smoke_breakout_n_step_q(tmp_path):
    """n-step Q-learning from pixels: the Atari Q-network, θ⁻ every 10,000 steps and ε over 1M (Supp. 8)."""
    argv = ["--env-id", "Breakout-v5", "--method", "n-step-q", "--num-workers", "2", "--total-timesteps", "1500"]
    run = run_script("a3c.py", [*argv, "--eval-episodes", "1", "--save-model"], tmp_path)
    saved = json.load(open(os.path.join(run, "args.json")))
    assert (saved["target_update_period"], saved["epsilon_steps"], saved["max_grad_norm"]) == (10_000, 1_000_000, 40.0)
    model = torch.load(os.path.join(run, "model.pt"), weights_only=False)
    assert model["agent_config"]["q_values"] and model["agent"]["policy.weight"].shape[0] == 4  # Q of each action
    assert {"losses/td_loss", "stats/q_mean", "stats/epsilon", "stats/grad_norm"} <= events_tags(run)


@pytest.mark.e2e
@pytest.mark.parametrize("method, stop", [("a3c", signal.SIGINT), ("n-step-q", signal.SIGTERM)])
def test_killed_run_resumes_and_a_stop_saves_the_update_in_hand(tmp_path, method, stop):
    """A run SIGKILLed after a checkpoint: its workers exit by themselves. `--resume` continues it: the same folder
    and arguments, the shared weights and RMSProp statistics, the step counter (so the learning-rate schedule goes on
    where it was) and the curves from the checkpoint's step; a value-based method's target network and ε schedule too.
    Ctrl-C (A3C) or SIGTERM (n-step Q) then stops the resumed run: each worker completes its update in hand, the
    main process saves the shared state at the step they reached, says how to continue and exits with 130, leaving
    no worker behind (`kill_resume_stop`: every step on what the run wrote, none on a clock)."""
    budget = 2_000_000  # not spent within the test: the runs end by a kill and a stop
    argv = flags(f"--method {method} --env-id CartPole-v1 --num-workers 2 --num-envs 2 --total-timesteps {budget}")
    argv += flags("--log-interval 0.5 --seed 3 --save-model")
    run, saved, final, err = kill_resume_stop(
        "a3c.py", argv, tmp_path, stop, kill_past=1000, past=10_000, ready=learning_rate_logged
    )
    assert evaluate_cli(run, episodes=1)["episodes"] == 1  # the model.pt written with the checkpoints
    assert 0 < saved["global_step"] < final["global_step"] < budget and final["args"]["num_envs"] == 2
    square_avg = [s["square_avg"] for s in saved["optimizer"]["state"].values()]
    assert any(g.abs().sum() > 0 for g in square_avg)  # the shared statistics, not fresh zeros
    acc = events(run)
    lr = acc.Scalars("charts/learning_rate")
    after = [e for e in lr if e.step > saved["global_step"] + 1000]
    assert any(e.step <= saved["global_step"] for e in lr) and after
    for e in after:  # the linear annealing of the whole run, not restarted from the resumed step
        expected = 1e-3 * (1 - (e.step - 5 * 2) / budget)  # step + t_max x envs
        assert e.value == pytest.approx(expected, rel=1e-6), (e.step, e.value)
    if method != "a3c":
        assert set(saved["target"]) == set(saved["agent"]) and not torch.equal(
            saved["target"]["policy.weight"], final["target"]["policy.weight"]
        )  # θ⁻ saved, and refreshed every 500 steps after the resume
        epsilon = acc.Scalars("stats/epsilon")
        last_before = [e.value for e in epsilon if e.step <= saved["global_step"]][-1]
        assert all(e.value <= last_before for e in epsilon if e.step > saved["global_step"] + 1000)  # not from 1


@pytest.mark.e2e
def test_learns_cartpole_with_its_family_defaults(tmp_path):
    """`--env-id CartPole-v1` alone (the classic-control family: the paper's settings, 8 envs per worker, a 1M-step
    budget): the mean return of the last 100 episodes reaches 200 within it (`learns`; a random policy lasts 22).
    Hogwild runs differ from run to run even with one seed (the workers' updates interleave as the OS schedules
    them): seeds 1-3 on 2 loaded cores first reached 200 at 48k-82k steps (13-17 s) and ended at 500.0 (docs/a3c.md,
    `--preset a3c-cartpole` for the end of a run)."""
    best, run = learns("a3c.py", ["--env-id", "CartPole-v1"], tmp_path, 200)
    saved = json.load(open(os.path.join(run, "args.json")))
    assert saved["task_family"] == "classic" and (saved["total_timesteps"], saved["num_envs"]) == (1_000_000, 8)
    assert best >= 200, best


@pytest.mark.e2e
@pytest.mark.parametrize("method, target", [("one-step-q", 150), ("one-step-sarsa", 150), ("n-step-q", 150)])
def test_value_based_methods_learn_cartpole(tmp_path, method, target):
    """Each value-based method learns, as a user runs it: `--env-id CartPole-v1 --method <method>` alone (2 workers x
    8 envs, 1M steps, θ⁻ every 500 steps, ε annealed over the first 333k steps to each env's final ε), stopped once
    the mean return of 100 episodes reaches `target` (`learns`; a random policy lasts 22). Runs of each command on 2
    loaded cores, two or three at a time, first reached 150 at: n-step Q 223k-277k steps (seeds 1-10), one-step Q
    227k-274k (seeds 1-10), one-step Sarsa 235k-266k (seeds 1-3), 15-68 s. The episodes are ε-greedy: the 30% of
    envs whose final ε is 0.5 (Supp. 8) hold the training mean near 250-360 once the policy plays 500 (docs/a3c.md).
    Where a run ends is a benchmark's business (`--preset a3c-cartpole`). The run it leaves: the value-based
    TensorBoard tags, the target network in the checkpoint, the defaults it ran with in args.json, a model that
    evaluate.py plays greedily (the run's own evaluation plays it ε-greedy)."""
    argv = ["--env-id", "CartPole-v1", "--method", method, "--save-model"]
    best, run = learns("a3c.py", argv, tmp_path, target)
    assert best >= target, best
    tags = events_tags(run)
    assert {"losses/td_loss", "stats/q_mean", "stats/epsilon", "stats/grad_norm", "charts/learning_rate"} <= tags
    assert "losses/policy_loss" not in tags
    saved = json.load(open(os.path.join(run, "args.json")))
    assert (saved["method"], saved["t_max"], saved["target_update_period"]) == (method, 5, 500)
    assert (saved["total_timesteps"], saved["num_envs"]) == (1_000_000, 8)
    assert saved["epsilon_steps"] == 333_333  # a third of the run
    checkpoint = torch.load(os.path.join(run, "checkpoint.pt"), weights_only=False)
    assert set(checkpoint["target"]) == set(checkpoint["agent"]) and "policy.weight" in checkpoint["agent"]
    assert not any(k.startswith("value") for k in checkpoint["agent"])  # the Q-network: no value head or body
    result = evaluate_cli(run, extra=["--greedy"])
    assert result["env_id"] == "CartPole-v1" and result["episodes"] == 2


@pytest.mark.e2e
def test_learns_inverted_pendulum(tmp_path):
    """Continuous actions: InvertedPendulum-v4 with `--env-id` and a budget alone (the MuJoCo family: the paper's
    settings with 4 envs per worker) balances the pole for 500 steps on average over 100 episodes within 500k steps
    (a random policy lasts 5-10). Ten runs on 2 loaded cores, seeds 1-10 one at a time, first reached 500 at 68k-74k
    steps (100 at 14k-25k, 900 at 120k-242k: all ten), 54-67 s each."""
    best, run = learns("a3c.py", ["--env-id", "InvertedPendulum-v4", "--total-timesteps", "500000"], tmp_path, 500)
    saved = json.load(open(os.path.join(run, "args.json")))
    assert saved["task_family"] == "mujoco" and saved["num_envs"] == 4
    assert best >= 500, best


def test_active_units_statistic_sees_a_dead_layer():
    """stats/active_units, 1 − dead_units of the torso: the fraction of the last hidden ReLU layer's units positive on
    some frame; a layer whose biases push every unit below zero (a dead torso) reads 0, a fresh one most units."""
    torch.manual_seed(0)
    agent = a3c.Agent((4, 84, 84), num_actions=4)
    obs = torch.randint(0, 255, (8, 4, 84, 84), dtype=torch.uint8)
    assert 1 - a3c.dead_units(agent.body.torso(obs)) > 0.5
    last = [m for m in agent.body.torso.modules() if isinstance(m, nn.Linear)][-1]
    with torch.no_grad():
        last.bias.fill_(-1e4)
    assert 1 - a3c.dead_units(agent.body.torso(obs)) == 0


def test_scale_rewards_divides_by_the_std_of_the_discounted_return():
    """--scale-rewards (VecNormalize's): each reward over sqrt(Var[R] + 1e-8), clipped to ±10, R_t = γ R_{t−1} +
    r_t the discounted return of the episode so far; a plain loop over one environment's rewards."""
    rng = np.random.default_rng(0)
    rewards, dones, gamma = rng.normal(3.0, 1.0, 200), rng.random(200) < 0.05, 0.99
    norm, ret, seen, out = a3c.RunningNorm(1), 0.0, [], []
    for r, d in zip(rewards, dones):  # the worker's order: R_t, then scale with the statistics so far, then reset
        ret = gamma * ret + r
        seen.append(ret)
        var = np.var(seen[:-1]) if len(seen) > 1 else 1.0
        out.append(float(a3c.scale_rewards(np.array([r]), norm.var)[0]))
        assert out[-1] == pytest.approx(np.clip(r / np.sqrt(var + 1e-8), -10, 10), rel=1e-6)
        norm.update(torch.tensor([[ret]]))
        ret = 0.0 if d else ret
    assert a3c.scale_rewards(np.array([1e9, -1e9]), norm.var).tolist() == [10.0, -10.0]


def test_scale_rewards_statistics_take_every_steps_discounted_return():
    """--scale-rewards: the return statistics take R_t at every step (`assert_every_steps_return_scaled`), with
    a3c's worker in this process."""
    argv = "--env-id Pendulum-v1 --num-workers 1 --num-envs 1 --scale-rewards --no-lstm --t-max 20".split()
    args, _ = a3c.check_args(a3c.parse_args(argv))
    agent = a3c.Agent((3,), 0, 1, args.hidden, gaussian=args.gaussian, scale_rewards=True).share_memory()
    optimizer = a3c.SharedRMSprop(agent.parameters(), args.learning_rate, args.rmsprop_alpha, args.rmsprop_eps)
    counter, lock, msg_q = multiprocessing.Value("q", 0), multiprocessing.Lock(), queue.Queue()
    run = dataclasses.replace(args, total_timesteps=400)
    assert_every_steps_return_scaled(
        agent, lambda: a3c.train_worker(0, run, agent, None, optimizer, counter, lock, msg_q)
    )
