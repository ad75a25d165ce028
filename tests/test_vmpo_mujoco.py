"""vmpo_mujoco.py: the decoupled Gaussian KL of Appendix C, the KL projection of Otto et al. (2021), the λ-returns,
the multipliers, the minibatch E-step, the learner's step, and the script end to end. The E-step's reference
(`weights_reference`) is shared with test_vmpo_atari.py."""

import copy
import dataclasses
import itertools
import json
import math
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import vmpo_mujoco
from vmpo_mujoco import gaussian_kl_parts, kl_constraint_loss, n_step_targets, project_gaussian
from vmpo_mujoco import value_targets, vmpo_loss, vmpo_weights
from tests.helpers import torchrun, assert_logged, flags, learns, evaluate_cli, events_tags
from tests.helpers import killed_and_resumed, run_script
from evaluate import main as eval_main
from tests.test_vmpo_atari import weights_reference
from common.envs import flatten_obs, make_env, to_env_action


# --------------------------------------------------------------------------------------------------------
# Math, each against a plain computation written from the paper.


def _unrolls(T=7, B=4):
    """Unrolls `[T+1, B]` with terminations, a truncation (env 1 at row 3) and a reset step at row 0 (env 3)."""
    g = torch.Generator().manual_seed(1)
    rewards = torch.randn(T + 1, B, generator=g, dtype=torch.float64)
    values = torch.randn(T + 1, B, generator=g, dtype=torch.float64)
    terminated, ended = torch.zeros(T + 1, B, dtype=torch.bool), torch.zeros(T + 1, B, dtype=torch.bool)
    terminated[2, 0] = terminated[5, 0] = terminated[7, 2] = True
    ended[2, 0] = ended[5, 0] = ended[7, 2] = ended[3, 1] = ended[0, 3] = True  # env 1 truncated at row 3
    return values, rewards, terminated, ended


def _n_step_reference(values, rewards, terminated, ended, gamma, ell, b, horizon):
    """Eq. (1)'s G^(horizon)_ℓ of env b by a plain loop: the rewards r_{k+1} discounted by γ (0 after a termination),
    a reset step k (x_k ended an episode) adding V(x_k) and nothing after it, V(x_{ℓ+horizon}) at the end."""
    total, scale = 0.0, 1.0
    for k in range(ell, ell + horizon):
        if ended[k, b]:  # the reset step: V(x_k), nothing after it
            return total + scale * float(values[k, b])
        total += scale * float(rewards[k + 1, b])
        scale = 0.0 if terminated[k + 1, b] else scale * gamma
    return total + scale * float(values[ell + horizon, b])


@pytest.mark.parametrize("lambda_", [None, 1.0])
def test_n_step_targets_match_eq1_plain_loop(lambda_):
    """Eq. (1) on unrolls `[T+1, B]`: a termination cuts the return, a reset step k (x_k ended an episode) takes
    G_k = V(x_k), so the step before a truncation bootstraps from its last observation; λ = 1 (given or the
    default) is Eq. (1)'s n-step return."""
    values, rewards, terminated, ended = _unrolls()
    T, B, gamma = values.shape[0] - 1, values.shape[1], 0.75
    flags = (terminated, ended, gamma) if lambda_ is None else (terminated, ended, gamma, lambda_)
    returns = n_step_targets(values, rewards, *flags)
    for b, ell in itertools.product(range(B), range(T)):
        total = _n_step_reference(values, rewards, terminated, ended, gamma, ell, b, T - ell)
        assert math.isclose(float(returns[ell, b]), total, rel_tol=1e-12, abs_tol=1e-12)


@pytest.mark.parametrize("lambda_", [0.0, 0.5, 0.95])
def test_n_step_targets_lambda_returns_match_plain_loops(lambda_):
    """λ < 1: G_ℓ = r_ℓ+1 + γ_ℓ [(1 − λ) V(x_ℓ+1) + λ G_ℓ+1] (γ_ℓ = 0 after a termination), G_T = V(x_T), a reset step
    G_k = V(x_k), by a plain double loop; and, written independently, the λ-weighted mixture of the n-step returns
    (Sutton and Barto, Eq. 12.3): G^λ_ℓ = (1 − λ) Σ_{n=1}^{N−1} λ^{n−1} G^(n)_ℓ + λ^{N−1} G^(N)_ℓ, N = T − ℓ."""
    values, rewards, terminated, ended = _unrolls()
    T, B, gamma = values.shape[0] - 1, values.shape[1], 0.75
    returns = n_step_targets(values, rewards, terminated, ended, gamma, lambda_)
    for b in range(B):
        recursion, g_next = [0.0] * T, float(values[T, b])
        for ell in reversed(range(T)):
            if ended[ell, b]:  # the reset step
                g = float(values[ell, b])
            else:
                discount = 0.0 if terminated[ell + 1, b] else gamma
                v_next = float(values[ell + 1, b])
                g = float(rewards[ell + 1, b]) + discount * ((1 - lambda_) * v_next + lambda_ * g_next)
            recursion[ell] = g_next = g
        for ell in range(T):
            N = T - ell
            n_step = [_n_step_reference(values, rewards, terminated, ended, gamma, ell, b, n) for n in range(1, N + 1)]
            mixture = (1 - lambda_) * sum(lambda_ ** (n - 1) * n_step[n - 1] for n in range(1, N)) + lambda_ ** (
                N - 1
            ) * n_step[N - 1]
            assert math.isclose(float(returns[ell, b]), recursion[ell], rel_tol=1e-12, abs_tol=1e-12)
            assert math.isclose(float(returns[ell, b]), mixture, rel_tol=1e-10, abs_tol=1e-12)
    if lambda_ == 0.0:  # one-step TD targets: r + γ V(x_ℓ+1) where nothing ended
        assert math.isclose(float(returns[0, 1]), float(rewards[1, 1]) + gamma * float(values[1, 1]), rel_tol=1e-12)
    assert not torch.allclose(returns, n_step_targets(values, rewards, terminated, ended, gamma))  # λ matters


def _kl_eq23_24_25(mu1, std1, mu2, std2):
    """Eqs. (23)-(25) with dense matrices: KL(N(μ1, Σ1) ‖ N(μ2, Σ2)) and its mean and covariance parts, where
    N(μ1, Σ1) is the target (old) policy."""
    s1, s2 = np.diag(std1**2), np.diag(std2**2)
    d = len(mu1)
    diff = mu2 - mu1
    full = 0.5 * (
        diff @ np.linalg.inv(s2) @ diff
        + np.trace(np.linalg.inv(s2) @ s1)
        - d
        + np.log(np.linalg.det(s2) / np.linalg.det(s1))
    )
    kl_mu = 0.5 * diff @ np.linalg.inv(s1) @ diff  # Eq. (24): Σ_old
    kl_sigma = 0.5 * (np.trace(np.linalg.inv(s2) @ s1) - d + np.log(np.linalg.det(s2) / np.linalg.det(s1)))
    return full, kl_mu, kl_sigma


def test_gaussian_kl_parts_match_appendix_c():
    """Each part equals Eqs. (24)/(25) by dense linear algebra; the mean part uses the *target's* covariance; the
    two sum to the full KL of Eq. (23) where the means or the covariances agree, and to the KL of the two
    'half-moved' Gaussians N(μ, Σ_t), N(μ_t, Σ) otherwise."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        d = int(rng.integers(1, 7))
        mu1, mu2 = rng.normal(size=d), rng.normal(size=d)
        std1, std2 = np.exp(rng.normal(size=d) * 0.7), np.exp(rng.normal(size=d) * 0.7)
        t = [torch.tensor(x, dtype=torch.float64) for x in (mu1, std1, mu2, std2)]
        kl_mu, kl_sigma = gaussian_kl_parts(*t)
        full, ref_mu, ref_sigma = _kl_eq23_24_25(mu1, std1, mu2, std2)
        assert math.isclose(float(kl_mu), ref_mu, rel_tol=1e-10)
        assert math.isclose(float(kl_sigma), ref_sigma, rel_tol=1e-10, abs_tol=1e-12)
        # with the online covariance instead the mean part would differ: the test can tell
        assert not math.isclose(ref_mu, 0.5 * ((mu2 - mu1) ** 2 / std2**2).sum(), rel_tol=1e-6)
        # KL_μ is the full KL of N(μ_t, Σ_t) ‖ N(μ, Σ_t); KL_Σ that of N(μ_t, Σ_t) ‖ N(μ_t, Σ)
        assert math.isclose(_kl_eq23_24_25(mu1, std1, mu2, std1)[0], ref_mu, rel_tol=1e-10)
        assert math.isclose(_kl_eq23_24_25(mu1, std1, mu1, std2)[0], ref_sigma, rel_tol=1e-10, abs_tol=1e-12)
        same_mean = gaussian_kl_parts(t[0], t[1], t[0], t[3])
        assert math.isclose(float(sum(same_mean)), _kl_eq23_24_25(mu1, std1, mu1, std2)[0], rel_tol=1e-10)
        same_cov = gaussian_kl_parts(t[0], t[1], t[2], t[1])
        assert math.isclose(float(sum(same_cov)), _kl_eq23_24_25(mu1, std1, mu2, std1)[0], rel_tol=1e-10)
        # for the same covariance, torch's own closed form agrees with the sum
        ref = torch.distributions.kl_divergence(
            torch.distributions.Normal(t[0], t[1]), torch.distributions.Normal(t[2], t[1])
        ).sum()
        assert math.isclose(float(sum(same_cov)), float(ref), rel_tol=1e-10)


def test_gaussian_kl_parts_are_decoupled():
    """KL_μ moves only the mean, KL_Σ only the standard deviation; the target gets no gradient."""
    g = torch.Generator().manual_seed(2)
    tm, ts = torch.randn(5, 3, generator=g, requires_grad=True), torch.rand(5, 3, generator=g) + 0.5
    m, s = torch.randn(5, 3, generator=g, requires_grad=True), (torch.rand(5, 3, generator=g) + 0.5).requires_grad_()
    kl_mu, kl_sigma = gaussian_kl_parts(tm, ts, m, s)
    assert kl_mu.shape == kl_sigma.shape == (5,)
    gm, gs = torch.autograd.grad(kl_mu.sum(), [m, s], allow_unused=True)
    assert gm is not None and (gm != 0).all() and (gs is None or (gs == 0).all())
    gm, gs = torch.autograd.grad(kl_sigma.sum(), [m, s], allow_unused=True)
    assert (gm is None or (gm == 0).all()) and (gs != 0).all()
    assert torch.autograd.grad(kl_mu.sum() + kl_sigma.sum(), tm, allow_unused=True)[0] is None


@pytest.mark.parametrize("shape,eta,use_mask", [((7, 6), 0.8, False), ((9, 4), 2.5, True)])
def test_vmpo_weights_match_brute_force(shape, eta, use_mask):
    g = torch.Generator().manual_seed(shape[0])
    adv = torch.randn(*shape, generator=g, dtype=torch.float64) * 2
    mask = (torch.rand(*shape, generator=g) > 0.3) if use_mask else None
    psi, eta_loss = vmpo_weights(adv, torch.tensor(eta, dtype=torch.float64), 0.01, mask)
    ref_psi, ref_loss = weights_reference(adv, eta, 0.01, mask)
    torch.testing.assert_close(psi, ref_psi, rtol=1e-12, atol=1e-12)
    assert math.isclose(float(eta_loss), ref_loss, rel_tol=1e-12) and not psi.requires_grad


EPS_MU, EPS_SIGMA = 0.05, 0.01  # the projection's bounds in its tests


def _kl_sigma_plain(target_std, std):
    """Eq. (25) for diagonal Gaussians by a plain loop: ½ Σ_i [σ_t,i² / σ_i² − 1 − log(σ_t,i² / σ_i²)]."""
    return 0.5 * sum(t**2 / s**2 - 1 - math.log(t**2 / s**2) for t, s in zip(target_std, std))


def _kl_mu_plain(target_mean, target_std, mean):
    """Eq. (24) for diagonal Gaussians by a plain loop: ½ Σ_i (μ_i − μ_t,i)² / σ_t,i²."""
    return 0.5 * sum((m - t) ** 2 / s**2 for m, t, s in zip(mean, target_mean, target_std))


def _projection_states(d, per_case=4, seed=0):
    """float64 states of dimension d, `per_case` of each of: inside both bounds, outside KL_μ's alone, outside KL_Σ's
    alone, outside both; each KL 0.1-0.7 or 1.5-20 times its ε (no state near a bound's kink). The standard
    deviations move both ways (σ_t/σ above and below 1 in one state). Returns (target_mean, target_std, mean, std)
    `[4 per_case, d]`, and which states are outside KL_μ's bound and KL_Σ's."""
    rng = np.random.default_rng(seed + 100 * d)
    rows, out_mu, out_sigma = [], [], []
    for mu_out, sigma_out in itertools.product((False, True), repeat=2):
        for _ in range(per_case):
            tm, ts = rng.normal(size=d), np.exp(0.5 * rng.normal(size=d))
            u, c = rng.normal(size=d), rng.uniform(1.5, 20) if mu_out else rng.uniform(0.1, 0.7)
            m = tm + ts * u * math.sqrt(2 * c * EPS_MU / (u @ u))  # KL_μ = c ε_μ
            w, c = rng.normal(size=d), rng.uniform(1.5, 20) if sigma_out else rng.uniform(0.1, 0.7)
            low, high = 0.0, 10.0  # log σ = log σ_t + x w with KL_Σ = c ε_Σ (KL_Σ rises with x > 0)
            for _ in range(200):
                mid = (low + high) / 2
                low, high = (low, mid) if _kl_sigma_plain(ts, ts * np.exp(mid * w)) > c * EPS_SIGMA else (mid, high)
            rows.append((tm, ts, m, ts * np.exp(low * w)))
            out_mu.append(mu_out)
            out_sigma.append(sigma_out)
    tensors = [torch.tensor(np.stack(x)) for x in zip(*rows)]
    return (*tensors, torch.tensor(out_mu), torch.tensor(out_sigma))


def _projection_reference(tm, ts, m, s, eps_mu, eps_sigma):
    """Otto et al. (2021)'s KL projection of one state's diagonal Gaussian by plain loops, from the formulas: the mean
    μ_t + (μ − μ_t) sqrt(ε_μ / KL_μ) where KL_μ > ε_μ; the precision σ_t⁻² + τ (σ⁻² − σ_t⁻²) with τ ∈ (0, 1) found by
    200 bisection steps on KL_Σ(τ) = ε_Σ where KL_Σ > ε_Σ. Returns (mean, std, τ) as lists (τ = 1: not projected)."""
    d = len(m)
    kl_mu = _kl_mu_plain(tm, ts, m)
    scale = math.sqrt(eps_mu / kl_mu) if kl_mu > eps_mu else 1.0
    mean = [tm[i] + (m[i] - tm[i]) * scale for i in range(d)]
    precision = lambda tau: [1 / ts[i] ** 2 + tau * (1 / s[i] ** 2 - 1 / ts[i] ** 2) for i in range(d)]  # noqa: E731
    std_at = lambda tau: [1 / math.sqrt(p) for p in precision(tau)]  # noqa: E731
    if _kl_sigma_plain(ts, s) <= eps_sigma:
        return mean, list(s), 1.0
    low, high = 0.0, 1.0
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (low, mid) if _kl_sigma_plain(ts, std_at(mid)) > eps_sigma else (mid, high)
    tau = (low + high) / 2
    return mean, std_at(tau), tau


@pytest.mark.parametrize("d", range(1, 7))
def test_project_gaussian_matches_otto_et_al_plain_loops(d):
    """Otto et al. (2021)'s projection onto the decoupled bounds, per state: (i) a Gaussian inside both bounds comes
    back as it is (and each part is left alone where only the other bound is exceeded); (ii) a projected part sits
    on its bound, KL_μ(π_t ‖ π̃) = ε_μ, KL_Σ(π_t ‖ π̃) = ε_Σ; (iii) the mean is μ_t + (μ − μ_t) sqrt(ε_μ / KL_μ), the
    precision σ_t⁻² + τ (σ⁻² − σ_t⁻²) with one τ ∈ (0, 1) for all dimensions (so between the target's and the
    online's in each), the root of a plain bisection."""
    tm, ts, m, s, out_mu, out_sigma = _projection_states(d)
    pm, ps = project_gaussian(m, s, tm, ts, EPS_MU, EPS_SIGMA)
    assert pm.dtype == ps.dtype == torch.float64 and pm.shape == ps.shape == m.shape
    torch.testing.assert_close(pm[~out_mu], m[~out_mu], rtol=1e-12, atol=1e-12)  # (i)
    torch.testing.assert_close(ps[~out_sigma], s[~out_sigma], rtol=1e-12, atol=1e-12)
    for k in range(m.shape[0]):
        tm_k, ts_k, m_k, s_k = (x[k].tolist() for x in (tm, ts, m, s))
        assert (_kl_mu_plain(tm_k, ts_k, m_k) > EPS_MU) == bool(out_mu[k])  # the states are what they claim
        assert (_kl_sigma_plain(ts_k, s_k) > EPS_SIGMA) == bool(out_sigma[k])
        ref_mean, ref_std, tau = _projection_reference(tm_k, ts_k, m_k, s_k, EPS_MU, EPS_SIGMA)
        if out_mu[k]:  # (ii), (iii) for the mean
            assert math.isclose(_kl_mu_plain(tm_k, ts_k, pm[k].tolist()), EPS_MU, rel_tol=1e-6)
            scale = math.sqrt(EPS_MU / _kl_mu_plain(tm_k, ts_k, m_k))
            for i in range(d):
                assert math.isclose(float(pm[k, i]), tm_k[i] + (m_k[i] - tm_k[i]) * scale, rel_tol=1e-12, abs_tol=1e-12)
        if out_sigma[k]:  # (ii), (iii) for the covariance
            assert math.isclose(_kl_sigma_plain(ts_k, ps[k].tolist()), EPS_SIGMA, rel_tol=1e-6)
            assert 0 < tau < 1
            for i in range(d):
                assert math.isclose(float(ps[k, i]), ref_std[i], rel_tol=1e-9)
                prec, prec_t, prec_online = 1 / float(ps[k, i]) ** 2, 1 / ts_k[i] ** 2, 1 / s_k[i] ** 2
                lo, hi = min(prec_t, prec_online), max(prec_t, prec_online)
                assert lo * (1 - 1e-12) <= prec <= hi * (1 + 1e-12)
                if abs(prec_online - prec_t) > 1e-3 * prec_t:  # the same τ in every dimension
                    assert math.isclose((prec - prec_t) / (prec_online - prec_t), tau, rel_tol=1e-6)
    assert out_mu.any() and out_sigma.any() and (~out_mu & ~out_sigma).any() and (out_mu & out_sigma).any()


@pytest.mark.parametrize("d", range(1, 7))
def test_project_gaussian_gradient_is_the_implicit_function_theorem_s(d):
    """(iv) The projection's gradient w.r.t. the online mean and standard deviation (float64): the closed form for
    the mean, and for the covariance τ's gradient by the implicit function theorem (one Newton step from the
    bisection's root). torch's finite differences (step 1e-6) against it, with tolerances 100x tighter than
    gradcheck's defaults (atol 1e-5, rtol 1e-3): after the bisection's 30 steps the Newton step leaves the forward
    value exact to ~1e-13 on these states, so the finite bisection needs no looser tolerance."""
    tm, ts, m, s, _, _ = _projection_states(d, per_case=3, seed=1)
    project = lambda mean, std: project_gaussian(mean, std, tm, ts, EPS_MU, EPS_SIGMA)  # noqa: E731
    assert torch.autograd.gradcheck(project, (m.requires_grad_(), s.requires_grad_()), atol=1e-7, rtol=1e-5)


def _agent(obs_dim=5, action_dim=2, **kw):
    """A small Agent whose Gaussian varies with the state (the script's policy layer starts at zero)."""
    agent = vmpo_mujoco.Agent(obs_dim, action_dim, hidden=(16,), **kw)
    with torch.no_grad():
        agent.policy.weight.normal_(0.0, 0.3)
    return agent


def _batch(agent, T=6, B=8, seed=0):
    """A batch of unrolls `[T+1, B, ...]` as `ActorPool.next_batch` gives it (π_target's Gaussian is not in it)."""
    g = torch.Generator().manual_seed(seed)
    d, obs_dim = agent.action_dim, agent.obs_norm.mean.shape[0]
    return {
        "obs": torch.randn(T + 1, B, obs_dim, generator=g),
        "reward": torch.randn(T + 1, B, generator=g),
        "ended": torch.zeros(T + 1, B, dtype=torch.bool),
        "terminated": torch.zeros(T + 1, B, dtype=torch.bool),
        "action": torch.randn(T + 1, B, d, generator=g),
    }


def _args(**kw):
    base = dict(gamma=0.9, gae_lambda=1.0, eps_eta=0.01, eps_alpha_mu=0.007, eps_alpha_sigma=1.6e-5)
    base.update(update_epochs=1, minibatch_size=0, num_minibatches=1, projection=False, regression_coef=0.0)
    base.update(squash=False, **kw)
    return SimpleNamespace(**base)


def _flat(x):
    """`[T+1, B, ...] -> [B·T, ...]`: rows 0..T-1 (row T only bootstraps), unroll by unroll (learner_step's order)."""
    return x[:-1].transpose(0, 1).reshape(-1, *x.shape[2:])


def _flat_loss(agent, batch, multipliers, args, target=None, **settings):
    """learner_step's loss on the whole batch in one step, written out: the targets of `value_targets` (PopArt moved
    toward them), then `vmpo_loss` on the flattened states. π_target: `target(mean, std)` of the online Gaussian
    (default: that Gaussian itself, detached). Returns the VmpoLoss, value_targets' stats, the online Gaussian and
    the mask of the real steps."""
    returns, stats = value_targets(agent, batch, args, move_popart=True)
    obs, actions, mask = _flat(batch["obs"]), _flat(batch["action"]), ~_flat(batch["ended"])
    mean, std, features = agent(obs)
    target_mean, target_std = (mean.detach(), std.detach()) if target is None else target(mean.detach(), std.detach())
    value_norm = agent.popart(features)[..., 0]
    returns_norm = agent.popart.normalize(returns.transpose(0, 1).reshape(-1), 0)  # [T, B] -> [B·T], as `_flat`
    duals = (*multipliers.parameters(), args.eps_eta, args.eps_alpha_mu, args.eps_alpha_sigma)
    out = vmpo_loss(mean, std, target_mean, target_std, actions, value_norm, returns_norm, mask, *duals, **settings)
    return out, stats, mean, std, mask


def _learner_state(agent, lr=1e-4):
    multipliers = vmpo_mujoco.LagrangeMultipliers()
    optimizer = torch.optim.Adam([*agent.parameters(), *multipliers.parameters()], lr=lr)
    return dict(agent=agent, multipliers=multipliers, optimizer=optimizer, update=0)


def test_value_targets_and_learner_step_log_explained_variance_and_each_bound_s_use():
    """`value_targets`: the λ-returns G of the online V (unnormalised), `losses/explained_variance` CleanRL's
    1 − Var(G − V)/Var(G) over the real steps, `stats/value_mean`, PopArt's statistics left alone unless asked.
    `learner_step`: `stats/kl_*_ratio` each KL over its ε; how far the updated policy moved from π_target in the
    real states (`stats/kl_*_max_ratio`), its largest per-dimension mean σ, the share of means outside the box; the
    passes (epochs x minibatches, an Adam step each); PopArt moved once (first pass), not at every pass. As plain
    computations."""
    torch.manual_seed(3)
    T, B = 6, 8
    agent = _agent(5, 2)
    with torch.no_grad():
        agent.policy.bias[0] = 0.8  # some means beyond the box's 1, some within
    target = copy.deepcopy(agent)
    with torch.no_grad():
        target.policy.bias[:2] += 0.3  # π_target's mean moved
    batch = _batch(agent, T, B)
    batch["ended"][2, :3] = True
    batch["obs"][2, :3] *= 10  # the reset steps' observations far out: the largest KLs, which the stats leave out
    args = _args(eps_eta=0.02, eps_alpha_mu=0.05, eps_alpha_sigma=1e-3, gae_lambda=0.8)
    mu, sigma = agent.popart.mu.clone(), agent.popart.sigma.clone()
    returns, stats = value_targets(agent, batch, args)
    with torch.no_grad():
        v = agent.popart.unnormalize(agent.popart(agent(batch["obs"])[2])[..., 0], 0)
    g = n_step_targets(v, batch["reward"], batch["terminated"], batch["ended"], args.gamma, 0.8)
    torch.testing.assert_close(returns, g)
    assert torch.equal(agent.popart.mu, mu) and torch.equal(agent.popart.sigma, sigma)  # move_popart=False
    assert float(stats["stats/popart_mu"]) == float(mu[0]) and float(stats["stats/popart_sigma"]) == float(sigma[0])
    real = ~batch["ended"][:-1]
    gs, vs = g[real].tolist(), v[:-1][real].tolist()
    var = lambda x: sum((a - sum(x) / len(x)) ** 2 for a in x) / (len(x) - 1)  # noqa: E731
    expected = 1 - var([a - b for a, b in zip(gs, vs)]) / var(gs)
    assert float(stats["losses/explained_variance"]) == pytest.approx(expected, rel=1e-5)
    assert float(stats["stats/value_mean"]) == pytest.approx(sum(vs) / len(vs), rel=1e-5)

    state = _learner_state(agent)
    args = _args(eps_eta=0.02, eps_alpha_mu=0.05, eps_alpha_sigma=1e-3, update_epochs=2, minibatch_size=16)
    once = copy.deepcopy(agent)  # PopArt after one move toward the first pass's targets
    once.obs_norm.update(batch["obs"][:-1])
    value_targets(once, batch, args, move_popart=True)
    stats = vmpo_mujoco.learner_step(state, target, batch, args)
    assert torch.equal(agent.popart.mu, once.popart.mu) and torch.equal(agent.popart.sigma, once.popart.sigma)
    assert not torch.equal(agent.popart.mu, mu)
    for kl, eps in (("kl_psi", 0.02), ("kl_mu", 0.05), ("kl_sigma", 1e-3)):
        assert float(stats[f"stats/{kl}_ratio"]) == pytest.approx(float(stats[f"stats/{kl}"]) / eps, rel=1e-6)
    assert float(stats["stats/kl_mu_ratio"]) > 0.1  # the target's mean was moved: a ratio that can be told from 0
    # the observation statistics took rows 0..T-1; 48 states in minibatches of 16, twice: 6 Adam steps
    assert state["update"] == 1 and float(agent.obs_norm.count) == T * B
    assert float(stats["stats/passes"]) == 6
    assert {int(s["step"]) for s in state["optimizer"].state.values()} == {6}
    with torch.no_grad():
        obs, mask = _flat(batch["obs"]), ~_flat(batch["ended"])
        (target_mean, target_std, _), (mean, std, _) = target(obs), agent(obs)
    real_states = [k for k in range(obs.shape[0]) if mask[k]]
    kl_mu = [_kl_mu_plain(target_mean[k].tolist(), target_std[k].tolist(), mean[k].tolist()) for k in real_states]
    kl_sigma = [_kl_sigma_plain(target_std[k].tolist(), std[k].tolist()) for k in real_states]
    assert float(stats["stats/kl_mu_max_ratio"]) == pytest.approx(max(kl_mu) / 0.05, rel=1e-5)
    assert float(stats["stats/kl_sigma_max_ratio"]) == pytest.approx(max(kl_sigma) / 1e-3, rel=1e-4)
    std_means = [sum(float(std[k, i]) for k in real_states) / len(real_states) for i in range(2)]
    assert float(stats["stats/policy_std_max"]) == pytest.approx(max(std_means), rel=1e-6)
    all_states = range(obs.shape[0])  # the reset steps would count: the test can tell
    assert max(_kl_mu_plain(target_mean[k].tolist(), target_std[k].tolist(), mean[k].tolist()) for k in all_states) > (
        1.5 * max(kl_mu)
    )
    assert float(std.mean(0).max()) != pytest.approx(max(std_means), rel=1e-3)
    outside = [abs(float(mean[k, i])) > 1.0 for k in real_states for i in range(2)]
    assert float(stats["stats/outside_box"]) == pytest.approx(sum(outside) / len(outside), rel=1e-6)
    assert 0 < sum(outside) < len(outside)


@pytest.mark.parametrize("moved", ["mean", "std"])
def test_alpha_mu_and_alpha_sigma_move_the_right_way(moved):
    """Eq. (26): when the target's mean is far from the online mean (KL_μ > ε_αμ) and its covariance equal
    (KL_Σ = 0 < ε_αΣ), a step on the loss raises α_μ and lowers α_Σ; the other way round when only the standard
    deviation moved."""
    torch.manual_seed(0)
    agent = vmpo_mujoco.Agent(5, 3, hidden=(16,))
    m = vmpo_mujoco.LagrangeMultipliers(1.0, 1.0, 1.0)
    batch = _batch(agent)
    move = (lambda mu, sd: (mu + 0.5, sd)) if moved == "mean" else (lambda mu, sd: (mu, sd * 1.5))
    out = _flat_loss(agent, batch, m, _args(), target=move)[0]
    if moved == "mean":
        assert out.kl_mu.item() > 0.007 and out.kl_sigma.item() == pytest.approx(0, abs=1e-9)
    else:
        assert out.kl_sigma.item() > 1.6e-5 and out.kl_mu.item() == pytest.approx(0, abs=1e-9)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    out.loss.backward()
    assert math.isclose(float(m.alpha_mu.grad), 0.007 - out.kl_mu.item(), rel_tol=1e-5)
    assert math.isclose(float(m.alpha_sigma.grad), 1.6e-5 - out.kl_sigma.item(), rel_tol=1e-5)
    opt.step()
    up_mu, up_sigma = m.alpha_mu.item() > 1.0, m.alpha_sigma.item() > 1.0
    assert (up_mu, up_sigma) == ((True, False) if moved == "mean" else (False, True))


def test_kl_terms_pull_the_policy_back_with_stop_gradient_alphas():
    """The policy's gradient from the KL terms is sg[α_μ] ∇KL_μ + sg[α_Σ] ∇KL_Σ, averaged over unmasked states: the
    two parts as `kl_constraint_loss` gives them, and vmpo_loss's L_αμ + L_αΣ on flat states `[N, d]`."""
    torch.manual_seed(1)
    g = torch.Generator().manual_seed(1)
    tm, ts = torch.randn(4, 3, 2, generator=g), torch.rand(4, 3, 2, generator=g) + 0.5
    m, s = (
        torch.randn(4, 3, 2, generator=g, requires_grad=True),
        (torch.rand(4, 3, 2, generator=g) + 0.5).requires_grad_(),
    )
    mask = torch.rand(4, 3, generator=g) > 0.3
    a_mu, a_sigma = torch.tensor(2.0, requires_grad=True), torch.tensor(7.0, requires_grad=True)
    kl_mu, kl_sigma = gaussian_kl_parts(tm, ts, m, s)
    loss = kl_constraint_loss(kl_mu, a_mu, 0.01, mask)[0] + kl_constraint_loss(kl_sigma, a_sigma, 1e-5, mask)[0]
    gm, gs = torch.autograd.grad(loss, [m, s])
    m2, s2 = m.detach().clone().requires_grad_(), s.detach().clone().requires_grad_()
    k2 = gaussian_kl_parts(tm, ts, m2, s2)
    ref = 2.0 * k2[0][mask].mean() + 7.0 * k2[1][mask].mean()
    rm, rs = torch.autograd.grad(ref, [m2, s2])
    torch.testing.assert_close(gm, rm)
    torch.testing.assert_close(gs, rs)
    assert (gm[~mask] == 0).all() and (gs[~mask] == 0).all()
    # the same through vmpo_loss on the flattened states, whose α gradients are ε − KL
    flat = lambda x: x.reshape(12, *x.shape[2:])  # noqa: E731
    m3, s3 = flat(m.detach()).requires_grad_(), flat(s.detach()).requires_grad_()
    zeros = torch.zeros(12)
    out = vmpo_loss(m3, s3, flat(tm), flat(ts), flat(tm), zeros, zeros, flat(mask), torch.tensor(1.0), a_mu, a_sigma,
                    0.01, 0.01, 1e-5)  # fmt: skip
    gm3, gs3, ga_mu, ga_sigma = torch.autograd.grad(out.alpha_mu_loss + out.alpha_sigma_loss, [m3, s3, a_mu, a_sigma])
    torch.testing.assert_close(gm3, flat(rm))
    torch.testing.assert_close(gs3, flat(rs))
    assert math.isclose(float(ga_mu), 0.01 - k2[0][mask].mean().item(), rel_tol=1e-5)
    assert math.isclose(float(ga_sigma), 1e-5 - k2[1][mask].mean().item(), rel_tol=1e-4, abs_tol=1e-9)


def test_policy_loss_is_not_decoupled():
    """Eq. (26)'s L_π = −Σ ψ log N(a; μ, σ) with the online μ and σ together ("we do not decouple the policy loss",
    App. C), not MPO's −Σ ψ [log N(a; μ, σ_t) + log N(a; μ_t, σ)]; reset steps (masked) take no part. Value and
    gradients against a plain loop, on flat states `[N, d]`."""
    g = torch.Generator().manual_seed(3)
    N, d = 20, 2
    tm, ts = torch.randn(N, d, generator=g), torch.rand(N, d, generator=g) + 0.5
    m = (tm + 0.3 * torch.randn(N, d, generator=g)).requires_grad_()
    s = (ts * (1 + 0.2 * torch.rand(N, d, generator=g))).requires_grad_()
    a, returns = torch.randn(N, d, generator=g), torch.randn(N, generator=g)
    eta, mask = torch.tensor(0.7), torch.ones(N, dtype=torch.bool)
    mask[[3, 11]] = False
    returns[3] = 100.0  # a reset step would dominate ψ if it leaked in
    out = vmpo_loss(m, s, tm, ts, a, torch.zeros(N), returns, mask, eta, torch.tensor(1.0), torch.tensor(1.0))
    psi, _ = weights_reference(returns, 0.7, 0.01, mask)
    assert psi[3] == 0 and psi[11] == 0
    ref = 0.0
    for k, i in itertools.product(range(N), range(d)):
        mu, sigma = m[k, i], s[k, i]
        ref = ref - float(psi[k]) * (
            -((a[k, i] - mu) ** 2) / (2 * sigma**2) - sigma.log() - 0.5 * math.log(2 * math.pi)
        )
    torch.testing.assert_close(out.policy_loss, ref)
    for got, want in zip(torch.autograd.grad(out.policy_loss, [m, s]), torch.autograd.grad(ref, [m, s])):
        torch.testing.assert_close(got, want)


def test_vmpo_loss_minibatch_e_step_reset_steps_and_truncation(monkeypatch):
    """ψ: each of the E-step's groups (contiguous states of the flattened batch: whole unrolls) has its own top half,
    its ψ summing to 1/M; reset steps get no weight; a truncation bootstraps from V of the last observation; PopArt
    keeps V(s) when value_targets moves it."""
    torch.manual_seed(2)
    T, B, M = 6, 8, 4
    agent = vmpo_mujoco.Agent(5, 2, hidden=(16,), popart_beta=0.5)
    m = vmpo_mujoco.LagrangeMultipliers()
    batch = _batch(agent, T, B)
    batch["ended"][2, 0] = True  # env 0 truncated at row 2: step 2 is a reset step
    batch["ended"][1, 5] = batch["terminated"][1, 5] = True  # env 5 terminated at row 1
    value = lambda: agent.popart.unnormalize(agent.popart(agent(batch["obs"])[2])[..., 0], 0)  # noqa: E731
    with torch.no_grad():
        v_before, mu_before = value(), agent.popart.mu.clone()
    captured = []
    original = vmpo_mujoco.vmpo_weights

    def spy(advantages, eta, eps_eta, mask=None, top_fraction=0.5):
        out = original(advantages, eta, eps_eta, mask, top_fraction)
        captured.append((advantages, mask, out[0]))
        return out

    monkeypatch.setattr(vmpo_mujoco, "vmpo_weights", spy)
    out, stats, mean, std, real = _flat_loss(agent, batch, m, _args(), num_minibatches=M)
    monkeypatch.undo()
    assert torch.isfinite(out.loss) and len(captured) == M
    assert out.kl_mu.item() == pytest.approx(0, abs=1e-9)
    adv = torch.cat([c[0] for c in captured])  # [B·T]: unroll by unroll, (t, b) at b·T + t
    for i, (a, mask, psi) in enumerate(captured):
        assert a.shape == (T * B // M,)  # B/M whole unrolls
        torch.testing.assert_close(mask, real[i * T * B // M : (i + 1) * T * B // M])
        ref_psi, _ = weights_reference(a.double(), m.eta.item(), 0.01, mask)
        torch.testing.assert_close(psi.double(), ref_psi, rtol=1e-5, atol=1e-7)
        assert math.isclose(float(psi.sum()), 1.0, rel_tol=1e-5)
    # the reset steps: (t 2, env 0) is group 0's state 2; (t 1, env 5) is group 2's state 1·T + 1
    assert captured[0][2][2] == 0 and captured[2][2][T + 1] == 0 and not captured[0][1][2]
    with torch.no_grad():
        v_after = value()
    assert not torch.equal(agent.popart.mu, mu_before)  # PopArt moved, V(s) kept
    torch.testing.assert_close(v_after, v_before, rtol=1e-5, atol=1e-5)
    sigma = float(agent.popart.sigma[0])
    g1 = float(batch["reward"][2, 0]) + 0.9 * float(v_before[2, 0])  # truncation: bootstrap, not 0
    assert float(adv[0 * T + 1]) == pytest.approx((g1 - float(v_before[1, 0])) / sigma, rel=1e-4)
    g0 = float(batch["reward"][1, 5])  # termination: the reward alone
    assert float(adv[5 * T + 0]) == pytest.approx((g0 - float(v_before[0, 5])) / sigma, rel=1e-4)
    # the policy loss is −Σ ψ log π with the groups' ψ scaled by 1/M
    psi_all = torch.cat([c[2] for c in captured]) / M
    logp = torch.distributions.Normal(mean, std).log_prob(_flat(batch["action"])).sum(-1)
    assert out.policy_loss.item() == pytest.approx(float(-(psi_all * logp).sum().detach()), rel=1e-5)
    # the advantages' mean and spread over the real steps (the reset steps left out)
    assert out.advantage_mean.item() == pytest.approx(float(adv[real].mean()), rel=1e-5)
    assert out.advantage_std.item() == pytest.approx(float(adv[real].std(correction=0)), rel=1e-5)
    assert float(stats["stats/popart_mu"]) == float(agent.popart.mu[0])


@pytest.mark.parametrize("inside", [True, False])
def test_vmpo_loss_with_projection_fits_the_projected_gaussian(inside):
    """`projection`: L_π = −Σ ψ log N(a; μ̃, σ̃) of each state's projected Gaussian, against a plain loop over the
    plain-loop projection (`_projection_reference`) and ψ by brute force on each group; the value, temperature and α
    terms and the KLs are the network's own, as without it. `regression_loss` (the projection held fixed against
    the network) is 0 where every state is inside its bounds and positive otherwise, and enters the loss times
    `regression_coef`."""
    g = torch.Generator().manual_seed(5)
    N, d, M, f64 = 24, 3, 2, torch.float64
    eps = (0.01, 0.03, 1e-3)
    tm, ts = torch.randn(N, d, generator=g, dtype=f64), torch.rand(N, d, generator=g, dtype=f64) + 0.5
    spread = torch.full((N, 1), 0.01, dtype=f64)
    if not inside:
        spread[1::2] = 0.5  # every other state far from π_target, the rest near it
    m = (tm + spread * ts * torch.randn(N, d, generator=g, dtype=f64)).requires_grad_()
    s = (ts * torch.exp(0.3 * spread * torch.randn(N, d, generator=g, dtype=f64))).requires_grad_()
    a = tm + ts * torch.randn(N, d, generator=g, dtype=f64)
    value_norm, returns_norm = torch.randn(N, generator=g, dtype=f64), torch.randn(N, generator=g, dtype=f64)
    mask = torch.ones(N, dtype=torch.bool)
    mask[[4, 17]] = False
    duals = [torch.tensor(x, dtype=f64, requires_grad=True) for x in (0.7, 2.0, 3.0)]
    args = (m, s, tm, ts, a, value_norm, returns_norm, mask, *duals, *eps)
    plain = vmpo_loss(*args, num_minibatches=M)
    out = vmpo_loss(*args, num_minibatches=M, projection=True, regression_coef=0.5)
    adv = returns_norm - value_norm
    psi = torch.cat([weights_reference(adv[r], 0.7, 0.01, mask[r])[0] for r in torch.arange(N).tensor_split(M)]) / M
    ref, outside = 0.0, []
    for k in range(N):
        tm_k, ts_k, m_k, s_k = (x[k].tolist() for x in (tm, ts, m, s))
        mean_k, std_k, _ = _projection_reference(tm_k, ts_k, m_k, s_k, eps[1], eps[2])
        outside.append(_kl_mu_plain(tm_k, ts_k, m_k) > eps[1] or _kl_sigma_plain(ts_k, s_k) > eps[2])
        for i in range(d):
            log_density = -((float(a[k, i]) - mean_k[i]) ** 2) / (2 * std_k[i] ** 2) - math.log(std_k[i])
            ref -= float(psi[k]) * (log_density - 0.5 * math.log(2 * math.pi))
    assert out.policy_loss.item() == pytest.approx(ref, rel=1e-9)
    for name in ("value_loss", "eta_loss", "alpha_mu_loss", "alpha_sigma_loss", "kl_mu", "kl_sigma", "kl_psi"):
        assert torch.equal(getattr(out, name), getattr(plain, name)), name
    parts = out.value_loss + out.policy_loss + out.eta_loss + out.alpha_mu_loss + out.alpha_sigma_loss
    torch.testing.assert_close(out.loss, parts + 0.5 * out.regression_loss)
    assert plain.regression_loss.item() == 0.0
    if inside:
        assert not any(outside)
        assert out.regression_loss.item() == pytest.approx(0.0, abs=1e-12)
        assert out.policy_loss.item() == pytest.approx(plain.policy_loss.item(), rel=1e-12)
    else:
        assert any(o for o, real in zip(outside, mask.tolist()) if real) and not all(outside)
        assert out.regression_loss.item() > 1e-3
        assert out.policy_loss.item() != pytest.approx(plain.policy_loss.item(), rel=1e-3)


def test_agent_starts_with_the_same_gaussian_everywhere_and_actions_map_to_the_box():
    agent = vmpo_mujoco.Agent(7, 3, init_std=0.3)
    assert [layer.out_features for layer in agent.core.net if isinstance(layer, torch.nn.Linear)] == [512, 256]
    assert agent.policy_mlp[0].out_features == 256 and agent.value_mlp[0].out_features == 256
    mean, std, feats = agent(torch.randn(4, 5, 7) * 10)
    assert (
        (mean == 0).all() and torch.allclose(std, torch.full_like(std, 0.3)) and agent.popart(feats).shape == (4, 5, 1)
    )
    # a sample as an action: itself (the env clips it), or its tanh with `squash` (kept in model.pt's config)
    x = torch.randn(4, 3) * 3
    assert not agent.squash and torch.equal(agent.box_action(x), x) and agent.config["squash"] is False
    squashed = vmpo_mujoco.Agent(7, 3, hidden=(16,), squash=True)
    assert torch.equal(squashed.box_action(x), torch.tanh(x)) and squashed.config["squash"] is True


def test_buffer_specs_hold_the_sample_and_no_target_gaussian():
    """An unroll's buffers: observations, rewards, end flags and the Gaussian's sample (before any tanh); π_target's
    Gaussian is the learner's target network's on the batch, so neither its mean nor its std is stored."""
    f32 = torch.float32
    assert vmpo_mujoco.buffer_specs(11, 3, 5) == {
        "action": ((6, 3), f32),
        "ended": ((6,), torch.bool),
        "terminated": ((6,), torch.bool),
        "obs": ((6, 11), f32),
        "reward": ((6,), f32),
    }


def test_multipliers_are_projected():
    m = vmpo_mujoco.LagrangeMultipliers(1.0, 1.0, 1.0)
    with torch.no_grad():
        m.eta.fill_(-0.3)
        m.alpha_sigma.fill_(-1.0)
    m.project()
    assert m.eta.item() == pytest.approx(1e-8) and m.alpha_sigma.item() == pytest.approx(1e-8)
    assert m.alpha_mu.item() == 1.0


def test_presets_follow_table_7_and_flags_override_them():
    gym = vmpo_mujoco.parse_args(["--preset", "paper"])
    assert (gym.unroll_length, gym.target_update_period, gym.gamma, gym.eps_eta) == (39, 100, 0.99, 0.01)
    assert (gym.num_envs, gym.batch_size, gym.num_minibatches, gym.learning_rate) == (64, 64, 8, 1e-4)
    assert 0.005 <= gym.eps_alpha_mu <= 0.01 and 5e-6 <= gym.eps_alpha_sigma < 5e-5
    # Algorithm 1: one pass over the whole batch, Eq. (1)'s n-step returns, the Gaussian as it is (clipped by the env)
    assert (gym.update_epochs, gym.minibatch_size, gym.gae_lambda) == (1, 0, 1.0)
    assert (gym.squash, gym.projection, gym.regression_coef) == (False, False, 0.0)
    hum = vmpo_mujoco.parse_args(["--env-id", "HumanoidRun-v1", "--preset", "paper"])
    assert hum.unroll_length == 63 and 0.05 <= hum.eps_alpha_mu <= 0.5 and 1e-5 <= hum.eps_alpha_sigma < 5e-5
    assert hum.hidden == (512, 256)
    assert (
        vmpo_mujoco.parse_args(
            ["--env-id", "HumanoidRun-v1", "--preset", "paper", "--unroll-length", "40"]
        ).unroll_length
        == 40
    )
    assert vmpo_mujoco.parse_args(["--env-id", "Humanoid-v4", "--preset", "paper"]).unroll_length == 39  # Gym


def test_family_defaults_on_top_of_the_column_and_flags_win():
    """`--env-id` alone: the task's Table 7 column with its family's one-machine settings on top (the rest: the Args
    defaults); the humanoid's column (unroll 63, ε_αμ 0.16, ε_αΣ 2.2e-5) where the family sets none of them, and
    with `--preset paper`; a flag given wins over both."""
    hop = vmpo_mujoco.parse_args(["--env-id", "Hopper-v4"])
    family = vmpo_mujoco.FAMILY_DEFAULTS["mujoco"][1]
    assert all(getattr(hop, k) == v for k, v in family.items())
    others = [f.name for f in dataclasses.fields(vmpo_mujoco.Args) if f.name not in family and f.name != "env_id"]
    assert all(getattr(hop, k) == getattr(vmpo_mujoco.Args(), k) for k in others)  # the Gym column: the Args defaults
    column = vmpo_mujoco.TABLE7_COLUMNS["humanoid-state"]
    hum = vmpo_mujoco.parse_args(["--env-id", "HumanoidRun-v1"])
    assert all(getattr(hum, k) == family.get(k, v) for k, v in column.items())
    assert all(getattr(hum, k) == v for k, v in family.items())
    paper = vmpo_mujoco.parse_args(["--env-id", "HumanoidRun-v1", "--preset", "paper"])
    assert (paper.unroll_length, paper.eps_alpha_mu, paper.eps_alpha_sigma) == (63, 0.16, 2.2e-5)
    pendulum, classic = vmpo_mujoco.parse_args(["--env-id", "Pendulum-v1"]), vmpo_mujoco.FAMILY_DEFAULTS["classic"][1]
    assert all(getattr(pendulum, k) == v for k, v in classic.items())
    mine = vmpo_mujoco.parse_args(["--env-id", "Hopper-v4", "--learning-rate", "3e-4", "--num-envs=8"])
    assert (mine.learning_rate, mine.num_envs, mine.batch_size) == (3e-4, 8, family["batch_size"])
    mine = vmpo_mujoco.parse_args(["--env-id", "Hopper-v4", "--no-projection", "--update-epochs", "2"])
    assert (mine.projection, mine.update_epochs, mine.squash) == (False, 2, family["squash"])
    a = vmpo_mujoco.Args()
    assert (a.init_eta, a.init_alpha_mu, a.init_alpha_sigma, a.learning_rate) == (1.0, 1.0, 1.0, 1e-4)  # Table 1


# --------------------------------------------------------------------------------------------------------
# The script end to end.


def check_run(run_path):
    with open(os.path.join(run_path, "summary.json")) as f:
        summary = json.load(f)
    for key in ("env_id", "total_timesteps", "wall_time_s", "sps", "mean_episodic_return_last_100", "eval_mean_return"):
        assert key in summary
    assert_logged(
        run_path,
        "charts/episodic_return charts/SPS losses/value_loss losses/policy_loss losses/regression_loss",
        "stats/eta stats/alpha_mu stats/alpha_sigma stats/kl_mu stats/kl_sigma stats/policy_std stats/passes",
        "stats/kl_mu_max_ratio stats/kl_sigma_max_ratio",
    )
    scores = eval_main([os.path.join(run_path, "model.pt"), "--episodes", "2", "--num-envs", "2"])
    assert len(scores) == 2 and all(math.isfinite(s) for s in scores)
    model = torch.load(os.path.join(run_path, "model.pt"), weights_only=False)
    agent = model["agent"]
    assert float(agent["obs_norm.count"]) > 0 and not torch.equal(
        agent["obs_norm.mean"], torch.zeros_like(agent["obs_norm.mean"])
    )
    assert "popart.mu" in agent and "alpha_mu" in model["multipliers"]
    return summary


TINY = ["--hidden", "32", "32", "--save-model", "--eval-episodes", "1"]


@pytest.mark.e2e
@pytest.mark.parametrize(
    "env_id,extra",
    [
        ("HalfCheetah-v4", ["--num-actors", "2", "--target-update-period", "2"]),
        ("HumanoidRun-v1", ["--preset", "paper"]),
    ],
)
def test_smoke(tmp_path, env_id, extra):
    """HalfCheetah (Gym) with two actors; the dm_control humanoid, whose observations come as a dict."""
    argv = f"--env-id {env_id} --total-timesteps 4000 --num-envs 4 --batch-size 4 --num-minibatches 2"
    argv += " --unroll-length 20"
    run_path = run_script("vmpo_mujoco.py", flags(argv, TINY, extra), tmp_path)
    summary = check_run(run_path)
    assert summary["total_timesteps"] == 4000 // 80 * 80
    checkpoint = torch.load(os.path.join(run_path, "checkpoint.pt"), weights_only=False)
    a = checkpoint["args"]  # 50 updates of `update_epochs` passes, each of (4 x 20 states / minibatch_size) steps
    steps = a["update_epochs"] * (max(1, 4 * 20 // a["minibatch_size"]) if a["minibatch_size"] else 1)
    assert steps == (1 if "--preset" in extra else a["update_epochs"])  # the paper: one Adam step an update
    assert {int(state["step"]) for state in checkpoint["optimizer"]["state"].values()} == {50 * steps}
    if "--target-update-period" in extra:  # a refresh every 2 updates
        assert events_tags(run_path, values_of="stats/target_version")[-1] == 25


@pytest.mark.e2e
def test_smoke_torchrun_two_learners(tmp_path):
    argv = "--env-id Pendulum-v1 --total-timesteps 3200 --num-envs 4 --batch-size 8 --num-minibatches 4"
    argv += " --unroll-length 20"
    check_run(torchrun("vmpo_mujoco.py", flags(argv, TINY), tmp_path))


# --------------------------------------------------------------------------------------------------------
# Learning.


@pytest.mark.e2e
def test_learns_inverted_pendulum(tmp_path):
    """InvertedPendulum-v4 with `--env-id` and a budget alone (the MuJoCo family's defaults): within 500k steps the
    mean return over 100 consecutive training episodes reaches 950 (the best is 1000; a random policy scores under
    10). Seeds 1-3 of docs/vmpo_mujoco.md first reached it at 150k-154k steps (each beside another run on its core,
    about 2 minutes) and ended at 1000.0 at 300k; the budget leaves room, and the run stops at the target."""
    argv = ["--env-id", "InvertedPendulum-v4", "--total-timesteps", "500000"]
    best100, run_path = learns("vmpo_mujoco.py", argv, tmp_path, 950, timeout=600)
    saved = json.load(open(os.path.join(run_path, "args.json")))
    family = vmpo_mujoco.FAMILY_DEFAULTS["mujoco"][1]
    assert saved["task_family"] == "mujoco" and all(saved[k] == v for k, v in family.items())
    assert best100 >= 950, f"best mean return over 100 consecutive episodes {best100:.1f} < 950"


@pytest.mark.e2e
def test_killed_run_resumes_from_its_checkpoint(tmp_path):
    """A run SIGKILLed as soon as its first checkpoint is there continues with --resume (`killed_and_resumed`, an
    8,000-step budget of 200 updates): the same folder and arguments, η, α_μ, α_Σ, the observation statistics, PopArt,
    the target network and the counters from the checkpoint; the killed run's model.pt, written with its checkpoint,
    plays."""
    argv = "--env-id Pendulum-v1 --num-envs 4 --batch-size 4 --num-minibatches 1 --unroll-length 10 --save-model"

    def killed(run):  # the killed run's model.pt, written with its checkpoint
        assert evaluate_cli(run, episodes=1)["episodes"] == 1

    argv += " --target-update-period 10"
    _, saved, final, _ = killed_and_resumed("vmpo_mujoco.py", argv, tmp_path, 8000, 40, "stats/eta", killed)
    assert set(saved["multipliers"]) == {"eta", "alpha_mu", "alpha_sigma"}
    assert any("obs_norm" in k for k in saved["agent"]) and any("popart" in k for k in saved["agent"])
    assert final["args"]["target_update_period"] == 10
    # the observation statistics went on from the saved ones: their count only grew
    count = next(k for k in saved["agent"] if "obs_norm" in k and "count" in k)
    assert final["agent"][count] > saved["agent"][count]


def _hopper_batch(envs, agent, T, generator):
    """One batch of unrolls `[T+1, B, ...]` of Hopper-v4 acted with `agent` as `act` does (a sample of its Gaussian,
    its tanh sent to the envs), stepping all envs together."""
    rows, (obs, _) = [], envs.reset()
    reward, ended = np.zeros(envs.config["num_envs"], np.float32), np.zeros(envs.config["num_envs"], bool)
    terminated = ended.copy()
    for _ in range(T + 1):
        obs_t = torch.from_numpy(flatten_obs(obs))
        with torch.no_grad():
            mean, std, _ = agent(obs_t)
            sample = mean + std * torch.randn(mean.shape, generator=generator)
        rows.append(dict(obs=obs_t, reward=torch.from_numpy(reward).float(), action=sample,
                         ended=torch.from_numpy(ended), terminated=torch.from_numpy(terminated)))  # fmt: skip
        low, high = envs.action_space.low, envs.action_space.high
        obs, reward, terminated, truncated, _ = envs.step(to_env_action(agent.box_action(sample).numpy(), low, high))
        ended = terminated | truncated
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def test_every_state_s_fitted_gaussian_stays_within_its_bounds_in_a_short_hopper_run():
    """The MuJoCo family's settings (`--env-id Hopper-v4` alone) on real Hopper-v4 batches, 6 updates of 5 passes, the
    target refreshed after each as `main` does: at every Adam step, in every state, the Gaussian the M-step fits (the
    network's, projected onto π_target's bounds) is within 1.05 ε_αμ and 1.05 ε_αΣ of π_target, in float32 as the
    learner runs. The network itself overshoots its projection in a few states (the regression term pulls it back):
    its largest per-state KL over the updates is logged, and stays under a ceiling with room over what was measured
    (kl_mu_max_ratio 1.3-3.3, kl_sigma_max_ratio 1.4-11.2 at these updates on seeds 0-2)."""
    args = vmpo_mujoco.parse_args(["--env-id", "Hopper-v4"])
    assert args.projection and args.squash and args.update_epochs > 1  # what the family runs
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    envs = make_env("Hopper-v4", 16, 0)
    agent = vmpo_mujoco.Agent(11, 3, args.hidden, popart_beta=args.popart_beta, squash=True)
    target = copy.deepcopy(agent)
    multipliers = vmpo_mujoco.LagrangeMultipliers(args.init_eta, args.init_alpha_mu, args.init_alpha_sigma)
    optimizer = torch.optim.Adam([*agent.parameters(), *multipliers.parameters()], lr=args.learning_rate)
    state = dict(agent=agent, multipliers=multipliers, optimizer=optimizer, update=0)
    fitted, original = [], vmpo_mujoco.project_gaussian

    def spy(mean, std, target_mean, target_std, eps_mu, eps_sigma):
        out = original(mean, std, target_mean, target_std, eps_mu, eps_sigma)
        kl_mu, kl_sigma = gaussian_kl_parts(target_mean, target_std, *out)
        fitted.append((float(kl_mu.detach().max()) / eps_mu, float(kl_sigma.detach().max()) / eps_sigma))
        return out

    network = []
    vmpo_mujoco.project_gaussian = spy
    try:
        for _ in range(6):
            batch = _hopper_batch(envs, target, args.unroll_length, g)
            stats = vmpo_mujoco.learner_step(state, target, batch, args)
            target.load_state_dict(agent.state_dict())  # θ_target ← θ_online, T_target = 1
            network.append((float(stats["stats/kl_mu_max_ratio"]), float(stats["stats/kl_sigma_max_ratio"])))
    finally:
        vmpo_mujoco.project_gaussian = original
    steps = 6 * args.update_epochs * (16 * args.unroll_length // args.minibatch_size)
    assert len(fitted) == steps
    assert max(mu for mu, _ in fitted) <= 1.05 and max(sigma for _, sigma in fitted) <= 1.05, fitted
    assert max(mu for mu, _ in network[1:]) > 1.0 or max(sigma for _, sigma in network[1:]) > 1.0  # bounds in use
    assert max(mu for mu, _ in network) < 10 and max(sigma for _, sigma in network) < 25, network
