"""benchmarks/ecosystem.py's verdicts: a reasoning-gym row meets the target only when every seed
gains >= +10 points, the summary counts distinct tasks and multi-turn rows among those met, a row
under the target is explained by its worst seed's curves, and a row's other settings are shown
but not judged."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.ecosystem import ROWS, report, summary  # noqa: E402

ROW = {r.name: r for r in ROWS}


def _result(row: str, seed: int, gain: float, reward: list[float]) -> dict:
    return {"row": row, "seed": seed, "gain_pts": gain, "baseline": 0.1, "trained": 0.1 + gain / 100,
            "steps": len(reward), "wall_s": 300.0, "curves": {"reward_mean": reward}, "health": {}}


def test_a_row_meets_the_target_only_when_every_seed_gains_ten_points():
    rows = [ROW["letter_counting"], ROW["syllogism"], ROW["syllogism_retry"], ROW["syllogism_retry_lr2e-4"],
            ROW["guess_the_number"]]
    results = ([_result("letter_counting", s, g, [0.1, 0.3]) for s, g in enumerate([23.4, 20.3, 17.2])]
               + [_result("syllogism", s, g, [0.2, 0.5]) for s, g in enumerate([28.1, 12.0, 10.0])]
               + [_result("syllogism_retry", s, g, [0.3, 0.7, 0.4]) for s, g in enumerate([15.0, 9.9, 30.0])]
               + [_result("syllogism_retry_lr2e-4", s, g, [0.5, 0.0]) for s, g in enumerate([-28.1, 26.6, 14.1])]
               + [_result("guess_the_number", s, 0.0, [0.0, 0.0]) for s in range(3)])
    met, missed = summary(results, rows, [0, 1, 2])
    assert met.startswith("Met on every seed: letter_counting, syllogism (2 distinct reasoning-gym tasks: "
                          "letter_counting, syllogism; more than one turn: none)")
    # the worst seed (+9.9, seed 1) is the one explained; the game and the other settings have no target
    assert missed == ("Not met: syllogism_retry (worst seed 1, +9.9: reward_mean peaked at 0.70 (step 2), "
                      "ended at 0.40).")
    table = report(results, rows, [0, 1, 2], "python benchmarks/ecosystem.py")
    assert "| syllogism_retry |" in table and "**not met** (3/3 seeds ran)" in table
    assert "| guess_the_number |" in table and "no target (a game)" in table
    assert "other settings of syllogism_retry: -28.1 on its worst seed" in table


def test_a_row_with_seeds_missing_is_neither_met_nor_missed():
    rows = [ROW["ransom_note"], ROW["syllogism_retry"]]
    results = [_result("ransom_note", 0, 30.0, [0.1, 0.4])]
    lines = summary(results, rows, [0, 1, 2])
    assert lines == ["Met on every seed: none (0 distinct reasoning-gym tasks: -; more than one turn: none)."]
    table = report(results, rows, [0, 1, 2], "python benchmarks/ecosystem.py")
    assert "1/3 seeds ran, each met" in table and "not run yet" in table
    results += [_result("ransom_note", s, 11.0, [0.1, 0.2]) for s in (1, 2)]
    results += [_result("syllogism_retry", s, 12.0, [0.3, 0.5]) for s in (0, 1, 2)]
    assert summary(results, rows, [0, 1, 2]) == [
        "Met on every seed: ransom_note, syllogism_retry (2 distinct reasoning-gym tasks: ransom_note, syllogism; "
        "more than one turn: syllogism_retry)."]


def test_most_given_reads_the_sampled_answers_not_the_greedy_ones(tmp_path):
    pd = __import__("pandas")
    from benchmarks.ecosystem import most_given
    rows = pd.DataFrame({"decoding": ["temperature=1.0,top_p=1.0"] * 4 + ["greedy"] * 4,
                         "extracted": ["Yes", "Yes", None, "No", "No", "No", "No", "No"],
                         "trajectory": ["<answer>Yes</answer>", "ab<answer>Yes</answer>", "Let me", "<answer>No</answer>",
                                        *["x"] * 4]})
    rows.to_parquet(tmp_path / "task.parquet")
    assert most_given(tmp_path / "task.parquet") == {"answer": "Yes", "share": 0.5, "chars_mean": 16.75}
