"""reasoning-gym task sets (`reasoning_gym:<task>`): rows from the library, graded by the task's
own score_answer (partial credit = reward, full credit = outcome), bad names as one-line errors."""
from __future__ import annotations

import sys

import pytest

rg = pytest.importorskip("reasoning_gym", reason="the ecosystem extra: pip install -e '.[ecosystem]'")

from turnrl.config import DataCfg, EvalCfg, parse_config   # noqa: E402
from turnrl.data import reasoning_gym, sources   # noqa: E402
from turnrl.envs.intervention import InterventionEnv   # noqa: E402
from turnrl.envs.single_answer import SingleAnswerEnv   # noqa: E402
from turnrl.rewards.math import extract_answer   # noqa: E402

# Recorded answers to item 0 of two seeded sets (seed 1): the question, the library's answer, and
# responses with the reward the task's score_answer gives them (right, wrong, partially right).
RECORDED = [
    ("basic_arithmetic", "Calculate 5 - 3 - 6.", "-4", [
        ("5 - 3 = 2, 2 - 6 = -4. <answer>-4</answer>", 1.0),
        ("<answer>4</answer>", 0.0),
        ("\\boxed{x = -4}", 2 / 6),          # the answer inside a longer string: len(answer)/len(text)
        ("I think it is -4.", 0.0),          # no <answer> / \boxed{}: nothing to score
    ]),
    ("spell_backward", "Spell this word backward (example: sun -> nus): ammonia", "ainomma", [
        ("<answer>ainomma</answer>", 1.0),
        ("<answer>ainomm</answer>", 0.857142857142857),   # the task's own partial credit
        ("<answer>ammonia</answer>", None),
    ]),
]


def _row(task: str) -> dict:
    rows, _ = reasoning_gym.rows({"name": f"reasoning_gym:{task}", "size": 3, "seed": 1})
    return rows[0]


def test_rows_come_from_the_library():
    name = 'reasoning_gym:chain_sum{"config": {"max_terms": 3}, "seed": 11, "size": 40}'
    result = sources.load(name)
    ds = rg.create_dataset("chain_sum", size=40, seed=11, max_terms=3)
    assert result.origin.startswith(name)
    assert len(result.rows) >= 30   # a few repeated questions may be left out
    for row in result.rows:
        entry = ds[row["reasoning_gym"]["index"]]
        assert (row["prompt"], row["answer"], row["grader"]) == (entry["question"], entry["answer"], "reasoning_gym")
    assert len({r["prompt"] for r in result.rows}) == len(result.rows)


@pytest.mark.parametrize("task,question,answer,responses", RECORDED)
def test_reward_is_the_tasks_score_answer(task, question, answer, responses):
    row = _row(task)
    assert (row["prompt"], row["answer"]) == (question, answer)
    ds = rg.create_dataset(task, size=3, seed=1)
    env = SingleAnswerEnv()
    for text, recorded in responses:
        env.reset(row)
        result = env.step(text)
        extracted = extract_answer(text)
        library = 0.0 if extracted is None else ds.score_answer(extracted, ds[0])
        assert result.reward == pytest.approx(library, abs=1e-9)
        if recorded is not None:
            assert result.reward == pytest.approx(recorded, abs=1e-9)
        assert result.done and result.info["outcome"] == (1.0 if library >= 1.0 else 0.0)


def test_the_rows_grader_wins_in_every_answer_environment(tmp_path):
    row = _row("spell_backward")
    # through parquet (what preprocess writes and the stages read back)
    sources.write_rows([row], tmp_path / "rows.parquet")
    back = sources.read_parquet(tmp_path / "rows.parquet")[0]
    text = "<answer>ainomm</answer>"
    env = SingleAnswerEnv(grader="exact")   # a benchmark's grader: the row's own still decides
    env.reset(back)
    assert env.step(text).reward == pytest.approx(0.857142857142857, abs=1e-9)
    inter = InterventionEnv()
    inter.reset(back)
    result = inter.step(text)
    assert result.done and result.reward == pytest.approx(0.857142857142857, abs=1e-9)
    assert result.info["outcome"] == 0.0


def test_unknown_task_is_a_one_line_error_listing_the_known_ones():
    with pytest.raises(reasoning_gym.ReasoningGymError) as err:
        sources.load("reasoning_gym:basic_arithmetc", params_key="data.train_set")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("data.train_set:") and "'basic_arithmetc'" in msg
    assert "basic_arithmetic" in msg and "spell_backward" in msg
    with pytest.raises(reasoning_gym.ReasoningGymError, match=r"^eval.benchmarks.0: .*rejects config"):
        reasoning_gym.check({"name": "reasoning_gym:chain_sum", "config": {"no_such": 1}}, "eval.benchmarks.0")


def test_params_name_sets_and_benchmarks():
    data = DataCfg(train_set={"name": "reasoning_gym:basic_arithmetic", "size": 200, "seed": 1,
                              "config": {"max_terms": 3}})
    assert data.train_set == 'reasoning_gym:basic_arithmetic{"config": {"max_terms": 3}, "seed": 1, "size": 200}'
    assert reasoning_gym.parse(data.train_set) == reasoning_gym.GymSet("basic_arithmetic", 200, 1, {"max_terms": 3})
    bench = EvalCfg(benchmarks=["reasoning_gym:chain_sum", {"name": "reasoning_gym:spell_backward", "size": 20}])
    assert [(b.name, b.path, b.grader) for b in bench.benchmarks] == [
        ("reasoning_gym-chain_sum", "reasoning_gym:chain_sum", "reasoning_gym"),
        ("reasoning_gym-spell_backward", 'reasoning_gym:spell_backward{"size": 20}', "reasoning_gym")]
    with pytest.raises(ValueError, match="unknown keys"):
        DataCfg(train_set={"name": "reasoning_gym:chain_sum", "sise": 3})


def test_heldout_split_shares_no_seed_with_training():
    from turnrl.pipeline.preprocess import training_splits
    gym = "reasoning_gym:basic_arithmetic"
    cfg = parse_config({"env": {"name": "math_answer"}, "data": {"train_set": gym, "heldout_set": gym,
                        "train_examples": 100, "heldout_examples": 30}}, plugins=False)
    train, heldout, manifest, _ = training_splits(cfg)
    assert (len(train), len(heldout)) == (100, 30)
    # row i is the library's item i, generated from seed + i: disjoint indices are disjoint seeds
    assert not {r["reasoning_gym"]["index"] for r in train} & {r["reasoning_gym"]["index"] for r in heldout}
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in heldout}


def test_missing_library_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)   # as if not installed
    from turnrl.rewards import reasoning_gym as library   # where the dataset is made (and cached)
    monkeypatch.setattr(library, "_dataset_cached", library._dataset_cached.__wrapped__)
    with pytest.raises(reasoning_gym.ReasoningGymError) as err:
        sources.load("reasoning_gym:chain_sum", params_key="data.train_set")
    assert "\n" not in str(err.value) and "pip install -e '.[ecosystem]'" in str(err.value)


def test_partial_credit_is_what_training_maximizes_and_accuracy_counts_full_credit():
    from turnrl.pipeline.evaluate import summarize_generations
    from turnrl.rollout.multi_turn import Trajectory
    row = _row("spell_backward")
    trajs = []
    for text in ("<answer>ainomma</answer>", "<answer>ainomm</answer>", "no answer"):
        env, t = SingleAnswerEnv(), Trajectory(example=row, prompt_ids=[1])
        env.reset(row)
        assert t.record(env.step(text))
        trajs.append(t)
    assert [t.reward for t in trajs] == pytest.approx([1.0, 0.857142857142857, 0.0], abs=1e-9)
    assert [t.outcome for t in trajs] == [1.0, 0.0, 0.0]
    summary = summarize_generations(trajs)
    assert summary["accuracy"] == pytest.approx(1 / 3)
    assert summary["partial_credit_mean"] == pytest.approx((1.0 + 0.857142857142857) / 3, abs=1e-9)


def test_the_data_side_raises_data_source_errors_the_rewards_side_value_errors():
    """The set naming and the grade live in turnrl.rewards.reasoning_gym (the grader needs them,
    and rewards sit below data); from turnrl.data.reasoning_gym the same calls raise a
    DataSourceError too, which the stages report as bad data (exit 2)."""
    from turnrl.data.files import DataSourceError
    from turnrl.rewards import reasoning_gym as library
    with pytest.raises(library.ReasoningGymError) as low:
        library.parse("reasoning_gym:", "data.train_set")
    assert isinstance(low.value, ValueError) and not isinstance(low.value, DataSourceError)
    with pytest.raises(DataSourceError) as high:
        reasoning_gym.parse("reasoning_gym:", "data.train_set")
    assert isinstance(high.value, reasoning_gym.ReasoningGymError) and isinstance(high.value, library.ReasoningGymError)
    assert str(high.value) == str(low.value)
    assert reasoning_gym.GymSet is library.GymSet and reasoning_gym.score is library.score
