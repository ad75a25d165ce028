"""common/ (networks, envs, evaluation helpers) and the run machinery every script carries (one text, tested once)."""

import ast
import contextlib
import csv
import ctypes.util
import dataclasses
import glob
import importlib
import json
import math
import queue
import re
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import pytest
import torch

from common.envs import EpisodeTracker, UsageError, env_spec, flat_obs_dim, flatten_obs, make_env
from common.envs import MUJOCO_FRAME, check_render, require_in, to_env_action
import common.envs
from common.evaluation import ATARI_SCORES, PRESETS, atari_games, expand_env_ids, human_normalized_score
from common.evaluation import median_human_normalized, resume_checkpoint, score_table, write_apng
from common.popart import PopArt
from tests.helpers import HOGWILD_LONG_RUN, assert_killed_process_ends_the_run
from tests.helpers import assert_non_finite_stops_the_run, assert_usage_error, ctrl_c_during_second_update
from tests.helpers import ROOT, evaluate_py, flags, imported_envpool_modules, acted_unrolls
from tests.helpers import assert_lstm_state_carried_and_zeroed, ENV_IDS_SHARES, assert_env_ids_share
from common.networks import LSTMCore, ResidualBlock, ResNetTorso, RunningNorm, ShallowTorso, dead_units
from common.networks import grad_norms_by_layer, init_output_, init_weights_, logits_std_across_states
from common.networks import make_torso

SCRIPTS = ["impala_vtrace", "vmpo_atari", "vmpo_mujoco", "a3c", "acer", "p3s_td3"]


def test_torsos_shapes_and_layer_counts():
    x = torch.randint(0, 256, (3, 4, 84, 84), dtype=torch.uint8)
    shallow = ShallowTorso((4, 84, 84))
    assert shallow(x).shape == (3, 256)
    assert sum(isinstance(m, torch.nn.Conv2d) for m in shallow.modules()) == 2
    for channels in [(16, 32, 32), (64, 128, 128)]:
        deep = ResNetTorso((4, 84, 84), channels)
        assert deep(x).shape == (3, 256)
        convs = [m for m in deep.modules() if isinstance(m, torch.nn.Conv2d)]
        assert len(convs) == 15 and [c.out_channels for c in convs[::5]] == list(channels)
    assert make_torso((4,))(torch.randn(5, 4)).shape == (5, 64)


def test_uint8_and_float_pixels_agree():
    torso = ShallowTorso((4, 84, 84))
    x = torch.randint(0, 256, (2, 4, 84, 84), dtype=torch.uint8)
    torch.testing.assert_close(torso(x), torso(x.float() / 255.0))


def test_lstm_core_resets_state_at_episode_start():
    torch.manual_seed(0)
    core = LSTMCore(8, num_actions=3, hidden=16)
    T, B = 6, 2
    feats, act, rew = torch.randn(T, B, 8), torch.randint(0, 3, (T, B)), torch.randn(T, B)
    first = torch.zeros(T, B, dtype=torch.bool)
    first[3, 0] = True
    state = (torch.randn(B, 16), torch.randn(B, 16))
    out, _ = core(feats, act, rew, first, state)
    # env 0 from t = 3 equals a fresh run from a zero state
    fresh, _ = core(
        feats[3:, :1], act[3:, :1], rew[3:, :1], torch.zeros(T - 3, 1, dtype=torch.bool), core.initial_state(1)
    )
    torch.testing.assert_close(out[3:, :1], fresh)
    # the previous action and reward are inputs
    out2, _ = core(feats, (act + 1) % 3, rew, first, state)
    assert not torch.allclose(out, out2)


def test_episode_tracker_sums_raw_reward_over_lives_and_resets_on_truncation():
    """Scripted Atari-like env: life losses end training episodes but not the game; the reset step after each
    end is not counted; a truncation with lives left ends the game's statistics too."""
    tr = EpisodeTracker(1)
    ids = np.array([0])
    steps = [  # (raw reward, terminated (life lost), truncated, game over)
        (1.0, False, False, False),
        (4.0, True, False, False),  # life lost
        (0.0, False, False, False),  # envpool's reset step after the life loss
        (2.0, False, False, False),
        (0.0, True, False, True),  # game over: score 7, length 4
        (0.0, False, False, False),  # reset step
        (5.0, False, False, False),
        (1.0, False, True, False),  # truncated, lives left: score 6, length 2
        (0.0, False, False, False),
        (3.0, False, False, False),  # reset step, then a real step
    ]
    ended = []
    for raw, term, trunc, over in steps:
        info = {"reward": np.array([raw]), "terminated": np.array([int(over)])}
        ended += tr.step(ids, np.sign(np.array([raw])), np.array([term]), np.array([trunc]), info)
    assert ended == [(0, 7.0, 4), (0, 6.0, 2)]
    assert tr.ret[0] == 3.0 and tr.len[0] == 1


def test_episode_tracker_on_real_breakout_with_episodic_life():
    env = make_env("Breakout-v5", 2, seed=3, training=True)
    tr = EpisodeTracker(2)
    obs, info = env.reset()
    life_losses, games = 0, []
    while len(games) < 2:
        obs, r, term, trunc, info = env.step(np.random.randint(0, 4, 2), info["env_id"])
        assert set(np.unique(r)) <= {-1.0, 0.0, 1.0}  # training rewards are clipped
        life_losses += int(term.sum())
        games += tr.step(info["env_id"], r, term, trunc, info)
    assert life_losses >= 2 * 5 - 1  # each game has 5 lives, each one a training episode
    assert all(length > 0 for _, _, length in games)


def test_env_checks():
    assert hasattr(env_spec("CartPole-v1", discrete=True).action_space, "n")
    with pytest.raises(UsageError, match="did you mean"):
        env_spec("CartPol-v1")
    with pytest.raises(UsageError, match="continuous actions"):
        env_spec("Pendulum-v1", discrete=True)
    with pytest.raises(UsageError, match="discrete actions"):
        env_spec("CartPole-v1", discrete=False)


def test_require_in_refuses_the_first_flag_outside_its_interval():
    """`require_in`: each closed bound inside, each open bound and NaN outside; the first flag outside is named with
    dashes and its value."""
    args = SimpleNamespace(low_ok=0.0, high_ok=1.0, big=float("inf"), open_low=0.0, open_high=1.0, nan=float("nan"))
    require_in("[0, 1]", args, "low_ok high_ok")
    require_in("[0, inf]", args, "big")
    for interval, names, message in [
        ("(0, 1]", "high_ok open_low nan", "--open-low must be in (0, 1], got 0.0"),
        ("[0, 1)", "low_ok open_high open_low", "--open-high must be in [0, 1), got 1.0"),
        ("[0, inf)", "low_ok nan", "--nan must be in [0, inf), got nan"),
    ]:
        with pytest.raises(UsageError, match=re.escape(message)):
            require_in(interval, args, names)


def test_env_spec_refuses_continuous_actions_that_are_not_a_bounded_vector(monkeypatch):
    """Every script's policy is a vector in a box: another shape, or an infinite bound, is one line."""
    import gymnasium

    real = common.envs._envpool().make_spec

    def with_space(space):
        def make_spec(env_id):
            spec = real(env_id)
            monkeypatch.setattr(type(spec), "action_space", property(lambda self: space), raising=False)
            return spec

        return make_spec

    assert env_spec("Hopper-v4", discrete=False).action_space.shape == (3,)
    for space, needle in [
        (gymnasium.spaces.Box(-1.0, 1.0, (2, 3)), "actions of shape (2, 3)"),
        (gymnasium.spaces.Box(-np.inf, 1.0, (3,)), "unbounded action space"),
    ]:
        monkeypatch.setattr(common.envs._envpool(), "make_spec", with_space(space))
        for discrete in (False, None):
            with pytest.raises(UsageError, match=re.escape(needle)):
                env_spec("Hopper-v4", discrete=discrete)


def test_apng_is_a_valid_animated_png(tmp_path):
    frames = [np.full((6, 5, 3), i * 40, np.uint8) for i in range(3)]
    path = os.path.join(tmp_path, "v", "a.png")
    write_apng(path, frames)
    from PIL import Image, ImageSequence

    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and b"acTL" in data and b"fdAT" in data  # animated, not a still
    with Image.open(path) as video:
        assert video.format == "PNG" and video.n_frames == 3 and video.size == (5, 6)
        played = [np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(video)]
    for frame, shown in zip(frames, played):
        assert np.array_equal(frame, shown)


# --------------------------------------------------------------------------------------------------------
# PopArt (van Hasselt et al. 2016; V-MPO Sec. 4.1).


def _popart(num_tasks=1, beta=0.3, seed=0, **kw):
    torch.manual_seed(seed)
    p = PopArt(8, num_tasks, beta=beta, **kw).double()
    with torch.no_grad():
        p.linear.weight.normal_()
        p.linear.bias.normal_()
    return p


def test_popart_preserves_unnormalised_outputs():
    p = _popart(num_tasks=3)
    x = torch.randn(50, 8, dtype=torch.float64)
    tasks = torch.arange(3)
    for step in range(20):
        before = p.unnormalize(p(x), tasks)
        targets = torch.randn(40, dtype=torch.float64) * 10 ** (step % 4) + 50 * step
        p.update(targets, torch.randint(0, 3, (40,)))
        after = p.unnormalize(p(x), tasks)
        torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(p.normalize(after, tasks), p(x))


def test_popart_statistics_are_exponential_moving_averages_per_task():
    beta = 0.2
    p = _popart(num_tasks=2, beta=beta)
    mu, nu = [0.0, 0.0], [1.0, 1.0]
    g = torch.Generator().manual_seed(1)
    for _ in range(10):
        targets = torch.randn(12, generator=g, dtype=torch.float64) * 3 + 2
        tasks = torch.tensor([0] * 5 + [1] * 7)
        p.update(targets, tasks)
        for t in range(2):
            sel = [float(v) for v, k in zip(targets, tasks) if k == t]
            mu[t] = (1 - beta) * mu[t] + beta * sum(sel) / len(sel)
            nu[t] = (1 - beta) * nu[t] + beta * sum(v * v for v in sel) / len(sel)
    for t in range(2):
        assert float(p.mu[t]) == pytest.approx(mu[t], rel=1e-10)
        assert float(p.sigma[t]) == pytest.approx(math.sqrt(nu[t] - mu[t] ** 2), rel=1e-10)


def test_popart_task_without_samples_is_untouched():
    p = _popart(num_tasks=3)
    p.update(torch.tensor([5.0, 7.0], dtype=torch.float64), torch.tensor([0, 0]))
    mu, sigma, w, b = p.mu.clone(), p.sigma.clone(), p.linear.weight.clone(), p.linear.bias.clone()
    p.update(torch.tensor([100.0, -40.0, 3.0], dtype=torch.float64), torch.tensor([1, 1, 1]))
    assert torch.isfinite(p.mu).all() and torch.isfinite(p.sigma).all()
    assert p.mu[1] != mu[1]  # task 1 moved
    for t in (0, 2):  # tasks 0 and 2 had no sample in this batch
        assert p.mu[t] == mu[t] and p.sigma[t] == sigma[t]
        assert torch.equal(p.linear.weight[t], w[t]) and p.linear.bias[t] == b[t]


def test_popart_scale_stays_within_bounds():
    p = _popart(beta=1.0, scale_lower=1e-2, scale_upper=1e6)
    p.update(torch.full((10,), 3.0, dtype=torch.float64), torch.zeros(10, dtype=torch.long))  # variance 0
    assert float(p.sigma[0]) == pytest.approx(1e-2)
    p.update(torch.tensor([-1e9, 1e9], dtype=torch.float64), torch.zeros(2, dtype=torch.long))  # σ would be 1e9
    assert float(p.sigma[0]) == pytest.approx(1e6)


def test_running_norm_equals_the_statistics_of_everything_seen():
    """Batches of different sizes and scales folded in one at a time give the mean and (population) variance of
    their concatenation; normalised outputs are clipped; the statistics are in the state dict."""
    rng = np.random.default_rng(0)
    norm = RunningNorm(3, clip=5.0)
    seen = []
    for n in (1, 7, 50, 3):
        x = rng.normal(loc=[1.0, -20.0, 300.0], scale=[0.1, 5.0, 40.0], size=(n, 3))
        seen.append(x)
        norm.update(torch.tensor(x, dtype=torch.float32).view(1, n, 3))  # any leading shape
        allx = np.concatenate(seen)
        np.testing.assert_allclose(norm.mean.numpy(), allx.mean(0), rtol=1e-5)
        np.testing.assert_allclose(norm.var.numpy(), allx.var(0), rtol=1e-4, atol=1e-9)
        assert float(norm.count) == len(allx)
    x = torch.tensor([[1.0, -20.0, 1e6]])
    z = norm(x)
    assert (
        float(z[0, 2]) == 5.0
        and abs(float(z[0, 0]) - (1.0 - float(norm.mean[0])) / math.sqrt(float(norm.var[0]))) < 1e-3
    )
    assert {"mean", "var", "count"} <= set(norm.state_dict())


def test_to_env_action_maps_into_the_box_and_clips():
    low, high = np.array([-2.0, 0.0, -1.0], np.float32), np.array([2.0, 1.0, 1.0], np.float32)
    out = to_env_action(np.array([[0.0, -1.0, 3.0], [-5.0, 0.5, 1.0], [0.0, 1.0, 0.5]], np.float32), low, high)
    np.testing.assert_allclose(out, [[0.0, 0.0, 1.0], [-2.0, 0.75, 1.0], [0.0, 1.0, 0.5]])


def test_flatten_obs_of_a_dm_control_dict():
    obs = {"b": np.arange(6.0).reshape(2, 3), "a": np.array([10.0, 20.0]), "c": np.zeros((2, 2, 2))}
    flat = flatten_obs(obs)
    assert flat.dtype == np.float32 and flat.shape == (2, 1 + 3 + 4)
    np.testing.assert_array_equal(flat[1, :4], [20.0, 3.0, 4.0, 5.0])  # sorted keys: a, b, c
    spec = env_spec("HumanoidRun-v1")
    assert flat_obs_dim(spec) == 21 + 1 + 12 + 3 + 3 + 28 + 27 and flat_obs_dim(env_spec("HalfCheetah-v4")) == 17
    env = make_env("HumanoidRun-v1", 2, seed=0)
    assert flatten_obs(env.reset()[0]).shape == (2, flat_obs_dim(spec))


def test_human_normalized_scores_on_known_values():
    assert human_normalized_score("Breakout-v5", 30.5) == pytest.approx(100.0)  # the human reference
    assert human_normalized_score("Breakout", 1.7) == pytest.approx(0.0)  # the random reference
    assert human_normalized_score("Pong-v5", -3.05) == pytest.approx(50.0)  # halfway from -20.7 to 14.6
    assert human_normalized_score("Pong-v5", 21.0) == pytest.approx(100 * 41.7 / 35.3)
    assert human_normalized_score("Skiing-v5", -17098.1 + 0.25 * 12761.2) == pytest.approx(25.0)
    assert math.isnan(human_normalized_score("CartPole-v1", 500.0))


def test_score_table_median_and_mean_over_games():
    scores = {"Breakout-v5": [30.5, 30.5], "Pong-v5": [-20.7], "Boxing-v5": [6.1, 6.1], "Enduro-v5": [860.5 * 3]}
    table = score_table({**scores, "CartPole-v1": [500.0]})
    hns = {r["env_id"]: r["human_normalized"] for r in table["games"]}
    assert hns["Breakout-v5"] == pytest.approx(100) and hns["Pong-v5"] == pytest.approx(0)
    assert hns["Boxing-v5"] == pytest.approx(50) and hns["Enduro-v5"] == pytest.approx(300)
    assert table["median_human_normalized"] == pytest.approx(75.0)  # of 0, 50, 100, 300; CartPole has no reference
    assert table["mean_human_normalized"] == pytest.approx(112.5)
    assert [r["episodes"] for r in table["games"]] == [2, 1, 2, 1, 1]


def test_atari_presets():
    import envpool

    known = set(envpool.list_all_envs())
    assert len(PRESETS["atari57"]) == 57 == len(set(PRESETS["atari57"])) == len(ATARI_SCORES)
    assert set(PRESETS["atari57"]) <= known
    assert set(PRESETS["atari5"]) == {"BattleZone-v5", "DoubleDunk-v5", "NameThisGame-v5", "Phoenix-v5", "Qbert-v5"}
    assert expand_env_ids(["Pong-v5", "atari5", "Qbert-v5"]) == ["Pong-v5", *PRESETS["atari5"]]


def test_atari_games_and_their_median_human_normalized_score():
    assert atari_games(["atari5", "Pong-v5"], "Breakout-v5")[-1] == "Pong-v5" and atari_games([], "CartPole-v1") == []
    for env_ids, env_id, says in (
        (["Pong-v5", "CartPole-v1"], "Pong-v5", "takes Atari games"),
        (["Pong-v5"], "CartPole-v1", "must be an Atari game too"),
        (["Pongg-v5"], "Pong-v5", "did you mean"),
    ):
        with pytest.raises(UsageError, match=says):
            atari_games(env_ids, env_id)
    returns = {"Pong-v5": [-21.0] * 5 + [0.0] * 10, "Breakout-v5": [30.0], "Qbert-v5": [1000.0, 2000.0]}
    games = ["Pong-v5", "Breakout-v5", "Qbert-v5"]
    scores = [human_normalized_score("Pong-v5", 0.0), human_normalized_score("Breakout-v5", 30.0)]
    scores.append(human_normalized_score("Qbert-v5", 1500.0))
    assert median_human_normalized(returns, games) == {
        "charts/median_human_normalized": pytest.approx(sorted(scores)[1])
    }
    assert median_human_normalized(returns, [*games, "Seaquest-v5"]) == {}  # a game without an episode yet
    assert median_human_normalized(returns, ["Pong-v5"]) == {}  # one game: no median


@pytest.mark.e2e
def test_evaluation_cli_per_game_table_for_a_multi_game_policy(tmp_path):
    """A policy over the 18 actions evaluated on two games: per-game table on the console and in JSON/CSV, with
    the human-normalised scores of its mean scores."""

    model = tmp_path / "model.pt"
    torch.save(
        {"script": "tests.random_policy", "env_id": "Pong-v5", "full_action_space": True, "num_actions": 18}, model
    )
    out = evaluate_py([str(model), *"--env-ids Pong-v5 Boxing-v5 --episodes 2".split()], timeout=600)
    assert out.returncode == 0, out.stderr
    assert "| Pong-v5 | 2 |" in out.stdout and "| Boxing-v5 | 2 |" in out.stdout
    table = json.load(open(tmp_path / "evaluation.json"))
    rows = {r["env_id"]: r for r in table["games"]}
    assert set(rows) == {"Pong-v5", "Boxing-v5"}
    for env_id, r in rows.items():
        assert r["human_normalized"] == pytest.approx(human_normalized_score(env_id, r["mean"]))
    assert -21 <= rows["Pong-v5"]["mean"] <= -15  # a random policy loses at Pong
    assert table["median_human_normalized"] == pytest.approx(np.median([r["human_normalized"] for r in rows.values()]))
    with open(tmp_path / "evaluation.csv") as f:
        assert [r["env_id"] for r in csv.DictReader(f)] == ["Pong-v5", "Boxing-v5"]
    bad = evaluate_py([str(model), "--env-ids", "Pongg-v5"], timeout=120)
    assert bad.returncode != 0 and bad.stderr.strip().startswith("error: unknown env id")
    one_game = tmp_path / "one_game.pt"  # a model of one game knows its own actions only
    torch.save({"script": "tests.random_policy", "env_id": "Pong-v5", "num_actions": 6}, one_game)
    bad = evaluate_py([str(one_game), "--env-ids", "Pong-v5", "Boxing-v5"], timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: --env-ids plays a multi-task model")


@pytest.mark.parametrize("where", ["impala_vtrace", "vmpo_atari", "vmpo_mujoco", "a3c", "acer", "p3s_td3"])
def test_check_finite_names_the_first_non_finite_quantity(where):
    module = importlib.import_module(where)
    NonFiniteError, check_finite = module.NonFiniteError, module.check_finite

    check_finite("here", loss=torch.tensor(1.0), gradient=3.0, stats=torch.zeros(4))  # all finite: no error
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(NonFiniteError, match=r"^non-finite gradient at update 7$"):
            check_finite("at update 7", loss=torch.tensor(1.0), gradient=torch.tensor([0.0, bad]), other=2.0)
    with pytest.raises(NonFiniteError, match="non-finite value"):
        check_finite("x", loss=1.0, value=float("nan"), policy=float("inf"))  # the first one in order


# --------------------------------------------------------------------------------------------------------
# Initialisation and the learning diagnostics.


def test_orthogonal_init_and_output_layers():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.LSTMCell(200, 50))
    init_weights_(net)
    w = net[0].weight.detach().double()
    assert torch.allclose(w @ w.T, 2 * torch.eye(200, dtype=torch.float64), atol=1e-5)  # gain √2
    assert torch.all(net[0].bias == 0) and torch.all(net[1].bias_ih == 0) and torch.all(net[1].bias_hh == 0)
    head = init_output_(torch.nn.Linear(256, 6), 0.01)
    h = head.weight.detach().double()
    assert torch.allclose(h @ h.T, 1e-4 * torch.eye(6, dtype=torch.float64), atol=1e-9)
    assert torch.all(init_output_(torch.nn.Linear(8, 3), 0.0).weight == 0)
    block = init_weights_(ResidualBlock(3))  # a residual block starts as the identity, its first conv orthogonal
    x = torch.randn(2, 3, 5, 5)
    assert torch.equal(block(x), x) and torch.all(block.conv1.weight == 0)
    c = block.conv0.weight.detach().double().flatten(1)
    assert torch.allclose(c @ c.T, 2 * torch.eye(3, dtype=torch.float64), atol=1e-5)


def test_logits_std_across_states_and_dead_units_against_loops():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 5, 6, generator=g, dtype=torch.float64)
    rows = [list(map(float, r)) for r in logits.reshape(-1, 6)]
    centred = [[x - sum(r) / len(r) for x in r] for r in rows]
    stds = []
    for a in range(6):
        col = [r[a] for r in centred]
        m = sum(col) / len(col)
        stds.append(math.sqrt(sum((x - m) ** 2 for x in col) / len(col)))
    assert abs(logits_std_across_states(logits).item() - sum(stds) / 6) < 1e-6
    # a per-action bias is no dependence on the state, nor is a shift of all logits of a state
    blind = torch.tensor([1.0, -2.0, 0.5]).expand(10, 3) + torch.arange(10.0).unsqueeze(1)
    assert logits_std_across_states(blind).item() < 1e-6

    features = torch.relu(torch.randn(4, 8, 10, generator=g))
    features[..., 3] = 0.0
    features[..., 7] = -1.0  # not a ReLU output, but off all the same
    features[0, 0, 9] = 0.0
    flat = features.reshape(-1, 10)
    dead = sum(all(float(flat[n, u]) <= 0 for n in range(flat.shape[0])) for u in range(10)) / 10
    assert dead_units(features).item() == pytest.approx(dead)
    assert dead_units(features).item() == pytest.approx(0.2)


def test_grad_norms_by_layer():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2, bias=False))
    net(torch.randn(5, 3)).square().sum().backward()
    norms = grad_norms_by_layer(net)
    assert set(norms) == {"0", "2"}
    w, b = net[0].weight.grad, net[0].bias.grad
    assert norms["0"].item() == pytest.approx(math.sqrt(float((w**2).sum() + (b**2).sum())), rel=1e-6)
    assert norms["2"].item() == pytest.approx(float(net[2].weight.grad.norm()), rel=1e-6)


# --------------------------------------------------------------------------------------------------------
# Defaults by task family and the run machinery: one text in every script (checked first), so tested on one copy.

MACHINERY = "vmpo_atari"  # the script that carries every piece of the run machinery


def _machinery(path):
    """{name: source} of each top-level definition below the run machinery's banner of the script at `path`."""
    text = open(path).read()
    start = text.index("# The run machinery: one text")
    lines, pieces = text.splitlines(), {}
    for node in ast.parse(text).body:
        first = node.decorator_list[0].lineno if getattr(node, "decorator_list", None) else node.lineno
        if getattr(node, "name", None) and first > text[:start].count("\n"):
            pieces[node.name] = "\n".join(lines[first - 1 : node.end_lineno])
    return pieces


def test_the_run_machinery_is_one_text_in_every_script():
    """Every piece of the run machinery (the definitions below its banner) is the same text in every script that
    carries it, and any two scripts carry the pieces they share in the same order; every script has the core ones."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    copies = {script: _machinery(os.path.join(root, f"{script}.py")) for script in SCRIPTS}
    core = {"Stop", "NonFiniteError", "check_finite", "exit_failed", "exit_stopped", "parse_args", "RunLog", "cli"}
    for script, pieces in copies.items():
        assert core <= set(pieces), (script, core - set(pieces))
        for other, theirs in copies.items():
            shared = [n for n in pieces if n in theirs]
            assert shared == [n for n in theirs if n in pieces], (script, other)  # the same order
            for name in shared:
                assert pieces[name] == theirs[name], f"{script}.py's {name} differs from {other}.py's"
    assert len(copies[MACHINERY]) >= 25 and len({n for pieces in copies.values() for n in pieces}) >= 27


def test_the_hogwild_pieces_are_one_text_in_a3c_and_acer():
    """The shared RMSProp, the Hogwild update and what the workers share: the same text, in the same order, under
    the same banner in a3c.py and acer.py (the run machinery's test above covers `run_workers` and the rest)."""
    root, names = os.path.dirname(os.path.dirname(os.path.abspath(__file__))), []
    for script in ("a3c", "acer"):
        text = open(os.path.join(root, f"{script}.py")).read()
        start = text.index("# Hogwild (Sec. 4 and Supp. Eqs. S2-S3 of Mnih et al. 2016)")
        names.append(text[start : text.index("\n# ----", start)])
    assert names[0] == names[1]
    for piece in (
        "class SharedRMSprop",
        "def hogwild_update",
        "def copy_network",
        "def scale_rewards",
        "def obs_tensor",
    ):
        assert piece in names[0]


def test_family_defaults_fill_what_the_user_did_not_give(capsys):
    module = importlib.import_module(MACHINERY)
    parse_args, Args = module.parse_args, module.Args
    source, values = module.FAMILY_DEFAULTS["atari"]
    family = dataclasses.replace(Args(env_id="Breakout-v5"), **values)
    assert family != Args(env_id="Breakout-v5") and values["learning_rate"] != Args.learning_rate
    breakout = ["--env-id", "Breakout-v5"]
    assert parse_args(breakout) == family
    assert parse_args([*breakout, "--learning-rate", "5e-3"]) == dataclasses.replace(family, learning_rate=5e-3)
    both = dataclasses.replace(family, learning_rate=5e-3, use_lstm=True)
    assert parse_args(["--env-id=Breakout-v5", "--learning_rate=5e-3", "--use-lstm"]) == both
    assert parse_args([*breakout, "--channels", "4", "4"]) == dataclasses.replace(family, channels=(4, 4))
    assert parse_args([*breakout, "--preset", "paper"]) == Args(env_id="Breakout-v5", preset="paper")
    assert parse_args([*breakout, "--resume", "runs/x"]) == Args(env_id="Breakout-v5", resume="runs/x")  # its own
    assert parse_args(["--env-id", "Hopper-v4"]) == Args(env_id="Hopper-v4")  # no entry for its family
    with pytest.raises(SystemExit):  # --help shows what a run of this env id would take
        parse_args([*breakout, "--help"])
    assert f"(default: {values['learning_rate']})" in capsys.readouterr().out
    family_name, said, shown = module.defaults_for(family)
    assert (family_name, said, shown) == ("atari", source, values)
    assert module.defaults_for(Args(preset="paper"))[1:] == (module.PAPER + ", forced by --preset paper", {})


FAMILIES = {
    "impala_vtrace": ["Breakout-v5", "CartPole-v1"],
    "vmpo_atari": ["Breakout-v5", "CartPole-v1"],
    "vmpo_mujoco": ["Hopper-v4", "Pendulum-v1"],
    "a3c": ["Breakout-v5", "Hopper-v4", "CartPole-v1"],
    "acer": ["Breakout-v5", "Hopper-v4", "CartPole-v1"],
    "p3s_td3": ["Hopper-v4", "Pendulum-v1"],
}


@pytest.mark.parametrize("where", SCRIPTS)
def test_defaults_are_the_same_with_and_without_a_gpu(where, monkeypatch, capsys):
    """`--env-id X` and `--env-id X --help` give the same values whether or not torch sees a GPU: a GPU makes a run
    faster, never different."""
    module = importlib.import_module(where)
    for env_id in FAMILIES[where]:
        seen = []
        for gpu in (True, False):
            monkeypatch.setattr(torch.cuda, "is_available", lambda gpu=gpu: gpu)
            with pytest.raises(SystemExit):
                module.parse_args(["--env-id", env_id, "--help"])
            seen.append((module.parse_args(["--env-id", env_id]), capsys.readouterr().out))
        assert seen[0] == seen[1] and "(default: " in seen[0][1], env_id


def test_actor_channel_fills_overlapping_unrolls_in_async_order():
    """`ActorChannel.write` (the machinery's, one text in the actor/learner scripts). Rows arrive for any subset of
    envs in any order (envpool's async mode). Each env's unroll k must hold its rows kT..kT+T (T+1 rows: the last
    row of an unroll is the first of the next), its core state must be the one before row kT, and a slot goes to the
    learner as soon as its env has written row T."""
    module = importlib.import_module(MACHINERY)

    T, n, num_slots = 3, 3, 64
    buffers = {"x": torch.zeros(num_slots, T + 1), "core_h": torch.zeros(num_slots, 2)}
    free_q, full_q = queue.Queue(), queue.Queue()
    for i in range(num_slots):
        free_q.put(i)
    writer = module.ActorChannel(torch.nn.Linear(1, 1), torch.zeros(1), buffers, free_q, full_q, queue.Queue())
    writer.local_agent(n, T, "cpu")
    rng = np.random.default_rng(0)
    t = np.zeros(n, np.int64)  # rows written per env
    expected_full = []
    for _ in range(25):
        ids = rng.permutation(n)[: rng.integers(1, n + 1)]
        row = {"x": torch.tensor([100.0 * e + t[e] for e in ids], dtype=torch.float32)}
        core = {"core_h": torch.tensor([[1000.0 * e + t[e], -1.0] for e in ids], dtype=torch.float32)}
        writer.write(ids, row, core)
        for e in ids:
            t[e] += 1
            if t[e] > 1 and (t[e] - 1) % T == 0:
                expected_full.append((int(e), int((t[e] - 1) // T - 1)))
    full = []
    while not full_q.empty():
        full.append(full_q.get())
    assert len(full) == len(expected_full) > 0
    for slot, (e, k) in zip(full, expected_full):  # in the order the unrolls were completed
        torch.testing.assert_close(buffers["x"][slot], 100.0 * e + torch.arange(k * T, k * T + T + 1).float())
        torch.testing.assert_close(buffers["core_h"][slot], torch.tensor([1000.0 * e + k * T, -1.0]))
    for e in range(n):  # the open unroll: rows written so far, and its opening state
        slot, filled = writer.slot[e], writer.pos[e]
        k = (t[e] - 1) // T if t[e] > 0 else 0
        torch.testing.assert_close(buffers["x"][slot, :filled], 100.0 * e + torch.arange(k * T, k * T + filled).float())


# --------------------------------------------------------------------------------------------------------
# The run folder, Ctrl-C and the loss's curves (the machinery, on the script that carries all of it).


def _run_args(module, tmp_path, **kw):
    """The script's own arguments for a CartPole-v1 run in `tmp_path`, logging at every call."""
    run = dict(env_id="CartPole-v1", exp_name="x", seed=3, run_dir=str(tmp_path), log_interval=0.0, eval_episodes=0)
    return dataclasses.replace(module.Args(), **{**run, **kw})


def test_run_log_writes_the_run_folder_and_continues_a_resumed_run(tmp_path, capsys):
    """A fresh run: args.json with the family, return(100) over the episodes logged, per-group returns, a checkpoint
    holding the script's state with the log's, and summary.json with the house keys, its SPS up to the last checkpoint.
    A resumed run: the same folder, its returns, groups and episode count continued, the steps and wall time counted
    on from the checkpoint's."""
    where = MACHINERY
    module = importlib.import_module(where)
    args = _run_args(module, tmp_path)
    log = module.RunLog(args, None, "test run")
    assert os.path.basename(log.path).startswith("CartPole-v1__x__3__")
    saved = json.load(open(os.path.join(log.path, "args.json")))
    assert saved["task_family"] == "classic" and saved["seed"] == 3 and saved["exp_name"] == "x"
    for i in range(112):
        log.episode(float(i % 12), 10, 100 * i, "learner_0" if i % 2 else "learner_1")
    assert log.groups["learner_0"][:6] == [1.0, 3.0, 5.0, 7.0, 9.0, 11.0]
    assert log.due()  # --log-interval 0
    log.console(1200)
    recent = np.mean([i % 12 for i in range(12, 112)])
    assert f"return(100) {recent:8.1f} | episodes 112" in capsys.readouterr().out
    log.save(1200, dict(update=7), model={"weights": 1})
    state = torch.load(os.path.join(log.path, "checkpoint.pt"), weights_only=False)
    assert (state["update"], state["global_step"], len(state["returns"]), state["episodes"]) == (7, 1200, 100, 112)
    assert state["groups"]["learner_1"] == [8.0, 10.0, 0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 0.0, 2.0]  # the last 10
    assert state["args"]["seed"] == 3
    assert state["script"] == f"{where}.py" and torch.load(os.path.join(log.path, "model.pt")) == {"weights": 1}
    assert not [f for f in os.listdir(log.path) if f.endswith(".tmp")]
    saved_at = log.last_save
    time.sleep(0.05)  # the evaluation, say: not counted in the wall time nor the SPS
    summary = log.end(1200, 3.5, num_workers=2)
    keys = {"env_id", "total_timesteps", "wall_time_s", "sps", "mean_episodic_return_last_100", "eval_mean_return"}
    assert keys <= set(summary) and summary["num_workers"] == 2 and summary["mean_episodic_return_last_100"] == recent
    assert summary["wall_time_s"] == pytest.approx(saved_at - log.start) and summary["eval_mean_return"] == 3.5
    assert summary["sps"] == pytest.approx(1200 / (saved_at - log.start))
    assert json.load(open(os.path.join(log.path, "summary.json"))) == summary

    torch.save({**state, "wall_time_s": 30.0}, os.path.join(log.path, "checkpoint.pt"))
    resumed_args, resumed = resume_checkpoint(log.path, os.path.basename(module.__file__), module.Args)
    assert resumed_args.seed == 3 and resumed_args.exp_name == "x" and resumed_args.resume == log.path
    again = module.RunLog(resumed_args, resumed, "resumed")
    assert again.path == log.path and again.start_step == 1200 and again.returns == state["returns"]
    assert again.groups["learner_1"] == state["groups"]["learner_1"]
    again.episode(1.0, 10, 1250)
    again.console(1250)
    assert "| episodes 113 |" in capsys.readouterr().out  # counted on after the resume
    again.save(1300, {})
    assert torch.load(os.path.join(log.path, "checkpoint.pt"), weights_only=False)["wall_time_s"] >= 30.0


def test_runs_started_in_the_same_second_get_folders_of_their_own(tmp_path, monkeypatch):
    """Two runs of the same env, name and seed started within one second: the second gets `<name>_2`, so
    neither overwrites the other's logs, checkpoints or model."""
    module = importlib.import_module(MACHINERY)
    monkeypatch.setattr(module.time, "time", lambda: 1_700_000_000.0)
    args = _run_args(module, tmp_path)
    logs = [module.RunLog(args, None, "run") for _ in range(3)]
    assert logs[0].path == os.path.join(str(tmp_path), "CartPole-v1__x__3__1700000000")
    assert [log.path for log in logs[1:]] == [logs[0].path + "_2", logs[0].path + "_3"]
    assert all(os.path.isfile(os.path.join(log.path, "args.json")) for log in logs)


def test_stop_waits_for_the_update_in_hand_and_a_second_ctrl_c_exits_at_once(monkeypatch, capsys):
    """Ctrl-C or SIGTERM only asks the run to stop (it finishes the update in hand); a second Ctrl-C exits at once
    with status 130; a SIGTERM after the first signal (torchrun's, after the terminal's Ctrl-C) does not."""
    import signal as _signal

    module = importlib.import_module(MACHINERY)
    exits = []
    monkeypatch.setattr(module.os, "_exit", exits.append)
    old = _signal.getsignal(_signal.SIGINT), _signal.getsignal(_signal.SIGTERM)
    try:
        for first in (_signal.SIGINT, _signal.SIGTERM):
            stop = module.Stop()
            assert not stop.requested
            os.kill(os.getpid(), first)
            assert stop.requested and exits == []
            os.kill(os.getpid(), _signal.SIGTERM)
            assert exits == []
            os.kill(os.getpid(), _signal.SIGINT)
            assert exits == [130]
            exits.clear()
        assert "Ctrl-C again" in capsys.readouterr().err
    finally:
        _signal.signal(_signal.SIGINT, old[0])
        _signal.signal(_signal.SIGTERM, old[1])


def test_loss_stats_names_the_parts_of_a_loss_and_its_diagnostics():
    loss_stats = importlib.import_module(MACHINERY).loss_stats

    class Out(NamedTuple):
        loss: torch.Tensor
        value_loss: torch.Tensor
        kl: torch.Tensor
        targets: torch.Tensor

    w = torch.tensor(2.0, requires_grad=True)
    stats = loss_stats(Out(w * 3, w * 2, w.detach() + 1, torch.ones(4)))
    assert set(stats) == {"losses/value_loss", "stats/kl"}
    assert float(stats["losses/value_loss"]) == 4.0 and not stats["losses/value_loss"].requires_grad


def test_actor_configs_share_envs_games_and_seeds():
    """Envs split evenly over the actors, actor a plays game a mod G with the full action set, seeds apart by
    learner and actor, env batch half an actor's envs by default."""
    actor_configs = importlib.import_module(MACHINERY).actor_configs

    args = SimpleNamespace(num_envs=8, num_actors=4, unroll_length=5, env_batch_size=0, seed=10, env_id="Pong-v5")
    args.cuda_actors = False  # the actors act on the CPU whatever the learner's device
    assert {c.device for c in actor_configs(args, 0, "cuda:1")} == {"cpu"}
    args.cuda_actors = True
    assert {c.device for c in actor_configs(args, 0, "cuda:1")} == {"cuda:1"}
    cfgs = actor_configs(args, 1, "cpu", ("Pong-v5", "Breakout-v5"), reward_clip=False)
    assert [c.env_id for c in cfgs] == ["Pong-v5", "Breakout-v5"] * 2 and [c.task for c in cfgs] == [0, 1, 0, 1]
    assert {c.num_envs for c in cfgs} == {2} and {c.env_batch_size for c in cfgs} == {1}
    assert [c.seed for c in cfgs] == [1010, 1011, 1012, 1013]
    assert cfgs[0].env_options == {"reward_clip": False, "full_action_space": True}
    one = actor_configs(args, 0, "cpu")
    assert {c.env_id for c in one} == {"Pong-v5"} and one[0].env_options == {}


@pytest.mark.parametrize("script", ["impala_vtrace", "vmpo_atari"])
@pytest.mark.parametrize("argv, expected", ENV_IDS_SHARES)
def test_env_ids_alone_give_every_game_the_same_share_of_actors_and_envs(script, argv, expected):
    assert_env_ids_share(importlib.import_module(script), [*argv, "--no-cuda"], expected)


@pytest.mark.parametrize("script", ["impala_vtrace", "vmpo_atari"])
def test_actor_carries_the_lstm_state_across_unrolls_and_zeroes_it_where_an_episode_starts(script):
    """`act` with an LSTM, in this process on CartPole-v1 (4 envs stepped 2 at a time, unrolls of 5): the state
    stored before each unroll, and the logits of every row, are a plain step-by-step loop's over the env's rows from a
    zero state (`assert_lstm_state_carried_and_zeroed`); the learner's pass over an unroll from that state agrees."""
    module = importlib.import_module(script)
    torch.manual_seed(0)
    heads = dict(head_hidden=16, mlp_hidden=(16,)) if script == "vmpo_atari" else {}
    agent = module.Agent((4,), 2, use_lstm=True, lstm_size=16, **heads)
    torch.nn.init.normal_(agent.policy.weight)  # logits of order 1 that depend on the state (not a zero readout's)
    argv = flags("--env-id CartPole-v1 --use-lstm --lstm-size 16 --unroll-length 5 --num-envs 4 --env-batch-size 2")
    chains = acted_unrolls(module, agent, argv, num_unrolls=48)
    readout = agent.policy if script == "impala_vtrace" else lambda h: agent.policy(agent.policy_mlp(h))
    assert assert_lstm_state_carried_and_zeroed(agent, chains, readout) > 0  # episodes ended inside unrolls


def test_actor_pool_batches_unrolls_recycles_slots_publishes_and_ends_its_actors():
    """`ActorPool` (the learner's side) with one real actor of vmpo_atari on CartPole and 10 slots: `next_batch` gives
    `batch_size` full unrolls `[T+1, B]`, each opening with the row that closed one before it, for 40 batches (the
    slots come back); `publish` reaches the actor (later rows carry version 1); `take_episodes` drains the episodes;
    a stop makes `next_batch` return None; `close` leaves no actor running."""
    module = importlib.import_module(MACHINERY)
    args = module.parse_args("--env-id CartPole-v1 --num-envs 2 --batch-size 2 --unroll-length 5".split())
    spec = module.env_spec(args.env_id)
    agent = module.Agent(spec.observation_space.shape, 2, use_lstm=False)
    specs = module.buffer_specs(spec.observation_space, 2, args)
    stop = SimpleNamespace(requested=False)
    timer = threading.Timer(60, setattr, (stop, "requested", True))  # a pool that stalls fails, never hangs
    pool = module.ActorPool(module.actor_configs(args, 0, torch.device("cpu")), agent, specs, 2, torch.device("cpu"))
    try:
        timer.start()
        batch = pool.next_batch(stop)
        assert batch["obs"].shape == (6, 2, 4) and batch["action"].shape == (6, 2) and not batch["version"].any()
        pool.publish({k: v + 1 for k, v in agent.state_dict().items()})
        assert pool.version.item() == 1 and torch.equal(pool.agent.policy.bias, agent.policy.bias + 1)
        closing, versions, episodes = {tuple(o.tolist()) for o in batch["obs"][-1]}, set(), []
        for _ in range(40):
            batch = pool.next_batch(stop)
            assert batch is not None, "the actor stalled: slots not returned"
            assert all(tuple(o.tolist()) in closing for o in batch["obs"][0])  # each env's rows go on where they ended
            closing |= {tuple(o.tolist()) for o in batch["obs"][-1]}
            versions |= set(batch["version"].flatten().tolist())
            episodes += pool.take_episodes()
        assert 1 in versions and episodes and all(len(e) == 3 and e[2] == 0 for e in episodes)  # (score, length, task)
        stop.requested = True
        assert pool.next_batch(stop) is None
    finally:
        timer.cancel()
        pool.close()
    assert not any(p.is_alive() for p in pool.workers.processes)


@pytest.mark.parametrize(
    "cuda, network, local_rank, local_world, gpus, expected",
    [  # (device, backend, threads) on 16 cores
        (True, "shallow", 0, 1, 0, ("cpu", "gloo", 8)),  # no GPU: the CPU rule, half the cores
        (True, "deep", 1, 2, 0, ("cpu", "gloo", 8)),  # the deep ResNet: all of the learner's share
        (False, "shallow", 0, 1, 1, ("cpu", "gloo", 8)),  # --no-cuda on a GPU machine
        (True, "shallow", 1, 2, 1, ("cuda:0", "gloo", 1)),  # two learners on one GPU: gloo, not NCCL
        (True, "deep", 1, 2, 2, ("cuda:1", "nccl", 1)),  # a GPU each: NCCL; the cores step the envs
        (True, "shallow", 3, 4, 2, ("cuda:1", "gloo", 1)),  # four learners on two GPUs
    ],
)
def test_placement_of_a_learner_by_the_gpus_and_cores_the_machine_has(
    cuda, network, local_rank, local_world, gpus, expected
):
    """The device is GPU `local_rank` mod the GPUs present, NCCL only where every learner has its own GPU, one torch
    thread where the learner's work is on a GPU, a given --learner-threads always wins."""
    placement = importlib.import_module(MACHINERY).placement
    args = SimpleNamespace(cuda=cuda, network=network, learner_threads=0)
    device, backend, threads = placement(args, local_rank, local_world, gpus, 16)
    assert (str(device), backend, threads) == expected
    args.learner_threads = 3
    assert placement(args, local_rank, local_world, gpus, 16)[2] == 3


def test_a_generator_saved_on_another_device_is_seeded_from_its_state():
    """A checkpoint's generator state from a CUDA generator (Philox: 16 bytes) resumes into a CPU one (and the
    reverse): seeded from the saved state, the same seed every time; a state from the same device is restored."""
    load_state = importlib.import_module(MACHINERY).load_state
    cuda_state = torch.arange(16, dtype=torch.uint8)  # the size of `torch.Generator("cuda").get_state()`
    draws = []
    for _ in range(2):
        state = load_state({"generator": torch.Generator().manual_seed(0), "t": 0}, {"generator": cuda_state, "t": 7})
        draws.append(torch.rand(3, generator=state["generator"]))
        assert state["t"] == 7
    fresh = torch.rand(3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], fresh)
    saved = torch.Generator().manual_seed(5)
    saved_state, expected = saved.get_state(), torch.rand(3, generator=saved)
    state = load_state({"generator": torch.Generator()}, {"generator": saved_state})
    assert torch.equal(torch.rand(3, generator=state["generator"]), expected)


def test_state_dicts_and_load_state_carry_the_training_state_through_a_checkpoint(tmp_path):
    """`state_dicts` saves modules and optimisers by their state_dict, a generator by its state, counters as they are;
    `load_state` puts each back in place (and leaves the state alone where there is no checkpoint)."""
    module = importlib.import_module(MACHINERY)

    def fresh():
        net = torch.nn.Linear(3, 2)
        return dict(net=net, optimizer=torch.optim.Adam(net.parameters()), generator=torch.Generator(), update=0)

    state = fresh()
    state["net"](torch.randn(4, 3)).sum().backward()
    state["optimizer"].step()
    state["generator"].manual_seed(11)
    state["update"] = 5
    torch.save(module.state_dicts(state), tmp_path / "checkpoint.pt")
    expected = torch.rand(2, generator=state["generator"])
    resumed = module.load_state(fresh(), torch.load(tmp_path / "checkpoint.pt", weights_only=False))
    assert resumed["update"] == 5 and torch.equal(torch.rand(2, generator=resumed["generator"]), expected)
    for a, b in zip(resumed["net"].parameters(), state["net"].parameters()):
        assert torch.equal(a, b)
    saved, loaded = state["optimizer"].state_dict()["state"], resumed["optimizer"].state_dict()["state"]
    assert all(torch.equal(saved[k]["exp_avg_sq"], loaded[k]["exp_avg_sq"]) for k in saved)
    untouched = fresh()
    assert module.load_state(untouched, None) is untouched and untouched["update"] == 0


def _learner(rank, init_file, out_dir):
    """One of two gloo learners (torchrun's environment by hand) running the machinery's collectives."""
    os.environ.update(WORLD_SIZE="2", RANK=str(rank))
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    module = importlib.import_module(MACHINERY)
    torch.manual_seed(rank)  # each learner's own initial weights
    net = torch.nn.Linear(2, 1)
    module.same_start(net)
    results = {"weight": net.weight.detach().clone()}
    for mean in (True, False):
        for p in net.parameters():
            p.grad = torch.full_like(p, rank + 1.0)
        module.reduce_gradients(net.parameters(), mean=mean)
        results[f"grad_{mean}"] = net.weight.grad.clone()
    results["any"] = (module.any_learner(rank == 1, "cpu"), module.any_learner(False, "cpu"))
    torch.save(results, os.path.join(out_dir, f"{rank}.pt"))
    torch.distributed.destroy_process_group()


def test_learners_start_alike_reduce_gradients_and_stop_together(tmp_path):
    """Under torchrun (two gloo processes here): `same_start` gives every learner rank 0's weights,
    `reduce_gradients` averages (or sums) the gradients, `any_learner` is true in all once it is true in one."""
    torch.multiprocessing.spawn(_learner, (str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    first, second = (torch.load(tmp_path / f"{rank}.pt") for rank in (0, 1))
    assert torch.equal(first["weight"], second["weight"])
    for results in (first, second):
        assert torch.equal(results["grad_True"], torch.full((1, 2), 1.5))
        assert torch.equal(results["grad_False"], torch.full((1, 2), 3.0))
        assert results["any"] == (True, False)


def _worker(kind):
    """A worker process of `start_workers` that raises, dies, waits or ends."""
    if kind == "raise":
        raise ValueError("boom")
    if kind == "die":
        os._exit(3)
    if kind == "wait":
        time.sleep(120)


ENDINGS = [
    (["end", "wait"], None),
    (["raise", "wait"], "worker 0 failed:"),
    (["wait", "die"], "worker 1 died with exit code 3"),
]


@pytest.mark.parametrize("kinds, message", ENDINGS)
def test_worker_processes_report_how_they_ended_and_leave_none_running(kinds, message):
    """`check_workers` counts the workers that ended well, or raises WorkerError with a raised worker's traceback or
    a dead one's exit code; `end_workers` then kills and reaps the rest: no process is left running."""
    module = importlib.import_module(MACHINERY)
    workers = module.start_workers(_worker, kinds)
    try:
        deadline, ended = time.time() + 60, 0
        with pytest.raises(module.WorkerError) if message else contextlib.nullcontext() as raised:
            while time.time() < deadline and ended == 0:
                ended = module.check_workers(workers)
                time.sleep(0.1)
        if message:
            assert message in str(raised.value) and ("ValueError: boom" in str(raised.value)) == (kinds[0] == "raise")
        else:
            assert ended == 1
    finally:
        module.end_workers(workers)
    assert not any(p.is_alive() for p in workers.processes)


def test_exit_failed_and_exit_stopped_say_what_to_do_next(tmp_path, capsys):
    """`exit_failed`: the error line and exit status 1; after a non-finite value, where the last good checkpoint is
    (or that there is none). `exit_stopped`: the checkpoint's step and the command that continues the run, 130."""
    module = importlib.import_module(MACHINERY)
    cases = [(module.WorkerError("worker 0 died"), None), (module.NonFiniteError("non-finite loss at update 3"), 42)]
    cases.append((module.NonFiniteError("non-finite loss at update 1"), None))
    for error, step in cases:
        if step is not None:
            torch.save({"global_step": step}, tmp_path / "checkpoint.pt")
        with pytest.raises(SystemExit) as ended:
            module.exit_failed(error, str(tmp_path))
        err = capsys.readouterr().err
        assert ended.value.code == 1 and err.startswith(f"error: {error}")
        if isinstance(error, module.NonFiniteError):
            expected = f"(step {step}) is kept: continue with --resume {tmp_path}" if step else "no checkpoint was"
            assert expected in err and "--learning-rate" in err
        (tmp_path / "checkpoint.pt").unlink(missing_ok=True)
    log = SimpleNamespace(writer=SimpleNamespace(close=lambda: None), path=str(tmp_path))
    previous = signal.getsignal(signal.SIGINT)
    try:
        for world, command in ((1, "python vmpo_atari.py"), (2, "torchrun --standalone --nproc_per_node 2 vmpo_atari")):
            with pytest.raises(SystemExit) as ended:
                module.exit_stopped(log, 7, world)
            err = capsys.readouterr().err
            assert ended.value.code == 130 and f"checkpoint at step 7: continue with {command}" in err
            assert f"--resume {tmp_path}" in err
        with pytest.raises(SystemExit):
            module.exit_stopped(None, 7, 2)  # a rank above 0: nothing to say
        assert capsys.readouterr().err == ""
    finally:
        signal.signal(signal.SIGINT, previous)


# --------------------------------------------------------------------------------------------------------
# The shape of the project: a script and common/ are all a run needs.


def test_common_never_imports_a_script():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for path in glob.glob(os.path.join(root, "common", "*.py")):
        tree = ast.parse(open(path).read())
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not names & {*SCRIPTS, "evaluate"}, (path, names & {*SCRIPTS, "evaluate"})


# The scripts with continuous actions run a MuJoCo task, the others CartPole-v1; each run as small as it can be.
COPIED_RUNS = {
    "impala_vtrace": ["--env-id", "CartPole-v1", "--total-timesteps", "640", "--num-envs", "4", "--batch-size", "4"],
    "vmpo_atari": ["--env-id", "CartPole-v1", "--total-timesteps", "640", "--num-envs", "4", "--batch-size", "4"],
    "vmpo_mujoco": ["--env-id", "InvertedPendulum-v4", "--total-timesteps", "800", "--num-envs", "4"]
    + ["--batch-size", "4", "--unroll-length", "20"],
    "a3c": ["--env-id", "InvertedPendulum-v4", "--num-workers", "1", "--num-envs", "2", "--total-timesteps", "2000"],
    "acer": ["--env-id", "InvertedPendulum-v4", "--num-workers", "1", "--total-timesteps", "400"],
    "p3s_td3": ["--env-id", "InvertedPendulum-v4", "--num-learners", "1", "--total-timesteps", "600"]
    + ["--t-initial", "200", "--learning-starts", "0"],
}
CAN_FILM_MUJOCO = ctypes.util.find_library("EGL") is not None  # libEGL: Mesa's or a GPU driver's


@pytest.mark.e2e
@pytest.mark.parametrize("script", list(COPIED_RUNS))
def test_a_script_copied_with_common_into_an_empty_folder_trains_films_resumes_and_evaluates(tmp_path, script):
    """The script and common/ alone, in a folder of their own: a run trains, saves its model and checkpoint and
    evaluates itself; `--resume` loads that checkpoint and ends the run again (its budget is spent). The scripts with
    continuous actions (a3c, acer, p3s_td3, vmpo_mujoco) run InvertedPendulum-v4 with `--capture-video` where libEGL
    is: the run's first evaluation episode as an animated PNG of MuJoCo frames; and `evaluate.py --capture-video` of
    the saved model writes one too."""

    from PIL import Image

    shutil.copy(os.path.join(ROOT, f"{script}.py"), tmp_path)
    shutil.copytree(os.path.join(ROOT, "common"), tmp_path / "common", ignore=shutil.ignore_patterns("__pycache__"))
    assert sorted(os.listdir(tmp_path)) == sorted(["common", f"{script}.py"])
    film = CAN_FILM_MUJOCO and "InvertedPendulum-v4" in COPIED_RUNS[script]
    argv = [*COPIED_RUNS[script], *(["--capture-video"] if film else []), "--save-model", "--eval-episodes", "2"]
    cmd = [sys.executable, f"{script}.py", *argv, "--run-dir", "runs"]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stderr == "", out.stderr[-3000:]  # the end of a run: no warning either
    (run,) = glob.glob(str(tmp_path / "runs" / "*"))
    assert {"model.pt", "checkpoint.pt", "summary.json", "args.json"} <= set(os.listdir(run))
    summary = json.load(open(os.path.join(run, "summary.json")))
    assert summary["eval_mean_return"] is not None and summary["total_timesteps"] > 0

    def check_video(path):
        with Image.open(path) as v:
            assert v.size == (MUJOCO_FRAME, MUJOCO_FRAME) and v.n_frames >= 2
            assert np.asarray(v.convert("RGB")).std() > 10  # the pole and the rail, not a blank frame

    if film:
        video = os.path.join(run, "videos", "eval_episode_0.png")
        check_video(video)
        os.remove(video)
        cmd = [sys.executable, "evaluate.py", os.path.join(run, "model.pt"), "--episodes", "1", "--capture-video"]
        filmed = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert filmed.returncode == 0, filmed.stderr
        check_video(video)
    resumed = subprocess.run(
        [sys.executable, f"{script}.py", "--resume", run], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0 and resumed.stderr == "", resumed.stderr[-3000:]
    assert json.load(open(os.path.join(run, "summary.json")))["total_timesteps"] == summary["total_timesteps"]


@pytest.mark.parametrize("where", ["impala_vtrace", "vmpo_atari", "vmpo_mujoco", "a3c", "acer", "p3s_td3"])
def test_resume_of_a_damaged_or_foreign_run_folder_is_one_line(tmp_path, where):
    """`--resume` of a folder whose checkpoint.pt is truncated, is not a torch file, or is another script's
    (with its name, or an older one without it): exit status 2 and one `error:` line, before any work."""
    module = importlib.import_module(where)
    other = "a3c" if where != "a3c" else "acer"
    foreign = {"args": dataclasses.asdict(importlib.import_module(other).Args()), "global_step": 10, "t": 1}
    own = {"args": dataclasses.asdict(module.Args()), "global_step": 10, "t": 1, "script": f"{where}.py"}
    cases = {
        "truncated": (own, lambda b: b[: len(b) // 2], "cannot be read as a checkpoint"),
        "text": (None, lambda b: b"step 10\n", "cannot be read as a checkpoint"),
        "named": ({**foreign, "script": f"{other}.py"}, None, f"continue it with python {other}.py --resume"),
        "older": (foreign, None, "a run of another script"),
        "not-a-dict": ([1, 2], None, "is not a checkpoint"),
    }
    for name, (obj, damage, needle) in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        torch.save(obj, folder / "checkpoint.pt")
        if damage:
            (folder / "checkpoint.pt").write_bytes(damage((folder / "checkpoint.pt").read_bytes()))
        (tmp_path / "runs" / name).mkdir(parents=True)
        assert_usage_error(f"{where}.py", ["--resume", str(folder)], tmp_path / "runs" / name, needle)


def test_evaluation_cli_of_a_damaged_or_wrong_file_is_one_line(tmp_path):
    """`python evaluate.py` of a truncated model.pt, a text file, a checkpoint.pt, or a model naming no script of
    this project: exit status 2 and one `error:` line, no traceback."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    torch.save({"script": "a3c", "env_id": "CartPole-v1", "weights": torch.zeros(1000)}, tmp_path / "good.pt")
    (tmp_path / "truncated.pt").write_bytes((tmp_path / "good.pt").read_bytes()[:500])
    (tmp_path / "text.pt").write_text("not a model\n")
    checkpoint = {"args": {}, "global_step": 10, "returns": [], "wall_time_s": 1.0, "script": "a3c.py"}  # RunLog.state
    torch.save(checkpoint, tmp_path / "checkpoint.pt")
    torch.save({"script": "os", "env_id": "CartPole-v1"}, tmp_path / "foreign.pt")
    torch.save({"script": "no_such_script", "env_id": "CartPole-v1"}, tmp_path / "missing.pt")
    cases = {
        "truncated.pt": "cannot be read as a model.pt",
        "text.pt": "cannot be read as a model.pt",
        "checkpoint.pt": "is a checkpoint; evaluate.py plays the model.pt",
        "foreign.pt": "names os, which is not a script of this project",
        "missing.pt": "no_such_script.py, which is not beside evaluate.py",
        "absent.pt": "no such file",
    }
    pipes = dict(cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # side by side: each is a process of its own that reads its file and writes nothing
    procs = {name: subprocess.Popen([sys.executable, "evaluate.py", str(tmp_path / name)], **pipes) for name in cases}
    try:
        for name, needle in cases.items():
            _, err = procs[name].communicate(timeout=240)
            lines = err.strip().splitlines()
            assert procs[name].returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), err
            assert needle in lines[0], err
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()


def test_check_render_names_what_to_install_when_egl_is_missing(monkeypatch):
    """Without a usable libEGL, `--capture-video` of a MuJoCo task is one line before any work (the probe runs in a
    child, so a failure cannot end this process); classic control and Atari render without it."""
    monkeypatch.setattr(common.envs, "EGL_LIBRARY", "libEGL-not-installed.so.1")
    with pytest.raises(UsageError, match="apt install libegl1"):
        common.envs.check_render("InvertedPendulum-v4")
    common.envs.check_render("Pendulum-v1")  # no OpenGL needed
    common.envs.check_render("Pong-v5")


@pytest.mark.skipif(ctypes.util.find_library("EGL") is None, reason="no libEGL (Mesa's or a GPU driver's)")
@pytest.mark.parametrize("env_id", ["Hopper-v4", "CheetahRun-v1"])
def test_envpool_renders_mujoco_once_egl_is_loaded(env_id):
    """envpool draws MuJoCo (Gym and dm_control) offscreen with the libEGL this process has loaded, which
    `make_env(render=True)` loads (undocumented envpool behaviour, so pinned here): frames of the set size, a lit
    scene (not blank), and a scene that moves as the env steps."""
    check_render(env_id)
    env = make_env(env_id, 2, 0, training=False, render=True)
    env.reset()
    first = env.render()
    assert first.shape == (1, MUJOCO_FRAME, MUJOCO_FRAME, 3) and first.dtype == np.uint8 and first.std() > 10
    for _ in range(20):
        env.step(np.stack([env.action_space.sample() for _ in range(2)]))
    assert np.abs(env.render().astype(int) - first).mean() > 0.1


# --------------------------------------------------------------------------------------------------------
# Every script, the same behaviour: a row per script.


@pytest.mark.parametrize("script", SCRIPTS)
def test_import_runs_nothing(script):
    assert imported_envpool_modules(script) == "[]"


BAD_INPUTS = [  # (script, argv, what its one line names)
    ("impala_vtrace", "--env-id Breakot-v5", "unknown env id"),
    ("impala_vtrace", "--env-id HalfCheetah-v4", "continuous actions"),
    ("impala_vtrace", "--env-id CartPole-v1 --unroll-length 0", "--unroll-length"),
    ("impala_vtrace", "--env-id CartPole-v1 --lr-anneal-steps -1", "--lr-anneal-steps"),
    ("impala_vtrace", "--env-id CartPole-v1 --num-envs 6 --num-actors 4", "--num-envs"),
    ("impala_vtrace", "--env-id CartPole-v1 --total-timesteps 10", "less than one batch"),
    ("impala_vtrace", "--env-ids Pong-v5 CartPole-v1", "takes Atari games"),
    ("impala_vtrace", "--env-ids Pong-v5 Breakout-v5 --num-actors 3 --num-envs 6", "multiple of the number of games"),
    ("impala_vtrace", "--env-ids atari58", "unknown env id"),
    ("impala_vtrace", "--resume runs/no-such-run", "--resume"),
    ("vmpo_atari", "--env-id Breakot-v5", "unknown env id"),
    ("vmpo_atari", "--env-id HalfCheetah-v4", "continuous actions"),
    ("vmpo_atari", "--env-id CartPole-v1 --gamma 1.5", "--gamma"),
    ("vmpo_atari", "--env-id CartPole-v1 --eps-alpha -1", "--eps-alpha"),
    ("vmpo_atari", "--env-id Breakout-v5 --network deep --channels 16 32", "--channels"),
    ("vmpo_atari", "--env-id CartPole-v1 --total-timesteps 10", "less than one batch"),
    ("vmpo_atari", "--env-id CartPole-v1 --num-minibatches 3", "--num-minibatches 3"),
    ("vmpo_atari", "--env-ids Pong-v5 CartPole-v1", "takes Atari games"),
    ("vmpo_atari", "--env-ids atari5 --num-actors 4 --num-envs 8", "multiple of the number of games"),
    ("vmpo_atari", "--resume runs/no-such-run", "--resume"),
    ("vmpo_mujoco", "--env-id HalfCheetah-v9", "unknown env id"),
    ("vmpo_mujoco", "--env-id CartPole-v1", "discrete actions"),
    ("vmpo_mujoco", "--env-id Pendulum-v1 --num-minibatches 3", "--num-minibatches 3"),
    ("vmpo_mujoco", "--env-id Pendulum-v1 --eps-alpha-sigma 0", "--eps-alpha-sigma"),
    ("vmpo_mujoco", "--env-id Pendulum-v1 --total-timesteps 10", "less than one batch"),
    ("vmpo_mujoco", "--preset humanoid-pixels", "--preset"),
    ("vmpo_mujoco", "--resume runs/no-such-run", "--resume"),
    ("a3c", "--env-id Breakout-v9", "unknown env id"),
    ("a3c", "--env-id CartPole-v1 --cuda", "--cuda"),
    ("a3c", "--env-id CartPole-v1 --num-envs 0", "--num-envs"),
    ("a3c", "--env-id CartPole-v1 --t-max -1", "--t-max"),
    ("a3c", "--env-id CartPole-v1 --total-timesteps 3", "less than one rollout"),
    ("a3c", "--env-id CartPole-v1 --rmsprop-alpha 1", "--rmsprop-alpha"),
    ("a3c", "--env-id CartPole-v1 --hidden 0", "--hidden"),
    ("a3c", "--resume runs/no-such-run", "--resume"),
    ("a3c", "--env-id HalfCheetah-v4 --method n-step-q", "takes discrete actions"),
    ("a3c", "--env-id CartPole-v1 --method one-step-q --lstm", "--lstm is A3C's"),
    ("a3c", "--env-id CartPole-v1 --method one-step-sarsa --target-update-period -1", "--target-update"),
    ("acer", "--env-id Breakout-v9", "unknown env id"),
    ("acer", "--env-id HalfCheetah-v4 --replay-ratio 0", "replay only"),
    ("acer", "--env-id CartPole-v1 --cuda", "--cuda"),
    ("acer", "--env-id CartPole-v1 --k -1", "--k"),
    ("acer", "--env-id CartPole-v1 --replay-ratio -1", "--replay-ratio"),
    ("acer", "--env-id CartPole-v1 --delta 0", "--delta"),
    ("acer", "--env-id CartPole-v1 --avg-decay 1", "--avg-decay"),
    ("acer", "--env-id CartPole-v1 --replay-size 10", "--replay-size"),
    ("acer", "--env-id CartPole-v1 --scale-rewards", "--scale-rewards"),
    ("acer", "--env-id CartPole-v1 --bf16", "--bf16"),
    ("acer", "--resume runs/no-such-run", "--resume"),
    ("p3s_td3", "--env-id HalfCheetah-v9", "unknown env id"),
    ("p3s_td3", "--env-id CartPole-v1", "discrete actions"),
    ("p3s_td3", "--env-id Pendulum-v1 --num-learners 0", "--num-learners"),
    ("p3s_td3", "--env-id Pendulum-v1 --num-learners 4 --buffer-size 300", "--buffer-size"),
    (
        "p3s_td3",
        "--env-id Pendulum-v1 --t-initial 2500 --learning-starts 0 --total-timesteps 5000",
        "before the first update",
    ),
    ("p3s_td3", "--env-id Pendulum-v1 --learning-starts 30000", "before the first update"),
    ("p3s_td3", "--env-id Pendulum-v1 --updates-per-step 0", "--updates-per-step"),
    ("p3s_td3", "--env-id Pendulum-v1 --beta-init 5000", "--beta-init"),
    ("p3s_td3", "--env-id Pendulum-v1 --tau 2", "--tau"),
    ("p3s_td3", "--resume runs/no-such-run", "--resume"),
]


@pytest.mark.e2e
@pytest.mark.parametrize("script, argv, needle", BAD_INPUTS)
def test_bad_input_one_clear_line(script, argv, needle, tmp_path):
    assert_usage_error(f"{script}.py", flags(argv), tmp_path, needle)


FOUR_ENVS, VMPO_RUN = "--num-envs 4 --batch-size 4", "--num-minibatches 1 --unroll-length 10"
LONG_RUN = f"--total-timesteps 100000000 {FOUR_ENVS} --eval-episodes 0"  # a budget not spent within a test
KILLED = {  # a run the kills end, and the kills tried
    "impala_vtrace": (f"--env-id CartPole-v1 {LONG_RUN}", "actor sigterm sigint-twice"),
    "vmpo_atari": (f"--env-id CartPole-v1 {LONG_RUN} {VMPO_RUN} --no-use-lstm", "actor sigint-twice"),
    "vmpo_mujoco": (f"--env-id Pendulum-v1 {LONG_RUN} {VMPO_RUN}", "actor sigint-twice"),
    "a3c": (HOGWILD_LONG_RUN, "worker sigint-twice"),
    "acer": (HOGWILD_LONG_RUN, "worker sigint-twice"),
}


@pytest.mark.e2e
@pytest.mark.parametrize("script, victim", [(s, v) for s, (_, victims) in KILLED.items() for v in victims.split()])
def test_killed_process_ends_the_run(tmp_path, script, victim):
    """Once the run is in its loop (its first progress line): a SIGKILLed actor or worker ends the run non-zero,
    naming it; a polite kill (SIGTERM) stops the run and takes its actors with it (Ctrl-C: the tests of a stopped
    update); two Ctrl-Cs end it with 130 and no traceback. No spawned process outlives the main process
    (`assert_killed_process_ends_the_run`)."""
    err = assert_killed_process_ends_the_run(f"{script}.py", flags(KILLED[script][0]), tmp_path, victim)
    assert (script, victim) != ("impala_vtrace", "actor") or "actor 0 died" in err


NON_FINITE = {  # a short run, what its line names (one of), and what its last good checkpoint holds (None: maybe none)
    "impala_vtrace": (f"--env-id CartPole-v1 {FOUR_ENVS}", "non-finite", "update"),
    "vmpo_atari": (f"--env-id CartPole-v1 {FOUR_ENVS} --num-minibatches 1 --no-use-lstm", "at update", "update"),
    "vmpo_mujoco": (f"--env-id Pendulum-v1 {FOUR_ENVS} {VMPO_RUN} --update-epochs 1", "at update", "update"),
    "a3c": ("--env-id CartPole-v1 --num-workers 2", "policy|loss|gradient", None),  # Hogwild workers can get there
    "acer": ("--env-id CartPole-v1 --num-workers 2", "policy|loss|gradient", None),  # before the first checkpoint
    "p3s_td3": (
        "--env-id Pendulum-v1 --num-learners 2 --t-initial 0 --learning-starts 20 --best-period 50 --hidden 32"
        " --total-timesteps 100000",
        "loss",
        "learners",
    ),
}


@pytest.mark.e2e
@pytest.mark.parametrize("script", list(NON_FINITE))
def test_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, script):
    """A learning rate of 1e30 blows the weights up within a few updates (p3s_td3: from t = 10, 20 rows of D): exit 1
    with a line naming the non-finite quantity; the checkpoint is the last one with finite weights
    (`assert_non_finite_stops_the_run`)."""
    argv, named, kept = NON_FINITE[script]
    line, state = assert_non_finite_stops_the_run(
        f"{script}.py", flags(argv), tmp_path, checkpoint_expected=kept is not None, processes=script != "p3s_td3"
    )
    assert re.search(named, line), line
    if kept == "update":
        assert state["update"] >= 1
    if kept == "learners":
        for net in ("actor", "qf", "actor_target", "qf_target"):
            assert all(bool(torch.isfinite(v).all()) for v in state["learners"][net].values())


EIGHT_ENVS = "--num-envs 8 --batch-size 8"
CTRL_C_IN_AN_UPDATE = {  # a run whose updates take a while on a CPU, and its steps per update
    "impala_vtrace": (f"--env-id Breakout-v5 {EIGHT_ENVS} --network deep --channels 32 64 64 --use-lstm", 8 * 20),
    "vmpo_atari": (f"--env-id Breakout-v5 {EIGHT_ENVS}", 8 * 20),
    "vmpo_mujoco": (f"--env-id Pendulum-v1 {FOUR_ENVS} {VMPO_RUN} --hidden 1024 1024", 4 * 10),
}


@pytest.mark.e2e
@pytest.mark.parametrize("script", list(CTRL_C_IN_AN_UPDATE))
def test_ctrl_c_during_an_update_completes_it_and_saves_it(tmp_path, script):
    """Ctrl-C while the second update is collected or in progress (impala_vtrace: the deep network with wide channels
    and an LSTM, where one update takes many seconds; vmpo_mujoco: a wide network) lets that update finish (an update
    is never half-applied, no copy of the learner is kept to undo it), starts no other, checkpoints the last completed
    update and ends the run with exit 130 (`ctrl_c_during_second_update`)."""
    argv, steps_per_update = CTRL_C_IN_AN_UPDATE[script]
    ctrl_c_during_second_update(f"{script}.py", flags(argv), tmp_path, steps_per_update=steps_per_update)
