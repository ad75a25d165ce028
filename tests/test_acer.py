"""acer.py: Retrace, the truncated policy gradient with bias correction, the trust region and the average
network against the paper, and the script end to end."""

import copy
import dataclasses
import json
import multiprocessing
import os
import queue
import signal
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import acer
from acer import acer_loss, acer_policy_gradient, kl_gradient, retrace, trust_region_step
from tests.helpers import assert_every_steps_return_scaled, evaluate_cli, events, events_tags, flags
from tests.helpers import kill_resume_stop, learning_rate_logged, learns, run_script


# --------------------------------------------------------------------------------------------------------
# Math against plain loops written from the paper.


def segment_fields(batch):
    """A segment's tensors in the order the ACER losses take them."""
    return tuple(batch[key] for key in ("action", "reward", "terminated", "ended", "behaviour"))


def hyperparameters(args):
    """The ACER losses' hyperparameters from a namespace of them (the continuous loss has no entropy term)."""
    names = ("gamma", "c", "delta", "ent_coef", "value_coef", "trust_region")
    return {k: getattr(args, k) for k in names if hasattr(args, k)}


def retrace_reference(rewards, discounts, q_taken, values, rho_bar, bootstrap):
    """Algorithm 2 per environment: Q^ret ← V(x_k); for i = k−1..0: Q^ret ← r_i + γ_i Q^ret (the target of step
    i), then Q^ret ← ρ̄_i (Q^ret − Q(x_i, a_i)) + V(x_i)."""
    T, B = rewards.shape
    out = torch.zeros(T, B, dtype=torch.float64)
    for b in range(B):
        q_ret = float(bootstrap[b])
        for i in reversed(range(T)):
            q_ret = float(rewards[i, b]) + float(discounts[i, b]) * q_ret
            out[i, b] = q_ret
            q_ret = float(rho_bar[i, b]) * (q_ret - float(q_taken[i, b])) + float(values[i, b])
    return out


def random_segment(T=8, B=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(T, B, generator=g, dtype=torch.float64)
    done = torch.rand(T, B, generator=g) < 0.2
    done[3, 0] = True  # an episode end inside the segment
    discounts = 0.9 * (~done).double()
    q_taken = torch.randn(T, B, generator=g, dtype=torch.float64)
    values = torch.randn(T, B, generator=g, dtype=torch.float64)
    rho = torch.exp(torch.randn(T, B, generator=g, dtype=torch.float64))  # ratios above and below 1
    bootstrap = torch.randn(B, generator=g, dtype=torch.float64)
    return rewards, discounts, q_taken, values, rho.clamp(max=1.0), bootstrap


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_retrace_matches_algorithm_2(seed):
    rewards, discounts, q_taken, values, rho_bar, bootstrap = random_segment(seed=seed)
    assert (rho_bar < 1).any() and (rho_bar == 1).any()  # truncation bites somewhere
    out = retrace(rewards, discounts, q_taken, values, rho_bar, bootstrap)
    torch.testing.assert_close(out, retrace_reference(rewards, discounts, q_taken, values, rho_bar, bootstrap))
    assert out[3, 0] == rewards[3, 0]  # nothing crosses the episode end


def test_retrace_limits():
    """ρ̄ = 0 everywhere: one-step targets r_t + γ V(x_{t+1}). ρ̄ = 1 and Q(x, a) = V(x) (a policy evaluation
    where the critic has no action preference): the n-step return bootstrapped from V(x_k)."""
    rewards, discounts, q_taken, values, _, bootstrap = random_segment()
    one_step = retrace(rewards, discounts, q_taken, values, torch.zeros_like(values), bootstrap)
    next_v = torch.cat([values[1:], bootstrap[None]])
    torch.testing.assert_close(one_step, rewards + discounts * next_v)
    full = retrace(rewards, discounts, values, values, torch.ones_like(values), bootstrap)
    expected, acc = torch.zeros_like(rewards), bootstrap
    for t in reversed(range(rewards.shape[0])):
        acc = rewards[t] + discounts[t] * acc
        expected[t] = acc
    torch.testing.assert_close(full, expected)


def test_trust_region_step_solves_the_linearised_problem():
    """Eq. (11): min ½‖g − z‖² s.t. kᵀz ≤ δ. The KKT conditions of this convex problem hold at z (feasible; either
    z = g with g feasible, or kᵀz = δ with g − z = λk, λ ≥ 0), and no one of 2000 random feasible points is
    closer to g; rows where the constraint is inactive are left unchanged."""
    g_ = torch.Generator().manual_seed(0)
    N, D, delta = 64, 5, 1.0
    g = torch.randn(N, D, generator=g_, dtype=torch.float64) * 3
    k = torch.randn(N, D, generator=g_, dtype=torch.float64)
    z = trust_region_step(g, k, delta)
    inactive = (k * g).sum(-1) <= delta
    assert 5 < inactive.sum() < N - 5  # both kinds of rows
    torch.testing.assert_close(z[inactive], g[inactive])
    assert ((k * z).sum(-1) <= delta + 1e-9).all()
    active = ~inactive
    torch.testing.assert_close((k * z).sum(-1)[active], torch.full((int(active.sum()),), delta, dtype=torch.float64))
    lam = ((g - z) * k).sum(-1) / (k * k).sum(-1)
    torch.testing.assert_close((g - z)[active], (lam[:, None] * k)[active])
    assert (lam[active] > 0).all()
    for row in range(N):  # brute force: random feasible candidates around g
        cand = g[row] + torch.randn(2000, D, generator=g_, dtype=torch.float64) * 2
        cand = cand[(cand @ k[row]) <= delta]
        assert ((cand - g[row]).norm(dim=-1) >= (z[row] - g[row]).norm() - 1e-9).all()


def test_kl_gradient_matches_autograd():
    g_ = torch.Generator().manual_seed(1)
    avg = torch.softmax(torch.randn(6, 4, generator=g_, dtype=torch.float64), -1)
    phi = torch.softmax(torch.randn(6, 4, generator=g_, dtype=torch.float64), -1).requires_grad_()
    (avg * (avg.log() - phi.log())).sum().backward()
    torch.testing.assert_close(kl_gradient(avg, phi.detach()), phi.grad)


def test_bias_correction_recovers_the_untruncated_gradient():
    """Eq. (7) by exact summation on a small discrete example with truncation that bites: the expectation over
    a_t ~ μ of ĝ^acer (Eq. 10, with Q^ret = Q(a_t) exact) equals E_{a~π}[∇_φ log π(a)(Q(a) − V)] = Q − V
    (∇_φ log φ(a) = e_a/φ(a)), the untruncated importance-weighted gradient; truncation alone does not."""
    pi = torch.tensor([0.55, 0.3, 0.1, 0.05], dtype=torch.float64)
    mu = torch.tensor([0.02, 0.18, 0.4, 0.4], dtype=torch.float64)  # ρ(a) = 27.5, 1.67, 0.25, 0.125
    q = torch.tensor([2.0, -1.0, 0.5, 3.0], dtype=torch.float64)
    c = 1.5
    A = len(pi)
    actions = torch.arange(A)
    g, rho_bar, rho = acer_policy_gradient(pi.expand(A, A), actions, mu.expand(A, A), q.expand(A, A), q[actions], c)
    assert (rho > c).any() and (rho_bar < rho).any()
    expected_g = (mu[:, None] * g).sum(0)
    v = (pi * q).sum()
    torch.testing.assert_close(expected_g, q - v)
    untruncated = (mu[:, None] * rho[:, None] * torch.eye(A, dtype=torch.float64) * ((q - v) / pi)[:, None]).sum(0)
    torch.testing.assert_close(untruncated, q - v)
    truncated_only = mu * rho.clamp(max=c) * (q - v) / pi  # the first term of Eq. (10) alone is biased
    assert not torch.allclose(truncated_only, q - v)


def loss_inputs(T=6, B=3, A=4, seed=0):
    g_ = torch.Generator().manual_seed(seed)
    logits = torch.randn(T + 1, B, A, generator=g_, dtype=torch.float64, requires_grad=True)
    q = torch.randn(T + 1, B, A, generator=g_, dtype=torch.float64, requires_grad=True)
    avg_logits = torch.randn(T + 1, B, A, generator=g_, dtype=torch.float64)
    reset = torch.zeros(T + 1, B, dtype=torch.bool)
    reset[3, 1] = True
    terminated = torch.zeros(T + 1, B, dtype=torch.bool)
    terminated[2, 1] = True
    batch = {
        "action": torch.randint(A, (T + 1, B), generator=g_),
        "reward": torch.randn(T + 1, B, generator=g_, dtype=torch.float64),
        "terminated": terminated,
        "ended": reset,
        "behaviour": torch.softmax(torch.randn(T + 1, B, A, generator=g_, dtype=torch.float64) * 2, -1),
    }
    args = SimpleNamespace(gamma=0.9, c=10.0, delta=1.0, ent_coef=0.01, trust_region=True, value_coef=0.5)
    return logits, q, avg_logits, batch, args


def test_acer_loss_gradients():
    """The critic gets Eq. (6) for the taken actions only (value_coef · 2 (Q − Q^ret)/B, Q^ret from `retrace` with
    ρ̄ = min(1, π/μ), 0 at the reset step), the policy −z/B through the softmax, and a reset step gets nothing."""
    logits, q, avg_logits, batch, args = loss_inputs()
    T, B, A = logits.shape[0] - 1, logits.shape[1], logits.shape[2]
    out = acer_loss(logits, q, avg_logits, *segment_fields(batch), **hyperparameters(args))
    loss = out.loss
    loss.backward()
    probs = torch.softmax(logits.detach(), -1)
    v = (probs * q.detach()).sum(-1)
    a = batch["action"][:-1]
    rho = (probs[:-1] / batch["behaviour"][:-1]).gather(-1, a[..., None])[..., 0]
    rho_bar = torch.where(batch["ended"][:-1], 0.0, rho.clamp(max=1))
    q_taken = q.detach()[:-1].gather(-1, a[..., None])[..., 0]
    q_ret = retrace_reference(
        batch["reward"][:-1], 0.9 * (~batch["terminated"][:-1]).double(), q_taken, v[:-1], rho_bar, v[-1]
    )
    expected_q_grad = torch.zeros_like(q)
    for t in range(T):
        for b in range(B):
            if not batch["ended"][t, b]:
                expected_q_grad[t, b, a[t, b]] = 0.5 * 2 * (q_taken[t, b] - q_ret[t, b]) / B
    torch.testing.assert_close(q.grad, expected_q_grad)
    assert (logits.grad[3, 1] == 0).all() and (logits.grad[-1] == 0).all()
    # the policy part: −z/B back through the softmax, z the trust-region step of ĝ (Eq. 12) for each state
    g, _, _ = acer_policy_gradient(
        probs[:-1].reshape(-1, A),
        a.reshape(-1),
        batch["behaviour"][:-1].reshape(-1, A),
        q.detach()[:-1].reshape(-1, A),
        q_ret.reshape(-1),
        args.c,
        args.ent_coef,
    )
    z = trust_region_step(
        g, kl_gradient(torch.softmax(avg_logits[:-1], -1).reshape(-1, A), probs[:-1].reshape(-1, A)), args.delta
    ).view(T, B, A)
    z[3, 1] = 0
    jac_logits = logits.detach()[:-1].clone().requires_grad_()
    torch.softmax(jac_logits, -1).backward(-z / B)
    torch.testing.assert_close(logits.grad[:-1], jac_logits.grad)
    assert out.trust_region_adjustment > 0


def test_no_trust_region_with_a_huge_delta():
    """δ → ∞ makes the constraint inactive: the same update as --no-trust-region."""
    grads = []
    for trust_region, delta in ((True, 1e12), (False, 1.0)):
        logits, q, avg_logits, batch, args = loss_inputs(seed=3)
        args.trust_region, args.delta = trust_region, delta
        acer_loss(logits, q, avg_logits, *segment_fields(batch), **hyperparameters(args)).loss.backward()
        grads.append(logits.grad)
    torch.testing.assert_close(grads[0], grads[1])


# Continuous actions (Sec. 5, Algorithm 3).


def test_gaussian_policy_gradient_matches_autograd_of_eq16():
    """Eq. (16) with ∇_φ log f taken by autograd of torch's Normal log-density (not the closed form)."""
    g_ = torch.Generator().manual_seed(0)
    N, d, std, c = 40, 3, 0.3, 2.0
    mean = torch.randn(N, d, generator=g_, dtype=torch.float64) * 0.5
    behaviour = mean + torch.randn(N, d, generator=g_, dtype=torch.float64) * 0.3
    actions = behaviour + std * torch.randn(N, d, generator=g_, dtype=torch.float64)
    sampled = mean + std * torch.randn(N, d, generator=g_, dtype=torch.float64)
    q_opc, values, q_sampled = (torch.randn(N, generator=g_, dtype=torch.float64) for _ in range(3))
    g, rho_bar, rho = acer.gaussian_policy_gradient(mean, actions, behaviour, q_opc, values, sampled, q_sampled, std, c)
    normal = lambda m: torch.distributions.Normal(m, std)  # noqa: E731
    ref_rho = (normal(mean).log_prob(actions).sum(-1) - normal(behaviour).log_prob(actions).sum(-1)).exp()
    ref_rho_s = (normal(mean).log_prob(sampled).sum(-1) - normal(behaviour).log_prob(sampled).sum(-1)).exp()
    torch.testing.assert_close(rho, ref_rho)
    assert (ref_rho > c).any() and (ref_rho_s > c).any() and (ref_rho < c).any()  # truncation bites both ways
    phi = mean.clone().requires_grad_()
    objective = ref_rho.clamp(max=c) * normal(phi).log_prob(actions).sum(-1) * (q_opc - values) + (
        1 - c / ref_rho_s
    ).clamp(min=0) * (q_sampled - values) * normal(phi).log_prob(sampled).sum(-1)
    objective.sum().backward()
    torch.testing.assert_close(g, phi.grad)
    torch.testing.assert_close(rho_bar, ref_rho.clamp(max=c))


def test_stochastic_dueling_network_is_consistent():
    """Eq. (13): E_{a~π} E_{u~π} Q̃(x, a) = V(x): the advantage terms cancel in expectation (Monte Carlo)."""
    torch.manual_seed(0)
    agent = acer.ContinuousAgent((5,), 2, hidden=32)
    obs = torch.randn(1, 3, 5)
    mean, values = agent(obs)
    g_ = torch.Generator().manual_seed(1)
    M = 4000
    a = mean.detach().expand(M, 3, 2) + 0.3 * torch.randn(M, 3, 2, generator=g_)
    with torch.no_grad():
        q = agent.q_tilde(obs.expand(M, 3, 5), a, mean.expand(M, 3, 2), values.expand(M, 3), 5)
    spread = q.std(0)
    assert ((q.mean(0) - values[0]).abs() < 4 * spread / M**0.5).all()
    assert (spread > 0).all()  # Q̃ does depend on the action


def test_acer_loss_continuous_gradients_follow_algorithm_3():
    """The critic gets (Q̃ − Q^ret) on Q̃ and −min(1, ρ)(Q^ret − Q̃) on V (Algorithm 3, value_coef 0.5, over B),
    with Q^ret from Retrace with c_i = min(1, ρ^(1/d)); the mean gets −z/B, z the trust-region step (Eq. 12) of
    Eq. (16)'s ĝ with Q^opc (traces 1) and k = (φ − φ_a)/σ²; a reset step gets nothing."""
    g_ = torch.Generator().manual_seed(2)
    T, B, d, std = 5, 3, 2, 0.3
    mean = (torch.randn(T + 1, B, d, generator=g_, dtype=torch.float64) * 0.3).requires_grad_()
    values = torch.randn(T + 1, B, generator=g_, dtype=torch.float64).requires_grad_()
    q_taken = torch.randn(T, B, generator=g_, dtype=torch.float64).requires_grad_()
    q_sampled = torch.randn(T, B, generator=g_, dtype=torch.float64)
    sampled = mean.detach()[:-1] + std * torch.randn(T, B, d, generator=g_, dtype=torch.float64)
    avg_mean = mean.detach() + 0.2 * torch.randn(T + 1, B, d, generator=g_, dtype=torch.float64)
    reset = torch.zeros(T + 1, B, dtype=torch.bool)
    reset[2, 0] = True
    terminated = torch.zeros(T + 1, B, dtype=torch.bool)
    terminated[1, 0] = True
    behaviour = mean.detach() + 0.2 * torch.randn(T + 1, B, d, generator=g_, dtype=torch.float64)
    batch = {
        "action": behaviour + std * torch.randn(T + 1, B, d, generator=g_, dtype=torch.float64),
        "behaviour": behaviour,
        "reward": torch.randn(T + 1, B, generator=g_, dtype=torch.float64),
        "terminated": terminated,
        "ended": reset,
    }
    args = SimpleNamespace(gamma=0.9, c=5.0, delta=0.5, trust_region=True, value_coef=0.5, policy_std=std)
    out = acer.acer_loss_continuous(
        mean, values, q_taken, q_sampled, sampled, avg_mean, *segment_fields(batch), std=std, **hyperparameters(args)
    )
    loss = out.loss
    loss.backward()
    m, v, qt = mean.detach(), values.detach(), q_taken.detach()
    normal = lambda loc: torch.distributions.Normal(loc, std)  # noqa: E731
    rho = (
        normal(m[:-1]).log_prob(batch["action"][:-1]).sum(-1)
        - normal(batch["behaviour"][:-1]).log_prob(batch["action"][:-1]).sum(-1)
    ).exp()
    keep = (~reset[:-1]).double()
    discounts = 0.9 * (~terminated[:-1]).double()
    q_ret = retrace_reference(batch["reward"][:-1], discounts, qt, v[:-1], keep * (rho ** (1 / d)).clamp(max=1), v[-1])
    q_opc = retrace_reference(batch["reward"][:-1], discounts, qt, v[:-1], keep, v[-1])
    torch.testing.assert_close(q_taken.grad, keep * (qt - q_ret) / B)
    torch.testing.assert_close(values.grad[:-1], -keep * rho.clamp(max=1) * (q_ret - qt) / B)
    assert (values.grad[-1] == 0).all()
    g, _, _ = acer.gaussian_policy_gradient(
        m[:-1].reshape(-1, d),
        batch["action"][:-1].reshape(-1, d),
        behaviour[:-1].reshape(-1, d),
        q_opc.reshape(-1),
        v[:-1].reshape(-1),
        sampled.reshape(-1, d),
        q_sampled.reshape(-1),
        std,
        5.0,
    )
    z = trust_region_step(g, ((m - avg_mean)[:-1] / std**2).reshape(-1, d), 0.5).view(T, B, d)
    torch.testing.assert_close(mean.grad[:-1], -keep[..., None] * z / B, rtol=1e-5, atol=1e-6)
    assert (mean.grad[2, 0] == 0).all() and out.trust_region_adjustment > 0


def test_continuous_policy_and_value_are_separate_networks():
    """Algorithm 3's θ and θ_v: the mean and V share no parameter, so the mean's gradient reaches no part of the
    critic (V's torso and head, A) and V's none of the policy's."""
    torch.manual_seed(0)
    agent = acer.ContinuousAgent((5,), 2, hidden=16)
    policy = {id(p) for p in [*agent.torso.parameters(), *agent.mean.parameters()]}
    critic = {id(p) for m in (agent.value_torso, agent.value, agent.advantage) for p in m.parameters()}
    assert not policy & critic and policy | critic == {id(p) for p in agent.parameters()}
    obs = torch.randn(3, 4, 5)
    for out, reached in ((0, policy), (1, critic - {id(p) for p in agent.advantage.parameters()})):
        agent.zero_grad(set_to_none=True)
        agent(obs)[out].sum().backward()
        got = {id(p) for p in agent.parameters() if p.grad is not None and p.grad.abs().sum() > 0}
        assert got == reached


def test_continuous_mean_starts_small():
    """pfrl's train_acer_mujoco.py: the mean layer's weights ×0.01, so μ ≈ 0 at the start whatever the state."""
    torch.manual_seed(0)
    agent = acer.ContinuousAgent((11,), 3)
    assert agent.mean.weight.abs().max() < 0.05 and (agent.mean.bias == 0).all()
    assert agent.value.weight.abs().max() > 0.05  # the value head keeps PyTorch's default
    mean, _ = agent(torch.randn(4, 8, 11) * 3)
    assert mean.abs().max() < 0.1


def test_continuous_observation_statistics():
    """Vector observations normalised by running statistics (as a3c.py): once the statistics have taken a batch,
    the agent's mean, V and Q̃ equal those of the same weights with fresh statistics (the identity within ±10) fed
    clip((x − m)/√(v + ε), ±10), and the same weights with statistics updated on an affinely shifted and scaled
    batch give the same outputs on the shifted observations."""
    torch.manual_seed(0)
    D = 4
    normed = acer.ContinuousAgent((D,), 2, hidden=16)
    plain = copy.deepcopy(normed)
    g_ = torch.Generator().manual_seed(0)
    scale, shift = torch.tensor([100.0, 0.01, 3.0, 1.0]), torch.tensor([50.0, -2.0, 0.0, 100.0])
    batch = torch.randn(6, 5, D, generator=g_) * scale + shift
    normed.obs_norm.update(batch)
    torch.testing.assert_close(normed.obs_norm.mean.float(), batch.reshape(-1, D).mean(0), rtol=1e-5, atol=1e-3)
    obs = torch.randn(3, 5, D, generator=g_) * scale + shift
    obs[0, 0] = shift + 50 * scale  # clipped at +10
    z = ((obs - normed.obs_norm.mean) / (normed.obs_norm.var + normed.obs_norm.eps).sqrt()).clamp(-10, 10).float()
    assert (z == 10).any()
    with torch.no_grad():
        (m1, v1), (m2, v2) = normed(obs), plain(z)
        torch.testing.assert_close(m1, m2)
        torch.testing.assert_close(v1, v2)
        actions = torch.randn(3, 5, 2, generator=g_)
        torch.manual_seed(1)
        q1 = normed.q_tilde(obs, actions, m1, v1, 5)
        torch.manual_seed(1)  # the same draws u_i
        q2 = plain.q_tilde(z, actions, m2, v2, 5)
        torch.testing.assert_close(q1, q2)
        assert not torch.allclose(plain(obs)[1], v2)  # the normalisation does change what the torsos see
    a, b = torch.tensor([3.0, 0.5, 7.0, 2.0]), torch.tensor([10.0, -4.0, 0.5, 0.0])
    other = copy.deepcopy(plain)  # the same weights, fresh statistics
    other.obs_norm.update(batch * a + b)
    with torch.no_grad():
        mean, values = other(obs * a + b)
        torch.testing.assert_close(mean, m1, rtol=1e-3, atol=1e-6)  # float32 rounding of the shifted inputs
        torch.testing.assert_close(values, v1, rtol=1e-3, atol=1e-5)


def test_eval_policy_keeps_the_observation_statistics():
    """A saved continuous model plays with the observation statistics it was trained with."""
    torch.manual_seed(0)
    obs = np.random.default_rng(0).normal(size=(3, 5)).astype(np.float32)
    new = acer.ContinuousAgent((5,), 2, hidden=16)
    new.obs_norm.update(torch.randn(20, 5) + 3)
    model = dict(agent_config=new.config, agent=new.state_dict(), action_low=[-1.0] * 2, action_high=[1.0] * 2)
    expected = new(torch.from_numpy(obs)[None])[0][0].detach().numpy()
    assert not np.allclose(expected, new.mean(new.torso(torch.from_numpy(obs))).detach().numpy(), atol=1e-4)
    np.testing.assert_allclose(acer.make_eval_policy(model, 3, greedy=True)(obs, None, None), expected, atol=1e-6)


def test_scale_rewards_against_a_loop():
    """--scale-rewards: each reward divided by √(Var[R] + 1e-8) of the return statistics, then clipped to ±10."""
    rewards = torch.tensor([[0.5, -3.0, 40.0], [0.0, 2.0, -60.0]])
    var = torch.tensor([9.0], dtype=torch.float64)
    out = acer.scale_rewards(rewards, var)
    for i in range(2):
        for j in range(3):
            expected = max(-10.0, min(10.0, float(rewards[i, j]) / (9.0 + 1e-8) ** 0.5))
            assert abs(float(out[i, j]) - expected) < 1e-6
    assert out.abs().max() == 10.0 and out.dtype == rewards.dtype
    agent = acer.ContinuousAgent((3,), 1, hidden=8, scale_rewards=True)
    assert agent.return_norm is not None and "return_norm.var" in agent.state_dict()
    assert acer.ContinuousAgent((3,), 1, hidden=8).return_norm is None  # off by default: the paper's rewards


def test_average_network_moves():
    """After an update θ_a = α θ_a_old + (1 − α) θ_new (Sec. 3.3) for the weights; the observation statistics are
    the workers' to copy whole (the smoke tests find θ_a's equal to θ's)."""
    torch.manual_seed(0)
    agent, avg = acer.Agent((4,), 2), acer.Agent((4,), 2)
    old = [p.detach().clone() for p in avg.parameters()]
    acer.update_average(avg, agent, 0.99)
    for pa, p0, p in zip(avg.parameters(), old, agent.parameters()):
        torch.testing.assert_close(pa.detach(), 0.99 * p0 + 0.01 * p.detach())
        assert not torch.allclose(pa, p0)


def test_nature_network():
    agent = acer.Agent((4, 84, 84), 6)
    convs = [m for m in agent.modules() if isinstance(m, torch.nn.Conv2d)]
    assert [(m.out_channels, m.kernel_size, m.stride) for m in convs] == [
        (32, (8, 8), (4, 4)),
        (64, (4, 4), (2, 2)),
        (64, (3, 3), (1, 1)),
    ]
    logits, q = agent(torch.zeros(2, 3, 4, 84, 84, dtype=torch.uint8))
    assert logits.shape == q.shape == (2, 3, 6) and agent.torso.out_features == 512


def test_bf16_update_follows_the_float32_one():
    """--bf16: the same segment's gradient with the networks' passes in bfloat16 (channels-last) points where the
    float32 one does, per layer; the loss and its statistics stay float32."""
    torch.manual_seed(0)
    agent, avg = acer.Agent((4, 84, 84), 6), acer.Agent((4, 84, 84), 6)
    avg.load_state_dict(agent.state_dict())
    with torch.no_grad():
        for p in avg.parameters():
            p.add_(0.01 * torch.randn_like(p))
    g = torch.Generator().manual_seed(1)
    segment = dict(
        obs=torch.randint(0, 256, (21, 2, 4, 84, 84), generator=g, dtype=torch.uint8),
        action=torch.randint(6, (21, 2), generator=g),
        reward=torch.randint(-1, 2, (21, 2), generator=g).float(),
        terminated=torch.zeros(21, 2, dtype=torch.bool),
        ended=torch.zeros(21, 2, dtype=torch.bool),
        behaviour=torch.softmax(torch.randn(21, 2, 6, generator=g), -1),
    )
    grads = {}
    for bf16 in (False, True):
        args = SimpleNamespace(
            gamma=0.99, c=10.0, delta=1.0, value_coef=0.5, trust_region=True, ent_coef=1e-3, bf16=bf16
        )
        if bf16:
            agent.to(memory_format=torch.channels_last)
            avg.to(memory_format=torch.channels_last)
        agent.zero_grad()
        out = acer.segment_loss(agent, avg, segment, args)
        assert out.loss.dtype == out.kl_avg.dtype == torch.float32
        out.loss.backward()
        grads[bf16] = {name: p.grad.flatten().clone() for name, p in agent.named_parameters()}
    for name, g32 in grads[False].items():
        cos = torch.nn.functional.cosine_similarity(g32, grads[True][name], dim=0)
        assert cos > 0.99, (name, float(cos))
    assert not torch.equal(grads[False]["torso.fc.weight"], grads[True]["torso.fc.weight"])  # bfloat16 did run


# --------------------------------------------------------------------------------------------------------
# The script end to end.


@pytest.mark.e2e
@pytest.mark.parametrize("extra", [[], ["--bf16"]])
def test_smoke_qbert(tmp_path, extra):
    """ACER from pixels, float32 and bfloat16: the run, its curves and its model.pt played by the run's evaluation and
    evaluate.py. On Qbert, whose episodes end whatever a policy plays (270-1,040 steps for any one action repeated), not
    Breakout, where a policy that has stopped pressing FIRE plays out its 27,000 steps (acer's --bf16 run, once in a
    loaded suite: entropy 0.51 at its last update)."""
    argv = "--env-id Qbert-v5 --num-workers 2 --total-timesteps 800 --replay-size 2000 --replay-ratio 2"
    run = run_script("acer.py", flags(argv, "--eval-episodes 1 --save-model", extra), tmp_path)
    summary = json.load(open(os.path.join(run, "summary.json")))
    assert 800 <= summary["total_timesteps"] < 800 + 2 * 20
    tags = events_tags(run)
    assert {"stats/rho_mean", "stats/truncated_fraction", "stats/trust_region_adjustment", "stats/kl_avg"} <= tags
    assert {"losses/value_loss", "losses/policy_loss", "charts/SPS", "charts/episodic_return"} <= tags
    assert all(n == int(n) >= 0 for n in events_tags(run, "stats/replay_updates"))  # Poisson(2) draws
    assert evaluate_cli(run)["episodes"] == 2


def summary_steps(run):
    return json.load(open(os.path.join(run, "summary.json")))["total_timesteps"]


@pytest.mark.e2e
def test_smoke_continuous_with_scale_rewards(tmp_path):
    """Continuous actions on Hopper-v4 with the MuJoCo family's defaults: Sec. 6's k, replay size, c and average decay,
    and --scale-rewards. θ_v apart from the policy; every on-policy step went into the shared observation statistics
    and its discounted return into the return statistics, which the average network holds too; the checkpoint keeps
    them; the model records the option and evaluates (greedily too)."""
    argv = ["--env-id", "Hopper-v4", "--num-workers", "2", "--total-timesteps", "400"]
    run = run_script("acer.py", argv + ["--eval-episodes", "1", "--save-model"], tmp_path)
    saved = json.load(open(os.path.join(run, "args.json")))
    assert (saved["k"], saved["replay_size"], saved["c"], saved["avg_decay"]) == (50, 5000, 5.0, 0.995)  # Sec. 6
    checkpoint = torch.load(os.path.join(run, "model.pt"), weights_only=False)
    assert checkpoint["agent_config"]["action_dim"] == 3 and len(checkpoint["action_low"]) == 3
    assert {"value_torso.net.0.weight", "obs_norm.mean"} <= set(checkpoint["agent"])  # θ_v apart, statistics
    # every on-policy step went into the shared statistics, and the average network holds the same ones
    agent, avg = checkpoint["agent"], checkpoint["avg_agent"]
    assert agent["obs_norm.count"] == checkpoint["global_step"] == summary_steps(run)
    assert (agent["obs_norm.var"] != 1).all()
    assert checkpoint["agent_config"]["scale_rewards"]
    assert agent["return_norm.count"] == agent["obs_norm.count"] == summary_steps(run)
    assert agent["return_norm.mean"] > 0 and agent["return_norm.var"] != 1  # Hopper's rewards are positive
    for name in (f"{norm}.{part}" for norm in ("obs_norm", "return_norm") for part in ("mean", "var", "count")):
        torch.testing.assert_close(avg[name], agent[name], rtol=0, atol=0)
    saved_checkpoint = torch.load(os.path.join(run, "checkpoint.pt"), weights_only=False)
    assert saved_checkpoint["agent_config"] == checkpoint["agent_config"]
    torch.testing.assert_close(saved_checkpoint["agent"]["obs_norm.mean"], agent["obs_norm.mean"])
    assert {"stats/rho_mean", "stats/kl_avg", "stats/trust_region_adjustment"} <= events_tags(run)
    assert evaluate_cli(run, extra=["--greedy"])["episodes"] == 2


@pytest.mark.e2e
def test_learns_cartpole_with_its_family_defaults(tmp_path):
    """`--env-id CartPole-v1` alone (the classic-control family: 4 envs per worker, 300k steps, the paper's other
    settings): the mean return of the last 100 episodes reaches 400 within it on 2 CPU cores (`learns`; seeds 1-3
    ended at 500.0 each, docs/acer.md)."""
    best, run = learns("acer.py", ["--env-id", "CartPole-v1"], tmp_path, 400)
    saved = json.load(open(os.path.join(run, "args.json")))
    assert saved["task_family"] == "classic" and saved["num_envs"] == 4 and saved["total_timesteps"] == 300_000
    assert best >= 400, best


@pytest.mark.e2e
def test_learns_inverted_pendulum_with_its_family_defaults(tmp_path):
    """Continuous actions, `--env-id InvertedPendulum-v4` and a 300k-step budget alone (the MuJoCo family: the
    paper's Sec. 6 settings with a learning rate of 5e-4, the critic's loss weighted 0.01, rewards scaled, RMSProp
    ε 1e-5 and δ 0.3): the mean of 100 episodes reaches 500 (`learns`; a random policy lasts 5-10). Ten runs on 2
    loaded cores, seeds 1-10 two at a time, first reached 500 at 66k-71k steps; with these defaults seeds 1-3 reached
    best means of 983, 993 and 969 (docs/acer.md); the paper's settings alone reach 527-541."""
    best, run = learns("acer.py", ["--env-id", "InvertedPendulum-v4", "--total-timesteps", "300000"], tmp_path, 500)
    saved = json.load(open(os.path.join(run, "args.json")))
    assert saved["task_family"] == "mujoco" and saved["learning_rate"] == 5e-4 and saved["value_coef"] == 0.01
    assert saved["scale_rewards"] and saved["rmsprop_eps"] == 1e-5 and saved["delta"] == 0.3
    assert best >= 500, best


@pytest.mark.e2e
def test_killed_run_resumes_and_ctrl_c_saves_the_updates_in_hand(tmp_path):
    """A run SIGKILLed after a checkpoint: its workers exit by themselves. `--resume` continues it: the same folder and
    arguments, the shared weights, the average network and RMSProp statistics, the step counter and the curves from
    the checkpoint's step. The replay is not kept: it refills from the resumed policy. Ctrl-C then stops the resumed
    run: each worker completes its segment's updates and returns, the main process saves the shared state at the
    step it names, says how to continue and exits with 130, leaving no worker behind (`kill_resume_stop`)."""
    budget = 2_000_000  # not spent within the test: the runs end by a kill and a Ctrl-C
    argv = flags(f"--env-id CartPole-v1 --num-workers 2 --num-envs 2 --total-timesteps {budget}")
    argv += flags("--log-interval 0.5 --seed 3")
    run, saved, final, _ = kill_resume_stop(
        "acer.py", argv, tmp_path, signal.SIGINT, kill_past=1000, past=2000, ready=learning_rate_logged
    )
    assert "avg_agent" in saved and 0 < saved["global_step"] < final["global_step"] < budget
    square_avg = [s["square_avg"] for s in saved["optimizer"]["state"].values()]
    assert any(g.abs().sum() > 0 for g in square_avg)  # the shared statistics, not fresh zeros
    assert final["args"]["num_envs"] == 2
    assert not torch.equal(saved["avg_agent"]["policy.weight"], final["avg_agent"]["policy.weight"])  # it moved on
    acc = events(run)
    lr = acc.Scalars("charts/learning_rate")
    after = [e for e in lr if e.step > saved["global_step"] + 1000]
    assert any(e.step <= saved["global_step"] for e in lr) and after
    assert all(abs(e.value - 1e-3) < 1e-9 for e in lr)  # ACER's learning rate is constant


def test_scale_rewards_statistics_take_every_steps_discounted_return():
    """--scale-rewards: the return statistics take R_t at every on-policy step (`assert_every_steps_return_scaled`),
    with acer's worker in this process (its average network and shared RMSProp made here)."""
    args, _ = acer.check_args(
        acer.parse_args("--env-id Pendulum-v1 --num-workers 1 --num-envs 1 --scale-rewards".split())
    )
    agent = acer.ContinuousAgent((3,), 1, args.hidden, args.policy_std, scale_rewards=True).share_memory()
    avg_agent = copy.deepcopy(agent)
    optimizer = acer.SharedRMSprop(agent.parameters(), args.learning_rate, args.rmsprop_alpha, args.rmsprop_eps)
    counter, lock, msg_q, halt = multiprocessing.Value("q", 0), multiprocessing.Lock(), queue.Queue(), threading.Event()
    run = dataclasses.replace(args, total_timesteps=400)
    sync = (counter, lock, msg_q, halt, threading.Barrier(1))
    assert_every_steps_return_scaled(agent, lambda: acer.train_worker(0, run, agent, avg_agent, optimizer, *sync))
