"""The tiny model's warm start on a data set's rows (issue 32, item 3): with data.train_set naming
reasoning-gym or a jsonl with answers, math_answer and intervention demonstrate THOSE training
rows (never a held-out one) through their own demonstration functions, and the tokenizer is built
from them; the default (synthetic) warm start is unchanged; an environment that cannot
demonstrate (a game) says so before any work. Fast: demonstrations and the tokenizer only."""
from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("reasoning_gym")

from turnrl import envs  # noqa: E402
from turnrl.config import Config  # noqa: E402
from turnrl.data import synthetic  # noqa: E402
from turnrl.pipeline.prepare_model import (WarmStartError, build_tiny, demonstrable, demonstration_rows,  # noqa: E402
                                           demonstrations, replay_demonstration)
from turnrl.rollout.chat import ChatFormat  # noqa: E402
from turnrl.models.tiny import build_tokenizer  # noqa: E402

GYM = {"name": "reasoning_gym:chain_sum", "size": 300,
       "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}


def _cfg(env: str, **data) -> Config:
    return Config.model_validate({"env": {"name": env}, "data": {"train_examples": 120, "heldout_examples": 40, **data},
                                  "model": {"warmstart": {"demonstrations": 60, "skill_steps": 0, "prior_steps": 0},
                                            "tiny": {"vocab_size": 400, "hidden_size": 32, "num_layers": 1,
                                                     "num_heads": 2, "num_kv_heads": 1}}})


def _demos(cfg: Config, count: int = 200):
    spec = envs.resolve(cfg.env.name)
    task = demonstrable(spec.task, cfg.env.name)
    train, heldout, source = demonstration_rows(cfg, task)
    return train, heldout, source, demonstrations(task, train, count, 0.5, cfg.seed, "skill", cfg.env.name)


@pytest.mark.parametrize("env", ["math_answer", "intervention"])
def test_reasoning_gym_rows_are_demonstrated_never_held_out(env):
    cfg = _cfg(env, train_set=GYM, heldout_set=GYM)
    train, heldout, source, demos = _demos(cfg)
    assert source.startswith("reasoning_gym:chain_sum") and len(heldout) == 40
    held_prompts = {r["prompt"] for r in heldout}
    held_index = {r["reasoning_gym"]["index"] for r in heldout}
    shown = [row for row, _, _ in demos]
    assert all(r["source"] == "reasoning_gym:chain_sum" for r in shown)   # not the synthetic additions
    assert not {r["prompt"] for r in shown} & held_prompts
    assert not {r["reasoning_gym"]["index"] for r in shown} & held_index
    assert {r["id"] for r in shown} <= {r["id"] for r in train}
    # each demonstration, replayed through the environment, is scored by the task's own
    # score_answer: good ones earn full credit, the habit none
    fmt = ChatFormat(build_tokenizer([""], 300), "chat")
    make_env = cfg.env.factory(max_turns=cfg.rollout.max_turns, seed=cfg.seed)
    rewards = {True: set(), False: set()}
    for row, demo, good in demos[:40]:
        t = replay_demonstration(make_env, fmt, row, demo, env)
        rewards[good].add(t.outcome if env == "math_answer" or good else None)
        assert row["answer"] in demo.turns[-1]
    assert rewards[True] == {1.0} and (env != "math_answer" or rewards[False] == {0.0})


def test_jsonl_with_answers_is_demonstrated(tmp_path):
    rows = [{"question": f"What is {i} plus one?", "solution": str(i + 1)} for i in range(80)]
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _cfg("intervention", train_set=str(path), heldout_set=str(path), train_examples=50, heldout_examples=20,
               fields={"prompt": "question", "answer": "solution"})
    train, heldout, source, demos = _demos(cfg)
    assert source == str(path)
    assert not {row["prompt"] for row, _, _ in demos} & {r["prompt"] for r in heldout}
    good = next(d for _, d, g in demos if g)
    assert good.turns[0].startswith("<answer>") and "+" not in good.turns[0]   # no addition columns to work


def test_default_synthetic_warm_start_is_unchanged():
    for env in ("code_tool", "intervention", "math_refine"):
        cfg = _cfg(env)
        task = envs.resolve(env).task
        train, heldout, source = demonstration_rows(cfg, task)
        assert source == "synthetic"
        assert (train, heldout) == task.splits(120, 40, cfg.seed)
    # intervention's synthetic additions are still worked column by column
    _, _, _, demos = _demos(_cfg("intervention"), 20)
    row, demo, _ = next(d for d in demos if d[2])
    assert demo.turns == [f"{synthetic.addition_steps(row['a'], row['b'])} <answer>{row['answer']}</answer>"]
    # an environment whose demonstration only knows its own rows keeps them whatever data RL uses
    train, _, source = demonstration_rows(_cfg("math_refine", train_set=GYM, heldout_set=GYM),
                                          envs.resolve("math_refine").task)
    assert source == "synthetic" and "a" in train[0]


def test_the_tokenizer_is_built_from_the_data_rows(tmp_path):
    cfg = _cfg("math_answer", train_set=GYM, heldout_set=GYM)
    summary = build_tiny(cfg, tmp_path / "model")
    assert summary["demonstrated_rows"].startswith("reasoning_gym:chain_sum")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tmp_path / "model")
    # the task's wording is in the vocabulary: far fewer tokens than its bytes
    text = "State the final answer to the following arithmetic problem: 4 - 1 ="
    assert len(tok(text)["input_ids"]) < len(text) / 3


def test_a_game_fails_before_any_work(tmp_path):
    cfg = Config.model_validate({"env": {"name": "gym_text", "options": {"make": "textarena:GuessTheNumber-v0"}}})
    with pytest.raises(WarmStartError) as err:
        build_tiny(cfg, tmp_path / "game")
    msg = str(err.value)
    assert "\n" not in msg and "env.name = 'gym_text'" in msg and "model.path" in msg
    assert not (tmp_path / "game").exists()   # nothing built


def test_answer_demonstration_habit_is_the_untagged_answer():
    row = {"answer": "42"}
    good = synthetic.answer_demonstration(row, random.Random(0), True)
    bad = synthetic.answer_demonstration(row, random.Random(0), False)
    assert good.turns == ["<answer>42</answer>"] and good.choice is None
    assert bad.turns == ["The answer is 42."] and bad.choice == (0, "The")
