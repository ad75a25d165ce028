"""benchmarks/learning.py: the curves and the table it draws from TensorBoard logs, and its time limit."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import learning  # noqa: E402
from tests.helpers import ROOT, flags  # noqa: E402


def benchmark(argv, timeout=120):
    """Runs `python benchmarks/...` with `argv` (the script first) in the repository; asserts exit 0 and returns the
    completed process."""
    res = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def test_running_mean_and_curve_on_grid_match_loops():
    rng = np.random.default_rng(0)
    values = rng.normal(size=57)
    expected = [values[max(0, i + 1 - 20) : i + 1].mean() for i in range(len(values))]
    np.testing.assert_allclose(learning.running_mean(values), expected)
    steps = np.sort(rng.choice(10_000, size=57, replace=False)).astype(float)
    grid = np.array([0.0, steps[0] - 1, steps[0], steps[10] + 0.5, 20_000.0])
    curve = learning.curve_on_grid(steps, values, grid)
    assert np.isnan(curve[0]) and np.isnan(curve[1])  # before the first episode
    np.testing.assert_allclose(curve[2:], [expected[0], expected[10], expected[-1]])


def fake_run(out, seed, returns):
    from torch.utils.tensorboard import SummaryWriter

    folder = os.path.join(out, "runs", f"a3c__CartPole-v1__s{seed}", f"CartPole-v1__a3c__{seed}__1")
    writer = SummaryWriter(folder)
    for i, r in enumerate(returns):
        writer.add_scalar("charts/episodic_return", r, 100 * (i + 1))
    writer.close()
    with open(os.path.join(folder, "summary.json"), "w") as f:
        json.dump(
            {"total_timesteps": 100 * len(returns), "wall_time_s": 10.0 * seed, "eval_mean_return": 50.0 * seed}, f
        )


@pytest.mark.e2e
def test_minutes_of_running_leave_out_the_gaps_between_sessions(tmp_path):
    """The curves against wall-clock minutes: episodes 30 s apart, then a 3-hour gap (stopped, resumed later)."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    for i, wall in enumerate([1000.0, 1030.0, 1060.0, 1060.0 + 3 * 3600, 1090.0 + 3 * 3600]):
        writer.add_scalar("charts/episodic_return", float(i), 100 * (i + 1), walltime=wall)
    writer.close()
    np.testing.assert_allclose(learning.episode_returns(str(tmp_path))[2], [0.0, 0.5, 1.0, 1.0, 1.5])


def test_a_stopped_run_is_resumed_and_a_finished_one_run_again(tmp_path, monkeypatch):
    """Running a preset again continues each run that stopped before its budget (a checkpoint, no summary.json) from
    its checkpoint; a finished run (summary.json) is not resumed."""
    started = []
    monkeypatch.setattr(learning.subprocess, "Popen", lambda cmd, **kw: started.append(cmd))
    entry = learning.Entry("vmpo_mujoco", "Hopper-v4", 10_000_000)
    run = os.path.join(learning.run_folder(str(tmp_path), entry, 1), "Hopper-v4__vmpo_mujoco__1__1")
    os.makedirs(run)
    open(os.path.join(run, "checkpoint.pt"), "w").close()
    learning.launch(entry, 1, str(tmp_path), [])
    assert started[-1][1:] == [os.path.join(ROOT, "vmpo_mujoco.py"), "--resume", run]
    open(os.path.join(run, "summary.json"), "w").close()
    learning.launch(entry, 1, str(tmp_path), [])
    assert "--resume" not in started[-1] and started[-1][started[-1].index("--total-timesteps") + 1] == "10000000"


def test_report_from_logs(tmp_path):
    out = str(tmp_path)
    fake_run(out, 1, np.arange(40.0))  # last 20: 20..39, mean 29.5
    fake_run(out, 2, np.arange(40.0) + 10)  # mean 39.5
    benchmark(flags("benchmarks/learning.py --preset cpu --only a3c --seeds 1 2 --report-only --out", [out]))
    table = open(os.path.join(out, "learning_cpu.md")).read()
    row = next(line for line in table.splitlines() if "CartPole-v1" in line)
    # last 100 (all 40): means 19.5 and 29.5
    assert "| a3c | CartPole-v1 | 300,000 | 2 | 4,000 | 34.5 ± 5.0 | 24.5 ± 5.0 | 75.0 ± 25.0 | 15 s |" == row
    assert "InvertedPendulum" not in table  # no runs there: no row
    assert os.path.getsize(os.path.join(out, "learning_cpu.png")) > 10_000
    saved = json.load(open(os.path.join(out, "learning_cpu.json")))
    assert saved["rows"][0]["final_mean_20"] == [29.5, 39.5]
    assert saved["rows"][0]["final_mean_100"] == [19.5, 29.5]


@pytest.mark.e2e
def test_time_limit_stops_a_run_with_ctrl_c(tmp_path):
    """A run past --time-limit gets Ctrl-C: it saves a checkpoint and stops, and the table says how far it got.

    The budget is raised far past what 20 s can reach; the 20 s count from the run's first progress line, so that a
    start-up slowed by a loaded machine (three processes importing torch) cannot use them up (it did once)."""
    argv = flags("benchmarks/learning.py --preset cpu --only a3c --seeds 1 --time-limit 20 --out", [str(tmp_path)])
    res = benchmark(flags(argv, "-- --total-timesteps 100000000"), timeout=300)
    assert "exit 130" in res.stdout
    saved = json.load(open(os.path.join(str(tmp_path), "learning_cpu.json")))
    reached = {r["env_id"]: r["steps_reached"][0] for r in saved["rows"]}
    assert 0 < reached["CartPole-v1"] < 100_000_000 and 0 < reached["InvertedPendulum-v4"] < 100_000_000
    assert len([p for p in os.listdir(os.path.join(str(tmp_path), "runs"))]) == 2
    runs = os.path.join(str(tmp_path), "runs")
    folders = [
        os.path.join(runs, d, f) for d in os.listdir(runs) for f in os.listdir(os.path.join(runs, d)) if "__" in f
    ]
    assert all(os.path.exists(os.path.join(folder, "checkpoint.pt")) for folder in folders)


@pytest.mark.parametrize("cuda", [False, True])
def test_throughput_all_runs_every_script_with_flags_it_accepts(cuda):
    """`benchmarks/throughput.py --script all`: one setting per script, and every command it will run (each
    process count) parses with that script's own command line."""
    import argparse
    import importlib

    import throughput
    import tyro

    settings = throughput.all_settings(cuda)
    expected = "impala_vtrace vmpo_atari impala_vtrace impala_vtrace vmpo_atari vmpo_mujoco a3c acer p3s_td3"
    assert [s["script"] for s in settings] == expected.split()
    for setting in settings:
        a = argparse.Namespace(cuda=cuda, **setting)
        m = importlib.import_module(a.script)
        for count in setting.get("workers", setting.get("learners", [None])):
            cmd = throughput.script_command(
                a.script,
                a.env_id,
                a.num_envs,
                a.timesteps,
                a.network if "network" in setting else None,
                throughput.script_extra(a, count),
                "runs",
            )
            args = tyro.cli(m.Args, args=cmd[2:])
            assert args.env_id == a.env_id and args.num_envs == a.num_envs and args.eval_episodes == 0
            if count is not None:
                assert getattr(args, "num_workers", getattr(args, "num_learners", None)) == count
            if a.script not in ("a3c", "acer"):  # Hogwild workers on CPU cores: measured without a GPU
                assert args.cuda == cuda


@pytest.mark.e2e
@pytest.mark.parametrize("script, env_id", [("impala_vtrace", "Breakout-v5"), ("vmpo_mujoco", "HalfCheetah-v4")])
def test_actor_profile_times_the_parts_of_the_actor_loop(tmp_path, script, env_id):
    """benchmarks/actor_profile.py runs the real actor loop briefly: every part timed, the parts add up to the
    measured rate, and the learner's cost and raw envpool are there."""
    out = tmp_path / "profile.json"
    argv = f"benchmarks/actor_profile.py --script {script} --env-id {env_id} --num-envs 4 --seconds 2 --out"
    res = benchmark(flags(argv, [str(out)]), timeout=300)
    r = json.load(open(out))
    parts = r["ms_per_batch"]
    assert set(parts) == {"recv", "refresh", "inference", "send", "unroll write", "rest (Python bookkeeping)"}
    assert all(v > 0 for k, v in parts.items() if k != "rest (Python bookkeeping)")
    ms_per_step = sum(parts.values()) / r["env_batch_size"]
    assert r["steps_per_second"] == pytest.approx(1e3 / ms_per_step, rel=1e-6)
    assert r["batches"] > 20 and r["learner_ms_per_step"] > 0 and r["raw_envpool_sps"] > 0
    assert "budget on" in res.stdout


@pytest.mark.e2e
def test_evaluation_curves_of_entries_on_one_env_are_drawn_together(tmp_path):
    """Entries that log evaluations as they go (p3s_td3's evaluations.jsonl), here P3S and TD3 on Hopper: a row each
    and one plot with both evaluation curves."""
    from torch.utils.tensorboard import SummaryWriter

    out = str(tmp_path)
    for name, evals in (("p3s_td3__Hopper-v4", [300.0, 900.0]), ("p3s_td3__Hopper-v4__td3", [200.0, 500.0])):
        folder = os.path.join(out, "runs", f"{name}__s1", "Hopper-v4__p3s_td3__1__1")
        writer = SummaryWriter(folder)
        for i in range(30):
            writer.add_scalar("charts/episodic_return", 10.0 * i, 1000 * (i + 1))
        writer.close()
        with open(os.path.join(folder, "evaluations.jsonl"), "w") as f:
            for k, v in enumerate(evals):
                f.write(json.dumps({"step": 15000 * (k + 1), "eval_return": v, "per_learner": [v]}) + "\n")
    benchmark(flags("benchmarks/learning.py --preset p3s-cpu --seeds 1 --report-only --out", [out]))
    table = open(os.path.join(out, "learning_p3s-cpu.md")).read()
    assert "| p3s_td3 | Hopper-v4 | 1,000,000 | 1 | 30,000 |" in table
    assert "| p3s_td3 --num-learners 1 | Hopper-v4 | 300,000 | 1 | 30,000 |" in table
    assert os.path.getsize(os.path.join(out, "learning_p3s-cpu_eval.png")) > 10_000


@pytest.mark.e2e
def test_delayed_runs_get_their_evaluations_at_milestones_and_the_population_plot(tmp_path):
    """The p3s-delayed-cpu preset: P3S on delayed Ant to 320k steps (evaluations every 4k, β and the distances in
    population.jsonl), TD3 to 120k. The table reads each run's last evaluation at or before 100k / 300k / 500k / 1M,
    "–" where the run did not get there; β's plot is drawn; `--only` picks an entry by its name."""
    from torch.utils.tensorboard import SummaryWriter

    out = str(tmp_path)
    for label, last in (("delayed", 320_000), ("delayed-td3", 120_000)):
        folder = os.path.join(out, "runs", f"p3s_td3__Ant-v4__{label}__s1", "Ant-v4__p3s_td3__1__1")
        writer = SummaryWriter(folder)
        for step in range(4000, last + 1, 4000):
            writer.add_scalar("charts/episodic_return", step / 1000, step)
        writer.close()
        with open(os.path.join(folder, "evaluations.jsonl"), "w") as f:
            for step in range(4000, last + 1, 4000):
                f.write(json.dumps({"step": step, "eval_return": step / 100 + (label == "delayed")}) + "\n")
        if label == "delayed":
            with open(os.path.join(folder, "population.jsonl"), "w") as f:
                for step in range(1000, last + 1, 1000):
                    row = dict(
                        step=step, beta=2.0 ** (step // 50_000), d_spread=0.1, d_change=0.02, d_search=0.05, best=0
                    )
                    f.write(json.dumps(row) + "\n")

    def report(*only):
        benchmark(flags("benchmarks/learning.py --preset p3s-delayed-cpu --seeds 1 --report-only --out", [out], only))
        return open(os.path.join(out, "learning_p3s-delayed-cpu.md")).read()

    table = report()
    assert "| p3s_td3 --reward-delay 20 | Ant-v4 | 1001.0 | 3001.0 | – | – |" in table
    assert "| p3s_td3 --reward-delay 20 --num-learners 1 | Ant-v4 | 1000.0 | – | – | – |" in table
    assert os.path.getsize(os.path.join(out, "learning_p3s-delayed-cpu_beta.png")) > 10_000
    table = report("--only", "p3s_td3__Ant-v4__delayed-td3")
    assert "--num-learners 1 | Ant-v4 | 1000.0 |" in table and "| p3s_td3 --reward-delay 20 | Ant" not in table


@pytest.mark.e2e
def test_a_multi_game_run_gets_a_row_and_a_curve_per_game(tmp_path):
    """A run of one agent on several games (`--env-ids`): each game's row reads its own TensorBoard tag, its steps
    as the run's over the games, and its own end-of-run evaluation; the single-game runs keep their rows."""
    from torch.utils.tensorboard import SummaryWriter

    out, games = str(tmp_path), ("Breakout-v5", "Qbert-v5", "BeamRider-v5")
    folder = os.path.join(out, "runs", "impala_vtrace__3games__s1", "3games__impala_vtrace__1__1")
    writer = SummaryWriter(folder)
    for i in range(30):  # game g scores 100 g + i; its episodes every 3,000 steps of the run
        for g, game in enumerate(games):
            writer.add_scalar("charts/episodic_return", 100.0 * g + i, 3000 * (i + 1))
            writer.add_scalar(f"charts/{game}/episodic_return", 100.0 * g + i, 3000 * (i + 1))
    writer.close()
    per_game = [{"env_id": game, "mean": 1000.0 + g} for g, game in enumerate(games)]
    with open(os.path.join(folder, "summary.json"), "w") as f:
        json.dump({"total_timesteps": 90_000, "wall_time_s": 60.0, "eval_per_game": per_game}, f)
    single = os.path.join(out, "runs", "impala_vtrace__Qbert-v5__s1", "Qbert-v5__impala_vtrace__1__1")
    writer = SummaryWriter(single)
    for i in range(30):
        writer.add_scalar("charts/episodic_return", 7.0, 1000 * (i + 1))
    writer.close()
    benchmark(flags("benchmarks/learning.py --preset impala-multi-cpu --seeds 1 --report-only --out", [out]))
    rows = {
        (r["script"], r["env_id"]): r
        for r in json.load(open(os.path.join(out, "learning_impala-multi-cpu.json")))["rows"]
    }
    multi = "impala_vtrace (3 games, steps ≈ all / 3)"
    assert set(rows) == {(multi, game) for game in games} | {("impala_vtrace", "Qbert-v5")}
    for g, game in enumerate(games):
        row = rows[(multi, game)]
        assert row["budget"] == 1_000_000 and row["steps_reached"] == [30_000]
        assert row["final_mean_20"] == [100.0 * g + 19.5]  # the last 20 of 0..29, that game's scores alone
        assert row["eval_mean_return"] == [1000.0 + g]
    assert rows[("impala_vtrace", "Qbert-v5")]["final_mean_20"] == [7.0]
    assert os.path.getsize(os.path.join(out, "learning_impala-multi-cpu.png")) > 10_000


@pytest.mark.e2e
def test_gpu_check_runs_every_step_where_no_gpu_is_seen(tmp_path):
    """benchmarks/gpu_check.sh --cpu: the GPU check's steps, each a few seconds where no GPU is seen, all ok; every
    run stopped by SIGINT kept its checkpoint, the resumed runs went on from theirs, each model.pt was evaluated."""
    out = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", str(tmp_path), "--cpu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [json.loads(x) for x in open(tmp_path / "gpu_check.jsonl")]
    assert out.returncode == 0 and out.stdout.strip().endswith(f"{len(lines)}/{len(lines)} steps ok"), out.stdout
    names = {x["name"] for x in lines}
    scripts = {"impala_vtrace", "vmpo_atari", "vmpo_mujoco", "p3s_td3", "a3c", "acer"}
    assert scripts | {f"torchrun_{s}" for s in ("impala_vtrace", "vmpo_atari", "vmpo_mujoco")} <= names
    assert {f"model_on_cpu_{s}" for s in ("impala_vtrace", "vmpo_atari", "vmpo_mujoco", "p3s_td3")} <= names
    for s in ("p3s_td3", "vmpo_mujoco"):  # the resumed run continued the stopped one: one folder, its line
        assert f"--resume {tmp_path}/runs/resume_{s}/" in open(tmp_path / f"resumed_{s}.log").read()
        assert "checkpoint at step" in open(tmp_path / f"resumed_{s}.log").read()
    assert all(x["exit_status"] in (0, 130) for x in lines if not x["name"].startswith("torchrun_"))
