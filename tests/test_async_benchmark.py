"""benchmarks/async_rl.py's task and arithmetic: the slow tool's latency is seeded and long-tailed
(median 0.3 s, p99 >= 5 s), its answers are code_tool's, and time to accuracy is read off the
held-out curve against the same seed's synchronous final accuracy."""
import asyncio
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import async_rl  # noqa: E402
from examples.slow_tools.env import SlowCodeToolEnv  # noqa: E402


def test_the_slow_tool_is_seeded_and_long_tailed():
    env = SlowCodeToolEnv()
    delays = []
    for i in range(4000):
        env.reset({"id": f"q{i}", "prompt": "Compute 2 * 3.", "answer": "6"})
        delays.append(env.delay_s("<code>print(2 * 3)</code>"))
    delays.sort()
    assert delays[2000] == pytest.approx(0.3, rel=0.1)        # median
    assert delays[int(0.99 * 4000)] >= 5.0                      # p99
    row = {"id": "q7", "prompt": "Compute 2 * 3.", "answer": "6"}
    again, other_seed = SlowCodeToolEnv(), SlowCodeToolEnv(latency_seed=1)
    for e in (env, again, other_seed):
        e.reset(row)
    assert env.delay_s("<code>print(6)</code>") == again.delay_s("<code>print(6)</code>")   # the same call waits alike
    assert env.delay_s("<code>print(6)</code>") != other_seed.delay_s("<code>print(6)</code>")


def test_the_slow_tool_answers_as_code_tool_after_its_delay():
    env = SlowCodeToolEnv(latency_median_s=0.01, latency_sigma=0.0)
    env.reset({"id": "a", "prompt": "Compute 2 * 3.", "answer": "6"})
    result = asyncio.run(env.step("<code>print(2 * 3)</code>"))
    assert result.observation == "<output>6</output>" and result.reward == 1.0 and not result.done
    final = asyncio.run(env.step("<answer>6</answer>"))
    assert final.done and final.info["outcome"] == 1.0


def test_a_row_without_tool_delay_answers_at_once_and_alike():
    """--scoring-without-delay's held-out rows: the same answer, none of the (here 50 s) wait."""
    env = SlowCodeToolEnv(latency_median_s=50.0, latency_sigma=0.0)
    env.reset({"id": "a", "prompt": "Compute 2 * 3.", "answer": "6"})
    assert env.delay_s("<code>print(2 * 3)</code>") == pytest.approx(50.0)
    env.reset({"id": "a", "prompt": "Compute 2 * 3.", "answer": "6", "tool_delay": False})
    assert env.delay_s("<code>print(2 * 3)</code>") == 0.0
    result = asyncio.run(asyncio.wait_for(env.step("<code>print(2 * 3)</code>"), timeout=20))
    assert result.observation == "<output>6</output>" and result.reward == 1.0


def _run(seed, mode, accuracies, wall):
    curve = [{"step": 5 * (k + 1), "wall_s": w, "heldout_accuracy": a} for k, (a, w) in enumerate(zip(accuracies, wall))]
    summary = {"final_accuracy": accuracies[-1], "wall_s": wall[-1], "steps_per_s": 1.0, "trajectories_per_s": 1.0,
               "engine_busy_frac": 0.5, "trainer_busy_frac": 0.5, "staleness_mean": None, "stale_groups_total": 0.0,
               "health_flags": []}
    return {"seed": seed, "mode": mode, "steps": 10, "curve": curve, "summary": summary}


def test_time_to_target_is_the_first_eval_at_the_sync_final_accuracy(tmp_path):
    results = [_run(0, "sync", [0.2, 0.6, 0.8], [100, 200, 300]), _run(0, "async_s2", [0.5, 0.8, 0.9], [50, 100, 150]),
               _run(1, "sync", [0.3, 0.7], [100, 200]), _run(1, "async_s2", [0.4, 0.6], [40, 80])]
    table = async_rl.modes_table(results, ["sync", "async_s2"])
    assert table["sync"]["time_to_target_s_each"] == [300, 200]
    assert table["async_s2"]["time_to_target_s_each"] == [100, None]   # seed 1 never reached 0.7
    assert table["async_s2"]["time_to_target_s"] is None
    assert table["sync"]["final_accuracy"] == pytest.approx(0.75)
    assert table["sync"]["final_accuracy_sd"] == pytest.approx(math.sqrt(0.005))
    async_rl.write_report(tmp_path / "ASYNC.md", "slow", async_rl.modes_table(results[:2], ["sync", "async_s2"]),
                          "python benchmarks/async_rl.py --quick")
    text = (tmp_path / "ASYNC.md").read_text()
    assert "| async_s2 | [0] | 100 | 3.00x |" in text and "--quick" in text
    # another task's table and the text written around the tables stay when one task is rewritten
    (tmp_path / "ASYNC.md").write_text(text + "\n## What the numbers say\n\nhand-written\n")
    async_rl.write_report(tmp_path / "ASYNC.md", "tail", async_rl.modes_table(results[:2], ["sync"]), "tail command")
    async_rl.write_report(tmp_path / "ASYNC.md", "slow", async_rl.modes_table(results[2:], ["sync", "async_s2"]),
                          "python benchmarks/async_rl.py")
    text = (tmp_path / "ASYNC.md").read_text()
    assert text.count("## Task `slow`") == 1 and "| async_s2 | [1] | - (0/1 seeds) | - |" in text
    assert "| [0] | 100 |" not in text
    # the speed-up takes sync's times on the mode's own seeds: seed 0 only here (300 s, not the mean 250 s)
    only_seed_0 = async_rl.modes_table(results + [_run(0, "async_s1", [0.8], [150])], ["sync", "async_s1"])
    assert async_rl.speedup(only_seed_0["sync"], only_seed_0["async_s1"]) == pytest.approx(2.0)
    assert async_rl.speedup(table["sync"], table["async_s2"]) is None        # seed 1 never got there
    assert "## Task `tail`" in text and "tail command" in text and "hand-written" in text


def test_time_to_target_without_the_scoring_subtracts_every_evaluation_up_to_it(tmp_path):
    sync, fast = _run(0, "sync", [0.5, 0.9, 0.8], [100, 200, 300]), _run(0, "async_s1", [0.6, 0.85], [60, 120])
    for run, scoring in ((sync, [40, 40, 40]), (fast, [30, 30])):
        for point, seconds in zip(run["curve"], scoring):
            point["eval_s"] = seconds
    curve = sync["curve"]
    assert async_rl.time_to_target(curve, 0.8) == 200                          # the first point at 0.8
    assert async_rl.time_to_target(curve, 0.8, scoring_excluded=True) == 200 - 80   # less two evaluations
    assert async_rl.time_to_target(curve, 0.95, scoring_excluded=True) is None
    table = async_rl.modes_table([sync, fast], ["sync", "async_s1"])
    assert table["async_s1"]["unscored_time_to_target_s_each"] == [120 - 60]
    assert async_rl.speedup(table["sync"], table["async_s1"]) == pytest.approx(200 / 120)
    assert async_rl.speedup(table["sync"], table["async_s1"], "unscored_time_to_target_s_each") == pytest.approx(2.0)
    async_rl.write_report(tmp_path / "ASYNC.md", "tail", table, "tail command")
    text = (tmp_path / "ASYNC.md").read_text()
    assert "| async_s1 | [0] | 120 | 1.67x | 60 | 2.00x | 0.850 |" in text and "at 120 s (scoring 30 s)" in text
    # a run from before eval_s existed: no scoring-excluded time, and no such columns without any
    unrecorded = _run(0, "async_s2", [0.9], [90])
    assert async_rl.time_to_target(unrecorded["curve"], 0.8, scoring_excluded=True) is None
    async_rl.write_report(tmp_path / "ASYNC.md", "tail", async_rl.modes_table([sync, fast, unrecorded],
                                                                              ["sync", "async_s2"]), "tail command")
    assert "| async_s2 | [0] | 90 | 2.22x | - | - | 0.900 |" in (tmp_path / "ASYNC.md").read_text()
    for point in sync["curve"]:
        del point["eval_s"]
    async_rl.write_report(tmp_path / "ASYNC.md", "tail", async_rl.modes_table([sync, unrecorded], ["sync", "async_s2"]),
                          "tail command")
    text = (tmp_path / "ASYNC.md").read_text()
    assert "scoring excluded" not in text and "| async_s2 | [0] | 90 | 2.22x | 0.900 |" in text


def test_the_last_line_names_quick_modes_sync_and_async():
    table = async_rl.modes_table([_run(0, "sync", [0.5, 0.9], [100, 200]), _run(0, "async_s2", [0.95], [80])],
                                 ["sync", "async_s2"])
    quick = async_rl.last_line(table, quick=True)
    assert quick == {"modes": {"sync": {"time_to_target_s": 200, "final_accuracy": 0.9, "wall_s": 200},
                               "async": {"time_to_target_s": 80, "final_accuracy": 0.95, "wall_s": 80}}}
    assert set(async_rl.last_line(table, quick=False)["modes"]) == {"sync", "async_s2"}


def test_every_mode_makes_a_valid_config():
    for mode in async_rl.MODES:
        cfg = async_rl.config(0, "slow", mode, 40)
        assert cfg.train.eval_every == 5 and cfg.rollout.rejoin == "ready"
        assert (cfg.train.mode == "async") == mode.startswith("async")
        assert cfg.algorithm.mini_batches == (4 if "_mb4" in mode else 1)
        rate, _, kl = mode.removesuffix("_2threads").partition("_kl")
        assert cfg.cluster.threads_per_actor == (2 if mode.endswith("_2threads") else 0)
        assert cfg.train.lr == (2.5e-4 if rate.endswith("_half_lr") else 1.25e-4 if rate.endswith("_quarter_lr")
                                else 5e-4)
        assert cfg.algorithm.kl_coef == float(kl or 0)
    tail = async_rl.config(0, "tail", "sync", 20)
    assert tail.env.options == {"latency_sigma": 1.75} and tail.train.steps == 20
    assert tail.train.eval_examples == 64 and async_rl.config(0, "tail", "sync", 20, 256).train.eval_examples == 256
    median, sigma = SlowCodeToolEnv().median, tail.env.options["latency_sigma"]
    assert median * math.exp(2.326 * sigma) == pytest.approx(17.6, abs=0.1)   # its p99, seconds


def test_trace_summary_finds_the_kl_jump_and_the_smallest_weight():
    trace = [{"step": 1, "reward_mean": 0.2, "kl_ref": 0.0, "is_weight_mean": 1.0},
             {"step": 2, "reward_mean": 0.9, "kl_ref": 0.5, "is_weight_mean": 0.94},
             {"step": 3, "reward_mean": 0.0, "kl_ref": 2009.0, "is_weight_mean": 0.97},
             {"step": 4, "reward_mean": 0.0, "kl_ref": 3.0}]
    assert async_rl.trace_summary(trace) == {"best_reward": 0.9, "first_kl_over_1": 3, "max_kl_ref": 2009.0,
                                             "min_is_weight_mean": 0.94}
    sync = async_rl.trace_summary([{"step": 1, "reward_mean": 0.5, "kl_ref": 0.2}])
    assert sync["first_kl_over_1"] is None and sync["min_is_weight_mean"] is None


def test_a_runs_cpu_probe_shows_beside_its_curve_and_only_where_taken(tmp_path):
    probe = async_rl.cpu_probe_s(repeats=1)
    assert 0 < probe < 60
    sync, fast = _run(0, "sync", [0.5, 0.9], [100, 200]), _run(0, "async_s1", [0.95], [80])
    fast["cpu_probe_s"] = 0.42
    async_rl.write_report(tmp_path / "ASYNC.md", "tail", async_rl.modes_table([sync, fast], ["sync", "async_s1"]), "c")
    text = (tmp_path / "ASYNC.md").read_text()
    assert "- async_s1, seed 0 (CPU probe 0.42 s): 5: 0.950 at 80 s" in text and "- sync, seed 0: 5: 0.500" in text
    assert "the CPU probe" in text
    async_rl.write_report(tmp_path / "ASYNC.md", "tail", async_rl.modes_table([sync], ["sync"]), "c")
    assert "the CPU probe" not in (tmp_path / "ASYNC.md").read_text()


def test_a_set_of_runs_in_its_own_results_file_gets_its_own_table(tmp_path):
    default = async_rl.ROOT / "benchmarks" / "results" / "async-tail.json"
    assert async_rl.results_and_table("tail", None) == (default, "tail")
    assert async_rl.results_and_table("tail", default) == (default, "tail")
    rerun = tmp_path / "async-tail-rerun.json"
    assert async_rl.results_and_table("tail", rerun) == (rerun, "tail-rerun")
    table = async_rl.modes_table([_run(0, "sync", [0.5, 0.8], [100, 200])], ["sync"])
    async_rl.write_report(tmp_path / "ASYNC.md", "tail", table, "first set")
    async_rl.write_report(tmp_path / "ASYNC.md", "tail-rerun", table, "second set", "x/async-tail-rerun.json")
    text = (tmp_path / "ASYNC.md").read_text()
    assert "first set` (benchmarks/async_rl.py; numbers from benchmarks/results/async-tail.json)" in text
    assert "second set` (benchmarks/async_rl.py; numbers from x/async-tail-rerun.json)" in text
