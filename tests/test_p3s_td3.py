"""p3s_td3.py: β adaptation (Eq. 76), the best-learner choice, the TD3 losses and the guided policy loss
(Eqs. 80-84) against plain loops, the shared replay, delayed rewards, and the script end to end."""

import copy
import dataclasses
import glob
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections import deque

import numpy as np
import pytest
import torch

import p3s_td3
from p3s_td3 import Args, DelayedReward, Learners, SharedReplay, adapt_beta, critic_loss, p3s_actor_loss
from p3s_td3 import policy_distance, select_best, smoothed_target_action, soft_update, td3_target
from tests.helpers import assert_logged, events, flags, learns, ROOT, assert_only_stop_lines
from tests.helpers import assert_two_ctrl_cs_end_cleanly, children, evaluate_cli, events_tags, run_script


# --------------------------------------------------------------------------------------------------------
# Math: the paper's equations as plain code.


def beta_reference(beta, d_spread, d_change, rho, d_min):
    """Eq. (76) as printed: β ← 2β if D_spread > max{ρ D_change, d_min} × 1.5; β ← β/2 if D_spread <
    max{ρ D_change, d_min} / 1.5; else β, then kept in [1e-3, 1e3]."""
    radius = d_min if d_min > rho * d_change else rho * d_change
    if d_spread > radius * 1.5:
        new = 2 * beta
    elif d_spread < radius / 1.5:
        new = beta / 2
    else:
        new = beta
    return min(max(new, 1e-3), 1e3)


@pytest.mark.parametrize(
    "beta, d_spread, d_change, d_min, expected",
    [
        (1.0, 0.20, 0.05, 0.02, 2.0),  # ρ D_change = 0.1 is the radius; spread 0.2 > 0.15: pull harder
        (1.0, 0.05, 0.05, 0.02, 0.5),  # 0.05 < 0.1 / 1.5: let them search
        (1.0, 0.12, 0.05, 0.02, 1.0),  # inside [radius / 1.5, 1.5 radius]: unchanged
        (1.0, 0.15, 0.05, 0.02, 1.0),  # exactly 1.5 radius: not greater, unchanged
        (1.0, 0.20, 0.001, 0.05, 2.0),  # d_min dominates (ρ D_change = 0.002): 0.2 > 0.075
        (1.0, 0.04, 0.001, 0.05, 1.0),  # d_min dominates: 0.04 within [0.0333, 0.075]
        (1.0, 0.03, 0.001, 0.05, 0.5),  # d_min dominates: 0.03 < 0.0333
        (800.0, 1.0, 0.0, 0.05, 1000.0),  # clipped at the upper bound
        (0.0015, 0.0, 0.0, 0.05, 0.001),  # clipped at the lower bound
    ],
)
def test_adapt_beta_cases(beta, d_spread, d_change, d_min, expected):
    got = adapt_beta(beta, d_spread, d_change, rho=2.0, d_min=d_min)
    assert got == pytest.approx(expected)
    assert got == pytest.approx(beta_reference(beta, d_spread, d_change, 2.0, d_min))


def test_adapt_beta_random_against_reference():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        beta = float(10 ** rng.uniform(-3, 3))
        d_spread, d_change = rng.exponential(0.05, 2)
        rho, d_min = float(rng.uniform(0.5, 4)), float(rng.choice([0.0, 0.02, 0.05]))
        assert adapt_beta(beta, d_spread, d_change, rho, d_min) == pytest.approx(
            beta_reference(beta, d_spread, d_change, rho, d_min)
        )


def test_best_learner_is_chosen_on_its_last_episodes():
    """Scripted training returns: learner 0 was best early but has declined, learner 2 improved lately. With E_r
    = 10 the recent window decides (the mean over all episodes would pick learner 0)."""
    e_r = 10
    histories = [
        [100.0] * 30 + [10.0] * 10,  # mean of all 40: 77.5, of the last 10: 10
        [50.0] * 40,  # 50 throughout
        [0.0] * 30 + [60.0] * 10,  # mean of all 40: 15, of the last 10: 60
        [],  # no finished episode yet: never chosen
    ]
    windows = []
    for h in histories:
        window = deque(maxlen=e_r)  # what a learner keeps (run_population)
        for r in h:
            window.append(r)
        windows.append(list(window))
    assert select_best(windows, previous_best=1) == 2
    assert int(np.argmax([np.mean(h) if h else -np.inf for h in histories])) == 0  # the whole history would differ
    assert select_best([[5.0], [5.0], [1.0]], previous_best=2) == 0  # ties: the lower index
    assert select_best([[], [], []], previous_best=1) == 1  # nothing to compare: the best stays
    assert select_best([[], [-3.0], []], previous_best=0) == 1


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_policy_distance_is_half_squared_difference_averaged_over_the_minibatch(reduction):
    """D = ½Δa² averaged over the action dimensions (the authors' code, the default) or summed (the text's ½‖·‖²),
    then over the minibatch."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(7, 3, generator=g), torch.randn(7, 3, generator=g)
    total = 0.0
    for i in range(7):
        per_state = 0.5 * sum((a[i, j] - b[i, j]) ** 2 for j in range(3))
        total += per_state / 3 if reduction == "mean" else per_state
    assert float(policy_distance(a, b, reduction)) == pytest.approx(float(total) / 7, rel=1e-6)
    assert float(policy_distance(a, b)) == pytest.approx(float(policy_distance(a, b, "sum")) / 3, rel=1e-6)


def test_td3_target_and_critic_loss_match_eqs_80_83():
    g = torch.Generator().manual_seed(1)
    B = 9
    r, q1n, q2n, q1, q2 = (torch.randn(B, generator=g, dtype=torch.float64) for _ in range(5))
    term = torch.tensor([0, 1, 0, 0, 1, 0, 0, 0, 0], dtype=torch.float64)
    y = td3_target(r, term, q1n, q2n, 0.9)
    for i in range(B):
        boot = 0.0 if term[i] else 0.9 * min(float(q1n[i]), float(q2n[i]))
        assert float(y[i]) == pytest.approx(float(r[i]) + boot)
    assert not y.requires_grad
    ref = (
        sum((float(y[i]) - float(q1[i])) ** 2 for i in range(B)) / B
        + sum((float(y[i]) - float(q2[i])) ** 2 for i in range(B)) / B
    )
    assert float(critic_loss(q1, q2, y)) == pytest.approx(ref)


def test_target_smoothing_noise_is_clipped_and_actions_stay_in_bounds():
    target = torch.tensor([[0.0, 0.9, -0.95]]).repeat(20000, 1)
    g = torch.Generator().manual_seed(2)
    out = smoothed_target_action(target, noise_std=0.2, noise_clip=0.5, generator=g)
    noise = out[:, 0]  # the first action has room on both sides: the noise itself
    assert noise.abs().max() <= 0.5 + 1e-7 and (noise.abs() > 0.499).any()  # clipping bites at ±c
    assert noise.std() == pytest.approx(0.19, abs=0.01)  # N(0, 0.2²) with 1.2% of the mass clipped
    assert out.max() <= 1.0 and out.min() >= -1.0 and (out[:, 1] == 1.0).any()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("guided", [True, False])
def test_actor_loss_gradient_matches_eq_84(guided, reduction):
    """∇φ of E_s[−Q_1(s, π_φ(s))] + 1{i≠b} β E_s[½‖π_φ(s) − π_b(s)‖²] written per sample, against the function
    (the squared difference averaged over the action dimensions, or summed)."""
    torch.manual_seed(3)
    args = Args(hidden=(16, 16))
    learner = Learners(1, 5, 2, args)  # a population of one: tensors [1, B, ...]
    with torch.no_grad():  # a π_b that differs from π_i
        for p in learner.best_actor.parameters():
            p.add_(0.3 * torch.randn_like(p))
    obs = torch.randn(1, 6, 5)
    beta = 0.7
    pi = learner.actor(obs)
    loss, distance = p3s_actor_loss(learner.qf.q1_only(obs, pi), pi, learner.best_actor(obs), beta, guided, reduction)
    grads = torch.autograd.grad(loss[0], list(learner.actor.parameters()))
    ref_loss = 0.0
    for i in range(6):  # a plain loop over the minibatch
        a = learner.actor(obs[:, i : i + 1])[0]
        term = -learner.qf.q1_only(obs[:, i : i + 1], a[None])[0, 0]
        if guided:
            squared = 0.5 * ((a[0] - learner.best_actor(obs[:, i : i + 1])[0, 0].detach()) ** 2).sum()
            term = term + beta * (squared / 2 if reduction == "mean" else squared)  # 2 action dimensions
        ref_loss = ref_loss + term / 6
    ref_grads = torch.autograd.grad(ref_loss, list(learner.actor.parameters()))
    for got, ref in zip(grads, ref_grads):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert float(loss[0].detach()) == pytest.approx(float(ref_loss.detach()), rel=1e-5)
    assert float(distance) > 0  # logged for every learner, guided or not
    assert all(p.grad is None for p in learner.best_actor.parameters())  # π_b gets nothing


def test_actor_loss_per_learner_guides_all_but_the_best():
    """Eq. (84) for a population, one minibatch per learner (`[N, B, ...]`): learner i's loss is its own
    E_s[−Q_1] plus β E_s[½‖π_i − π_b‖²] only where i ≠ b; the distance is reported for every learner."""
    g = torch.Generator().manual_seed(9)
    q, pi, best = torch.randn(3, 5, generator=g), torch.randn(3, 5, 2, generator=g), torch.randn(3, 5, 2, generator=g)
    guided = torch.tensor([False, True, True])  # learner 0 is the best
    loss, distance = p3s_actor_loss(q, pi, best, 0.7, guided)  # the default: ½Δa² averaged over the 2 dimensions
    for i in range(3):
        d = sum(0.5 * float(((pi[i, s] - best[i, s]) ** 2).sum()) / 2 for s in range(5)) / 5
        ref = -sum(float(q[i, s]) for s in range(5)) / 5 + (0.7 * d if i != 0 else 0.0)
        assert float(loss[i]) == pytest.approx(ref, rel=1e-5) and float(distance[i]) == pytest.approx(d, rel=1e-5)


class SpyAdam(torch.optim.Adam):
    """Adam that records the gradients it is asked to apply."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.seen = []

    def step(self, closure=None):
        self.seen.append([p.grad.clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


def _replay_batch(N, B):
    """A random minibatch `[N, B, ...]` for each of N learners on 4-dim states and 2-dim actions in [-1, 1]:
    (obs, actions, rewards, next_obs, terminated)."""
    obs, actions, rewards = torch.randn(N, B, 4), torch.rand(N, B, 2) * 2 - 1, torch.randn(N, B)
    return obs, actions, rewards, torch.randn(N, B, 4), (torch.rand(N, B) < 0.3).float()


def test_learner_update_applies_eq_83_and_84_with_delay_and_targets():
    """`Learners.update` (a population of one): the Q gradient of Eq. (83) with Eq. (80)'s target (same noise
    draw), the policy gradient of Eq. (84) only on every d-th update, the targets moved by Eq. (82) only then;
    π_b unchanged."""
    torch.manual_seed(4)
    args = Args(hidden=(16, 16), policy_delay=2)
    g = torch.Generator().manual_seed(5)
    learner = Learners(1, 4, 2, args, generator=g)
    learner.qf_opt = SpyAdam(learner.qf.parameters(), lr=1e-3)
    learner.actor_opt = SpyAdam(learner.actor.parameters(), lr=1e-3)
    with torch.no_grad():
        for p in learner.best_actor.parameters():
            p.add_(0.3 * torch.randn_like(p))
    best_before = [p.clone() for p in learner.best_actor.parameters()]
    B = 8
    for step in range(1, 5):
        batch = _replay_batch(1, B)
        obs, actions, rewards, next_obs, term = batch
        targets_before = [
            p.clone() for p in list(learner.qf_target.parameters()) + list(learner.actor_target.parameters())
        ]
        online_q_before = [p.clone() for p in learner.qf.parameters()]
        state = g.get_state()
        # the reference, computed before the update from the same generator state
        g_ref = torch.Generator().manual_seed(0)
        g_ref.set_state(state)
        with torch.no_grad():
            na = learner.actor_target(next_obs) + (torch.randn(B, 2, generator=g_ref) * 0.2).clamp(-0.5, 0.5)
            na = na.clamp(-1, 1)
            q1n, q2n = learner.qf_target(next_obs, na)
            y = rewards + 0.99 * (1 - term) * torch.minimum(q1n, q2n)
        q1, q2 = learner.qf(obs, actions)
        ref_q = torch.autograd.grad(((y - q1) ** 2).mean() + ((y - q2) ** 2).mean(), list(learner.qf.parameters()))
        g.set_state(state)
        learner.update(batch, beta=0.5, guided=torch.tensor([True]))
        for got, ref in zip(learner.qf_opt.seen[-1], ref_q):
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6)
        policy_step = step % 2 == 0
        assert len(learner.actor_opt.seen) == step // 2
        moved = [
            not torch.equal(a, b)
            for a, b in zip(
                targets_before, list(learner.qf_target.parameters()) + list(learner.actor_target.parameters())
            )
        ]
        assert all(moved) if policy_step else not any(moved)
        if policy_step:  # θ' ← (1 − τ) θ' + τ θ with the online Q after this update's step
            for before, after, online in zip(targets_before, learner.qf_target.parameters(), learner.qf.parameters()):
                torch.testing.assert_close(after, 0.995 * before + 0.005 * online)
        del online_q_before
    for before, after in zip(best_before, learner.best_actor.parameters()):
        assert torch.equal(before, after)


def test_soft_update_matches_eq_82():
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    wa, wb = a.weight.detach().clone(), b.weight.detach().clone()
    soft_update(a, b, 0.1)
    torch.testing.assert_close(a.weight.detach(), 0.9 * wa + 0.1 * wb)


def test_learners_start_alike():
    """Algorithm 1, line 1: every learner starts from the same policy and Q-functions, each learner's slice an
    `nn.Linear` of Xavier's initialisation (zero biases, |w| within the bound), and the targets and π_b start as
    copies."""
    torch.manual_seed(3)
    learners = Learners(3, 5, 2, Args(hidden=(16, 8)))
    for net, target in ((learners.actor, learners.actor_target), (learners.qf, learners.qf_target)):
        for p, p_target in zip(net.parameters(), target.parameters()):
            torch.testing.assert_close(p, p_target)
            assert torch.equal(p[0], p[1]) and torch.equal(p[0], p[2])
            if p.dim() == 3:  # a weight [N, out, in]: Xavier-uniform's bound sqrt(6 / (in + out))
                assert p.abs().max() <= math.sqrt(6 / (p.shape[1] + p.shape[2]))
            else:
                assert not p.any()
    torch.testing.assert_close(policy_params(learners.best_actor, 0), policy_params(learners.actor, 0))


def policy_params(actor, i):
    return torch.cat([p[i].flatten() for p in actor.parameters()])


def test_adopt_makes_a_frozen_copy_of_the_best_policy():
    """π_b is copied at selection time: later updates of the best learner do not move it; π_old is the learner's
    own policy at that time."""
    torch.manual_seed(6)
    args = Args(hidden=(8,))
    learners = Learners(2, 3, 1, args)  # learner 0 will be the best, learner 1 the other

    with torch.no_grad():
        for p in learners.actor.parameters():
            p[0].add_(1.0)
    vector = policy_params(learners.actor, 0).clone()
    with torch.no_grad():
        for p in learners.actor.parameters():  # the other learner has moved since it was built
            p[1].mul_(0.5)
    learners.adopt(0)
    old = policy_params(learners.actor, 1).clone()
    torch.testing.assert_close(policy_params(learners.best_actor, 0), vector)
    torch.testing.assert_close(policy_params(learners.old_actor, 1), old)
    with torch.no_grad():
        for p in learners.actor.parameters():  # both learners keep learning
            p.add_(5.0)
    torch.testing.assert_close(policy_params(learners.best_actor, 0), vector)
    torch.testing.assert_close(policy_params(learners.old_actor, 1), old)  # π_old stays where the period started
    assert not any(p.requires_grad for p in learners.best_actor.parameters())


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_period_distances_average_the_periods_policy_steps(reduction):
    """D_spread's and D_change's terms as the authors' code has them: each learner's D(π_i, π_b) and D(π_i, π_old,i)
    on every policy step's own minibatch, with the policy as that step found it, averaged over the period; a selection
    (`adopt`) starts a new period; a period without a policy step has none."""
    torch.manual_seed(10)
    N, B, args = 3, 6, Args(hidden=(8,), distance=reduction)
    learners = Learners(N, 4, 2, args)
    learners.adopt(0)
    assert learners.period_distances() is None
    spread, change = [], []
    for k in range(6):
        obs = torch.randn(N, B, 4)
        batch = (obs, torch.rand(N, B, 2) * 2 - 1, torch.randn(N, B), torch.randn(N, B, 4), torch.zeros(N, B))
        if learners.updates % 2 == 1:  # this update steps the policies: the reference, from the policies before
            with torch.no_grad():
                pi = learners.actor(obs)
                per_learner = []
                for i in range(N):
                    best = learners.best_actor(obs[i : i + 1])[0]
                    old = learners.old_actor(obs)[i]
                    per_learner.append(
                        [float(policy_distance(pi[i], best, reduction)), float(policy_distance(pi[i], old, reduction))]
                    )
            spread.append([d[0] for d in per_learner])
            change.append([d[1] for d in per_learner])
        learners.update(batch, 0.5, torch.tensor([False, True, True]))
    assert len(spread) == 3
    got = learners.period_distances()
    torch.testing.assert_close(got[0], torch.tensor(spread).mean(0), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got[1], torch.tensor(change).mean(0), rtol=1e-5, atol=1e-7)
    assert float(got[1].sum()) > 0  # the policies moved during the period
    learners.adopt(1)
    assert learners.period_distances() is None


def learner_slice(module, i):
    """Learner i's state of a stacked module (`[N, ...]` parameters), for a module of one learner."""
    return {k: v[i : i + 1].clone() for k, v in module.state_dict().items()}


def test_population_update_is_n_separate_td3_updates():
    """One update of the stacked population equals N separate learners' updates, each on its own minibatch, the
    best one unguided: the same Q-functions, policies, targets and Adam moments after a policy step."""
    torch.manual_seed(8)
    N, B, args = 3, 8, Args(hidden=(16, 16), policy_noise=0.0)  # no smoothing noise: no draws to line up
    population = Learners(N, 4, 2, args)
    with torch.no_grad():  # learners that differ, as they do after some training
        for net in (population.actor, population.qf, population.actor_target, population.qf_target):
            for p in net.parameters():
                p.add_(0.2 * torch.randn_like(p))
    singles = []
    for i in range(N):
        single = Learners(1, 4, 2, args)
        for name in ("actor", "qf", "actor_target", "qf_target", "old_actor"):
            getattr(single, name).load_state_dict(learner_slice(getattr(population, name), i))
        single.best_actor.load_state_dict(population.best_actor.state_dict())
        singles.append(single)
    guided = torch.tensor([False, True, True])  # learner 0 is the best
    for _ in range(2):  # a Q step, then a Q and policy step (d = 2)
        batch = _replay_batch(N, B)
        stats = population.update(batch, 0.8, guided)
        for i, single in enumerate(singles):
            single_stats = single.update(tuple(x[i : i + 1] for x in batch), 0.8, guided[i : i + 1])
            for k, v in single_stats.items():
                torch.testing.assert_close(stats[k][i : i + 1], v, rtol=1e-5, atol=1e-6)
    assert "actor_loss" in stats
    for i, single in enumerate(singles):
        for name in ("actor", "qf", "actor_target", "qf_target"):
            for k, v in getattr(single, name).state_dict().items():
                torch.testing.assert_close(
                    getattr(population, name).state_dict()[k][i : i + 1], v, rtol=1e-5, atol=1e-6
                )
        for opt in ("actor_opt", "qf_opt"):
            for p_pop, p_single in zip(
                getattr(population, opt).param_groups[0]["params"], getattr(single, opt).param_groups[0]["params"]
            ):
                for moment in ("exp_avg", "exp_avg_sq"):
                    torch.testing.assert_close(
                        getattr(population, opt).state[p_pop][moment][i : i + 1],
                        getattr(single, opt).state[p_single][moment],
                        rtol=1e-5,
                        atol=1e-7,
                    )


def test_update_with_its_own_optimisers_matches_plain_adam():
    """`Learners.update` as the run makes it (fused Adam over the stacked parameters) against the same two updates
    (a Q step, then a Q and policy step) by a plain for-loop Adam: the same parameters after each. Fused Adam on
    the CPU takes a gradient laid out like its parameter; a gradient with other strides (e.g. a transposed
    view, as `torch.autograd.grad` returns for a `Linears` weight) would be read in the wrong order."""
    torch.manual_seed(9)
    args = Args(hidden=(16, 16), policy_noise=0.0)
    learners = Learners(3, 4, 2, args)
    reference = copy.deepcopy(learners)
    reference.actor_opt = torch.optim.Adam(reference.actor.parameters(), lr=1e-3, foreach=False)
    reference.qf_opt = torch.optim.Adam(reference.qf.parameters(), lr=1e-3, foreach=False)
    guided = torch.tensor([False, True, True])
    for _ in range(2):
        batch = _replay_batch(3, 8)
        learners.update(batch, 0.8, guided)
        reference.update(batch, 0.8, guided)
        for name in ("actor", "qf", "actor_target", "qf_target"):
            for (k, v), ref in zip(
                getattr(learners, name).state_dict().items(), getattr(reference, name).state_dict().values()
            ):
                torch.testing.assert_close(v, ref, rtol=1e-5, atol=1e-7, msg=f"{name}.{k}")


def test_bf16_runs_the_hidden_layers_in_bfloat16_and_the_output_layers_in_float32():
    """--bf16: every network of the population computes its hidden layers in bfloat16 and its output layer in
    float32. The Q-values and actions come out as float32 and differ from the float32 networks' by the hidden
    layers' rounding; Q-values near 300 are not on bfloat16's grid (steps of 2 there), which they would be if the
    output layer ran in bfloat16. The policy's gradient through Q_1 and a Q step's gradient point where float32's do
    (cosine above 0.99 per parameter), and the update keeps the parameters float32 and finite."""
    torch.manual_seed(3)
    N, obs_dim, action_dim = 2, 5, 3
    learners = {bf16: Learners(N, obs_dim, action_dim, Args(hidden=(64, 48), bf16=bf16)) for bf16 in (False, True)}
    learners[True].qf.load_state_dict(learners[False].qf.state_dict())
    learners[True].actor.load_state_dict(learners[False].actor.state_dict())
    for name in ("actor", "qf", "actor_target", "qf_target", "best_actor", "old_actor"):
        assert getattr(learners[True], name).bf16 and not getattr(learners[False], name).bf16, name
    with torch.no_grad():
        for bf16 in (False, True):  # Q-values near 300: the output layers' bias
            learners[bf16].qf.q1[-1].bias.add_(300.0)
            learners[bf16].qf.q2[-1].bias.add_(300.0)
    obs, actions = torch.randn(N, 256, obs_dim), torch.rand(N, 256, action_dim) * 2 - 1
    with torch.no_grad():
        q32, q16 = (learners[bf16].qf(obs, actions)[0] for bf16 in (False, True))
        a32, a16 = (learners[bf16].actor(obs) for bf16 in (False, True))
    assert q16.dtype == a16.dtype == torch.float32
    assert not torch.equal(q16, q32) and not torch.equal(a16, a32)  # the hidden layers did run in bfloat16
    torch.testing.assert_close(q16, q32, rtol=0, atol=0.5)
    torch.testing.assert_close(a16, a32, rtol=0, atol=0.05)
    assert (q16.bfloat16().float() != q16).float().mean() > 0.9  # the output layer's sum kept float32's resolution
    batch = (obs[:, :32], actions[:, :32], torch.randn(N, 32), torch.randn(N, 32, obs_dim), torch.zeros(N, 32))
    for bf16 in (False, True):  # from the same parameters: the policy's gradient through Q_1, then a Q step
        learners[bf16].qf.q1_only(obs, learners[bf16].actor(obs)).sum().backward()
        learners[bf16].update(batch, 1.0, torch.tensor([False, True]))
    for net in ("actor", "qf"):  # those gradients against float32's
        for (k, p), p32 in zip(
            getattr(learners[True], net).named_parameters(), getattr(learners[False], net).parameters()
        ):
            assert p.dtype == torch.float32 and bool(torch.isfinite(p).all()), k
            assert float(torch.nn.functional.cosine_similarity(p.grad.flatten(), p32.grad.flatten(), 0)) > 0.99, k


def test_periodic_evaluation_plays_each_learners_own_deterministic_policy(monkeypatch):
    """Sec. 4.1's evaluation: env e of the N x E evaluation envs is played by learner e // E's policy, without
    noise, its actions mapped to the env's box; each learner's score is the mean of its own E episodes."""
    torch.manual_seed(0)
    N, E, obs_dim = 3, 2, 5
    actor = p3s_td3.Actor(obs_dim, 2, (8,), N)
    low, high = np.array([-2.0, 0.0], np.float32), np.array([2.0, 1.0], np.float32)
    obs = np.random.default_rng(0).normal(size=(N * E, obs_dim)).astype(np.float32)

    def fake_evaluate(make_policy, env_id, episodes, num_envs, seed):
        assert episodes == num_envs == N * E
        actions = make_policy(num_envs)(obs, np.zeros(num_envs), np.ones(num_envs, bool))
        for e in range(num_envs):
            own = p3s_td3.Actor(obs_dim, 2, (8,))
            own.load_state_dict(actor.learner_state(e // E))
            a = own(torch.from_numpy(obs[e])[None, None])[0, 0].detach().numpy()
            np.testing.assert_allclose(actions[e], low + (a + 1) * 0.5 * (high - low), rtol=1e-5, atol=1e-6)
        return [10.0 * (e // E) + e % E for e in range(num_envs)]  # learner i's episodes: 10 i and 10 i + 1

    monkeypatch.setattr(p3s_td3, "evaluate", fake_evaluate)
    means = p3s_td3.evaluate_learners(actor, "Hopper-v4", E, 0, low, high)
    assert means == [0.5, 10.5, 20.5]


def test_shared_replay_samples_uniformly_over_every_learners_rows():
    replay = SharedReplay(capacity=300, num_learners=3, obs_dim=1, action_dim=1)
    for learner, k in ((0, 100), (1, 50), (2, 10)):
        obs = torch.full((k, 1), float(learner))
        replay.add(torch.full((k,), learner), obs, torch.zeros(k, 1), torch.arange(k).float(), obs, torch.zeros(k))
    g = torch.Generator().manual_seed(7)
    (obs, _, rewards, _, _), writers = replay.sample((32000,), g)
    assert torch.equal(obs[:, 0].long(), writers)  # each row comes from the part its writer owns
    counts = torch.bincount(writers, minlength=3).float() / 32000
    torch.testing.assert_close(counts, torch.tensor([100, 50, 10]) / 160.0, atol=0.01, rtol=0)  # ∝ rows written
    assert rewards[writers == 2].max() == 9  # only rows written are sampled
    # the ring: learner 2 overwrites its oldest rows once its part (100 rows) is full
    replay.add(
        torch.full((120,), 2),
        torch.full((120, 1), 2.0),
        torch.zeros(120, 1),
        100 + torch.arange(120).float(),
        torch.full((120, 1), 2.0),
        torch.zeros(120),
    )
    assert int(replay.sizes()[2]) == 100
    (_, _, rewards, _, _), writers = replay.sample((20000,), g)
    assert rewards[writers == 2].min() >= 30  # rows 10..29 of the second batch overwrote everything older


def test_replay_rows_of_several_learners_in_one_add_go_to_each_learners_ring_in_order():
    """One step of the population stores the rows of every learner at once (some envs at a reset step store
    nothing): each row lands in its writer's part, after that learner's earlier rows, in order."""
    replay = SharedReplay(capacity=12, num_learners=3, obs_dim=1, action_dim=1)
    writers = torch.tensor([0, 2, 0, 1, 2, 0])
    rewards = torch.arange(6).float()
    for _ in range(2):  # the second add wraps learner 0's ring (4 rows) after 6 of its rows
        replay.add(writers, rewards[:, None], torch.zeros(6, 1), rewards, rewards[:, None], torch.zeros(6))
    assert replay.writes.tolist() == [6, 2, 4]
    assert replay.rewards[0].tolist() == [2.0, 5.0, 5.0, 0.0]  # rows 0, 2, 5, then 0, 2, 5 into a ring of 4
    assert replay.rewards[1, :2].tolist() == [3.0, 3.0] and replay.rewards[2].tolist() == [1.0, 4.0, 1.0, 4.0]


def test_delayed_reward_gives_the_sum_every_f_steps_or_at_the_end():
    delayed = DelayedReward(num_envs=2, delay=3)
    rewards = np.array([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [4.0, 0.0], [5.0, 7.0], [6.0, 8.0]])
    ends = np.array([[0, 0], [0, 1], [0, 0], [0, 0], [1, 0], [0, 0]], bool)
    real = np.array([[1, 1], [1, 1], [1, 0], [1, 1], [1, 1], [0, 1]], bool)  # env 1 resets after its end
    out = np.stack([delayed(r, e, m) for r, e, m in zip(rewards, ends, real)])
    np.testing.assert_allclose(out[:, 0], [0, 0, 6, 0, 9, 0])  # every 3 steps, then at the episode's end
    np.testing.assert_allclose(out[:, 1], [0, 30, 0, 0, 0, 15])  # at the end; the reset step counts for nothing
    passthrough = DelayedReward(num_envs=2, delay=0)
    np.testing.assert_allclose(
        passthrough(np.array([1.5, -2.0]), np.zeros(2, bool), np.array([True, False])), [1.5, 0.0]
    )


def authors_random_steps(n_initial, num_learners, epoch_length=1000):
    """The authors' code (td3/algos/base.py:102-111): random actions until an epoch starts with
    epoch_length x epoch >= n_initial // N; returns the random steps per learner."""
    epoch = 0
    while not epoch_length * epoch >= n_initial // num_learners:
        epoch += 1
    return epoch * epoch_length


def task_defaults(env_id, delayed, num_learners=4, text=False):
    """`defaults_for`'s (T_initial per learner, rows of D before the first update, d_min) of a run of these flags."""
    preset = "paper" if text else "family"
    args = p3s_td3.Args(env_id=env_id, num_learners=num_learners, reward_delay=20 if delayed else 0, preset=preset)
    values = p3s_td3.defaults_for(args, {"--num-learners"})[2]
    return values["t_initial"], values["learning_starts"], values["d_min"]


def test_task_defaults_follow_the_authors_code_and_appendix_i():
    """Defaults: the random phase and the learning start of the authors' code (n_initial_exploration_steps 1000 or
    10000 rows, examples/variants_p3s.py), d_min of App. I; `text`: Sec. 4.1's T_initial, no update before it."""
    for env_id, n_initial in (("Hopper-v4", 1000), ("Walker2d-v4", 1000), ("HalfCheetah-v4", 10000), ("Ant-v4", 10000)):
        for N in (1, 2, 4, 8):
            t_initial, starts, _ = task_defaults(env_id, delayed=False, num_learners=N)
            assert (t_initial, starts) == (authors_random_steps(n_initial, N), n_initial)
    assert task_defaults("Hopper-v4", False, 4) == (1000, 1000, 0.05)
    assert task_defaults("HalfCheetah-v4", False, 4) == (3000, 10000, 0.05)
    assert task_defaults("Walker2d-v4", delayed=False) == (1000, 1000, 0.02)
    assert task_defaults("HalfCheetah-v4", delayed=True) == (3000, 10000, 0.02)
    assert task_defaults("Ant-v4", delayed=True, num_learners=1) == (10000, 10000, 0.05)
    assert task_defaults("Hopper-v4", False, 4, text=True) == (250, 0, 0.05)
    assert task_defaults("Ant-v4", False, 4, text=True) == (2500, 0, 0.02)


def resolved(argv):
    """The arguments a run takes from `argv`: family or paper defaults, then the values derived from the task."""
    args = p3s_td3.parse_args(argv)
    p3s_td3.check_args(args)
    return dataclasses.asdict(args), args


def test_defaults_follow_the_authors_code_and_preset_paper_the_text():
    """`--env-id` alone: N updates of each learner per step of its own, updates from 1000 rows of D, random
    actions for 1000 steps per learner, D averaged over action dimensions and over the period's updates, no
    guidance before the first selection, Xavier weights. `--preset paper`: one update per step, T_initial 250 with
    no update before it, the squared norm, guidance from the start. A flag wins."""
    derived, args = resolved(["--env-id", "Hopper-v4"])
    assert (derived["updates_per_step"], derived["t_initial"], derived["learning_starts"]) == (4, 1000, 1000)
    assert (args.distance, args.guide_first_period) == ("mean", False)
    derived, _ = resolved(["--env-id", "Hopper-v4", "--num-learners", "2"])
    assert derived["updates_per_step"] == 2
    derived, args = resolved(["--env-id", "Hopper-v4", "--preset", "paper"])
    assert (derived["updates_per_step"], derived["t_initial"], derived["learning_starts"]) == (1, 250, 0)
    assert (args.distance, args.guide_first_period) == ("sum", True)
    derived, args = resolved(["--env-id", "Hopper-v4", "--preset", "paper", "--distance", "mean"])
    assert args.distance == "mean" and args.guide_first_period
    derived, _ = resolved(["--env-id", "Hopper-v4", "--updates-per-step", "1", "--t-initial", "250"])
    assert (derived["updates_per_step"], derived["t_initial"], derived["learning_starts"]) == (1, 250, 1000)


# --------------------------------------------------------------------------------------------------------
# The script end to end.


def check_selections(run, num_learners, rho, d_min):
    """population.jsonl: every selection picked the best recent score, and β followed Eq. (76) from 1."""
    lines = [json.loads(line) for line in open(os.path.join(run, "population.jsonl"))]
    beta, best = 1.0, 0
    for rec in lines:
        assert rec["previous_best"] == best
        beta = adapt_beta(beta, rec["d_spread"], rec["d_change"], rho, d_min)
        assert rec["beta"] == pytest.approx(beta)
        scores = [-math.inf if s is None or math.isnan(s) else s for s in rec["scores"]]
        best = int(np.argmax(scores)) if max(scores) > -math.inf else best
        assert rec["best"] == best and len(rec["scores"]) == num_learners
    return lines


@pytest.mark.e2e
@pytest.mark.parametrize("delay", [0, 20])
def test_smoke_halfcheetah(tmp_path, delay):
    """Two learners on HalfCheetah-v4 (1000-step episodes), with and without delayed rewards."""
    argv = "--env-id HalfCheetah-v4 --num-learners 2 --total-timesteps 2400 --t-initial 300 --learning-starts 600"
    argv += " --best-period 100 --hidden 32 32 --buffer-size 10000 --eval-episodes 1 --save-model --log-interval 1"
    run = run_script("p3s_td3.py", flags(argv, f"--reward-delay {delay} --eval-interval 1000"), tmp_path)
    summary = json.load(open(os.path.join(run, "summary.json")))
    assert summary["total_timesteps"] == 2400 and summary["num_learners"] == 2
    evaluations = [json.loads(line) for line in open(os.path.join(run, "evaluations.jsonl"))]
    assert [e["step"] for e in evaluations] == [1000, 2000, 2400]  # every R_eval steps of both learners, the end
    assert all(len(e["per_learner"]) == 2 and e["eval_return"] == max(e["per_learner"]) for e in evaluations)
    assert summary["eval_mean_return"] == evaluations[-1]["eval_return"]  # the last one is the run's score
    # N = 2 updates of each learner per step of its own (the default) from t = 300 (600 rows of D) to 1200
    assert summary["updates_per_learner"] == [1802, 1802]
    for fraction in summary["foreign_sample_fraction"]:  # each learner learns from the other's experience
        assert 0.35 < fraction < 0.65
    for fraction in summary["rewarded_fraction"]:
        assert (0.04 < fraction < 0.06) if delay else fraction > 0.99  # 1/20 of the stored rewards are non-zero
    saved = json.load(open(os.path.join(run, "args.json")))
    assert saved["d_min"] == (0.02 if delay else 0.05) and saved["t_initial"] == 300
    assert (saved["updates_per_step"], saved["learning_starts"]) == (2, 600)
    lines = check_selections(run, 2, 2.0, saved["d_min"])
    assert len(lines) == 10  # at t = 300, 400, ..., 1200
    assert_logged(
        run,
        "charts/episodic_return charts/learner_0/episodic_return charts/learner_1/episodic_return charts/SPS",
        "stats/beta stats/d_spread stats/d_change stats/best_learner",
        "losses/learner_0/qf_loss losses/learner_1/actor_loss charts/eval_return charts/learner_1/eval_return",
    )
    checkpoint = torch.load(os.path.join(run, "model.pt"), weights_only=False)
    assert len(checkpoint["actors"]) == 2 and checkpoint["actor_config"]["action_dim"] == 6
    assert evaluate_cli(run)["episodes"] == 2


@pytest.mark.e2e
def test_smoke_one_learner_is_td3_with_video(tmp_path):
    """--num-learners 1: no selection, no guidance, no β; a classic-control task records its evaluation."""
    argv = "--env-id Pendulum-v1 --num-learners 1 --total-timesteps 700 --t-initial 200 --learning-starts 0"
    argv += " --best-period 100 --hidden 32 --eval-episodes 1 --capture-video"
    run = run_script("p3s_td3.py", flags(argv), tmp_path)
    summary = json.load(open(os.path.join(run, "summary.json")))
    # --learning-starts 0: updates after the random phase (the text), one per step (N = 1)
    assert summary["updates_per_learner"] == [500] and summary["foreign_sample_fraction"] == [0.0]
    assert not os.path.exists(os.path.join(run, "population.jsonl"))  # no selection
    tags = events_tags(run)
    assert "stats/beta" not in tags and "charts/learner_0/episodic_return" in tags
    assert os.path.getsize(os.path.join(run, "videos", "eval_episode_0.png")) > 1000


@pytest.mark.e2e
def test_learns_pendulum_with_its_family_defaults(tmp_path):
    """`--env-id Pendulum-v1` alone (the classic-control family: 2 learners, T_initial 1000, updates from 2000 rows,
    2 per learner step, 20k steps of both learners together): within them the better learner's deterministic policy
    scores at least −300 over 10 episodes of an evaluation every 4,000 steps (`learns`; random policies score about
    −1200). Ten runs on 2 loaded cores, seeds 1-10 two at a time: −923 to −1272 at the 4,000-step evaluation, −126
    to −194 at the 8,000-step one, where each stopped (docs: seeds 1-3 scored −191.9, −170.9, −186.3 at the end)."""
    best, run = learns("p3s_td3.py", ["--env-id", "Pendulum-v1"], tmp_path, -300, evaluations=True)
    saved = json.load(open(os.path.join(run, "args.json")))
    assert saved["task_family"] == "classic" and (saved["num_learners"], saved["t_initial"]) == (2, 1000)
    assert (saved["updates_per_step"], saved["learning_starts"]) == (2, 2000) and saved["total_timesteps"] == 20_000
    assert best >= -300, best
    returns = events_tags(run, "charts/episodic_return")
    assert np.mean(returns[:10]) < -900  # it started from random behaviour


SMALL = flags(
    "--env-id Pendulum-v1 --num-learners 2 --t-initial 100 --learning-starts 200",
    "--best-period 50 --hidden 32 --eval-episodes 0 --log-interval 0.5 --seed 3",
)


def start(argv, tmp_path, console="console.log", **popen):
    """Starts p3s_td3.py (stdout in `tmp_path / console`, stderr piped, run folders in `tmp_path / "runs"`) and returns
    it once its first progress line shows."""
    console = tmp_path / console
    cmd = [sys.executable, "p3s_td3.py", *argv, "--run-dir", str(tmp_path / "runs")]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(console, "w"), stderr=subprocess.PIPE, text=True, **popen)
    deadline = time.time() + 120
    while not last_step(console):  # a progress line, not the header (whose defaults name updates-per-step)
        assert proc.poll() is None and time.time() < deadline, console.read_text()[-2000:]
        time.sleep(0.2)
    return proc


def last_step(console):
    """The step of the last complete progress line in the file `console` (`start`'s), 0 before the first."""
    lines = [x for x in console.read_text().split("\n")[:-1] if x.startswith("step ")]
    return int(lines[-1].split()[1].split("/")[0]) if lines else 0


@pytest.mark.e2e
def test_one_process_and_a_second_ctrl_c_stops_at_once(tmp_path):
    """The population runs in the main process (envpool's threads, no worker process); Ctrl-C twice, 0.3 s apart:
    exit 130 at once, no traceback."""
    proc = start([*SMALL, "--total-timesteps", "100000000"], tmp_path)
    try:
        assert children(proc.pid) == []
        assert_two_ctrl_cs_end_cleanly(proc)
    finally:
        if proc.poll() is None:
            proc.kill()


def checkpoint_past(proc, pattern, t, timeout=300):
    """The path and contents of the checkpoint matching `pattern` once its time step is past `t` (polled; a checkpoint
    is written through a rename: whole or not yet there)."""
    deadline = time.time() + timeout
    while proc.poll() is None and time.time() < deadline:
        found = glob.glob(pattern)
        if found:
            saved = torch.load(found[0], weights_only=False)
            if saved["t"] > t:
                return found[0], saved
        time.sleep(0.2)
    raise AssertionError(f"no checkpoint past time step {t} within {timeout} s (exit {proc.poll()})")


def resume_and_stop(run, tmp_path, console, group):
    """`--resume run` until its console shows a step of its own (its updates done), then Ctrl-C to it, or SIGTERM to
    its whole process group (`timeout`, a job scheduler): the time step in hand completes with all its updates (the
    checkpoint's step and update count agree), its checkpoint is written, exit status 130, how to continue, nothing
    else on stderr. Returns the checkpoint."""
    before = torch.load(os.path.join(run, "checkpoint.pt"), weights_only=False)["global_step"]
    path = tmp_path / console
    cmd, out = [sys.executable, "p3s_td3.py", "--resume", run], open(path, "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.PIPE, text=True, start_new_session=group)
    try:
        deadline = time.time() + 300  # a hang guard
        while proc.poll() is None and time.time() < deadline and last_step(path) <= before:
            time.sleep(0.2)  # a step of this session, past the checkpoint it resumed from
        assert last_step(path) > before, path.read_text()[-2000:]
        if group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130 and f"p3s_td3.py --resume {run}" in err, err[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    saved = torch.load(os.path.join(run, "checkpoint.pt"), weights_only=False)
    assert f"checkpoint at step {saved['global_step']}: continue with" in err
    assert_only_stop_lines(err)
    assert saved["global_step"] == 2 * saved["t"] > before
    assert saved["learners"]["updates"] == 2 * max(saved["t"] - 99, 0)  # N = 2 per step from t = 100
    return saved


@pytest.mark.e2e
def test_killed_run_resumes_stops_on_ctrl_c_or_sigterm_and_resumes_to_its_end(tmp_path):
    """A run SIGKILLed after a checkpoint past its first updates continues with --resume: the learners' networks, Adam
    states, π_b, π_old and replay parts, β and the best learner, the random generators and the step counters; curves
    go on from the checkpoint's step and population.jsonl is appended to. The resumed run, once its console shows a
    step of its own, gets Ctrl-C, and the next resumed one SIGTERM to its whole process group (`resume_and_stop`: the
    time step in hand completes with all its updates, its checkpoint is written, exit 130, how to continue); the
    signals go on what the runs wrote, not after a sleep (a loaded machine can take longer than any fixed time to get
    there). A last --resume runs the budget out in the same folder."""
    argv = [*SMALL, "--total-timesteps", "1600", "--checkpoint-interval", "0.5", "--save-model"]
    proc = start(argv, tmp_path)
    try:
        ckpt, _ = checkpoint_past(proc, os.path.join(str(tmp_path), "runs", "*", "checkpoint.pt"), 100)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    run = os.path.dirname(ckpt)
    assert evaluate_cli(run, episodes=1)["episodes"] == 1  # the killed run's model.pt, written with its checkpoint
    saved = torch.load(ckpt, weights_only=False)
    t = saved["t"]
    assert 100 < t < 800 and saved["global_step"] == 2 * t
    assert saved["learners"]["updates"] == 2 * (t - 99)  # N = 2 per step from t = 100 (200 rows of D)
    for part in saved["replay"]:  # each learner's part of the shared replay
        assert 0 < part["writes"] <= t  # reset steps are not stored
        assert len(part["rewards"]) == min(part["writes"], 1_000_000 // 2)
    assert not os.path.exists(os.path.join(run, "summary.json"))  # it did not finish
    selections_before = open(os.path.join(run, "population.jsonl")).read().splitlines()
    interrupted = resume_and_stop(run, tmp_path, "console_ctrl_c.log", group=False)
    terminated = resume_and_stop(run, tmp_path, "console_sigterm.log", group=True)
    assert saved["global_step"] < interrupted["global_step"] < terminated["global_step"] < 1600
    assert run_script("p3s_td3.py", ["--resume", run], tmp_path / "runs", timeout=600) == run
    summary = json.load(open(os.path.join(run, "summary.json")))
    assert summary["total_timesteps"] == 1600
    # the updates went on from the saved count across all four sessions: N = 2 per step from t = 100 (200 rows of D)
    assert summary["updates_per_learner"] == [2 * (800 - 99)] * 2
    final = torch.load(os.path.join(run, "checkpoint.pt"), weights_only=False)
    events_files = [f for f in os.listdir(run) if f.startswith("events.out.tfevents")]
    expected = "args.json checkpoint.pt model.pt summary.json population.jsonl".split() + events_files
    assert final["t"] == 800 and sorted(os.listdir(run)) == sorted(expected)
    selections = open(os.path.join(run, "population.jsonl")).read().splitlines()
    assert selections[: len(selections_before)] == selections_before and len(selections) > len(selections_before)
    acc = events(run)
    steps = [e.step for e in acc.Scalars("stats/beta")]
    assert steps == sorted(steps) and steps[-1] == 1600
    assert any(s <= saved["global_step"] for s in steps) and any(s > saved["global_step"] for s in steps)


def test_thread_choice_keeps_the_faster_thread_count_and_tries_the_other_again():
    """`--threads 0`: beside other work (one thread faster) the updates settle on one thread, alone (the cores
    faster) on the cores, each other choice timed again for a window every `every` seconds; a given count stays."""
    before = torch.get_num_threads()

    def run(choice, cost, seconds, now):  # cost: seconds per time step with k threads
        used, end = [], now + seconds
        while now < end:
            used.append(torch.get_num_threads())
            choice.record(cost[used[-1]], now)
            now += cost[used[-1]]
        return used, now

    try:
        choice = p3s_td3.ThreadChoice([2, 1], window=1.0, every=30.0)
        assert torch.get_num_threads() == 2
        used, now = run(choice, {2: 0.040, 1: 0.024}, 120.0, 0.0)
        assert torch.get_num_threads() == 1 and used.count(2) < 0.15 * len(used)
        used, now = run(choice, {2: 0.016, 1: 0.024}, 120.0, now)
        assert torch.get_num_threads() == 2 and used[len(used) // 2 :].count(1) < 0.1 * len(used) / 2
        fixed = p3s_td3.ThreadChoice([1])
        fixed.record(5.0, 5.0)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_saved_model_holds_every_learners_own_policy():
    """model.pt (`saved_model`): `actors[i]`, read into a one-learner `Actor`, is learner i; `actor` is the best's: the
    last evaluation's best, or before any evaluation the selected b; the actions' box is the task's."""
    torch.manual_seed(10)
    learners = Learners(3, 4, 1, Args(hidden=(8, 8)))
    with torch.no_grad():
        for p in learners.actor.parameters():
            p.add_(torch.randn_like(p))
    args = Args(env_id="Pendulum-v1", num_learners=3, hidden=(8, 8))
    model = p3s_td3.saved_model(args, dict(learners=learners, means=[1.0, 0.0, 5.0], best=1), 100)
    obs = torch.randn(1, 5, 4)
    for i in range(3):
        actor = p3s_td3.Actor(**model["actor_config"])
        actor.load_state_dict(model["actors"][i])
        torch.testing.assert_close(actor(obs)[0], learners.actor(obs.expand(3, -1, -1))[i])
    assert model["actor"] is model["actors"][2] and model["best_learner"] == 2 and model["action_high"] == [2.0]
    assert p3s_td3.saved_model(args, dict(learners=learners, means=[], best=1), 100)["best_learner"] == 1
