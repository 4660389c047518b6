"""The embedded default's synthetic tasks, replayed through the real environments: a good
demonstration solves its problem, the habit RL must unlearn mostly does not."""
import random

import pytest

from turnrl import envs
from turnrl.config import Config
from turnrl.data import synthetic
from turnrl.rollout.chat import ChatFormat
from turnrl.rollout.multi_turn import replay


@pytest.fixture(scope="module")
def fmt(tiny_model_dir):
    from transformers import AutoTokenizer
    return ChatFormat(AutoTokenizer.from_pretrained(tiny_model_dir))


def _make_env(name: str, train, heldout, data_dir):
    """The environment as the warm start makes it: its data files (a search corpus) written first."""
    cfg = Config.model_validate({"env": {"name": name}})
    spec = envs.resolve(name)
    if spec.prepare_data is not None:
        spec.prepare_data(heldout + train, data_dir, **cfg.env.checked_options())
    return cfg.env.factory(max_turns=cfg.rollout.max_turns, seed=cfg.seed, data_dir=data_dir)


@pytest.mark.parametrize("name", sorted(synthetic.TASKS))
def test_good_demonstrations_solve_and_bad_ones_mostly_fail(name, fmt, tmp_path):
    task = envs.resolve(name).task
    train, heldout = task.splits(40, 10, seed=3)
    make_env = _make_env(name, train, heldout, tmp_path)
    rng = random.Random(0)
    good = [replay(make_env(), fmt, row, task.demonstration(row, rng, True).turns) for row in train]
    bad = [replay(make_env(), fmt, row, task.demonstration(row, rng, False).turns) for row in train]
    assert all(t.outcome == 1.0 and t.finish == "answer" for t in good)
    if name == "intervention":   # rambling costs turns and tokens, and a third ramble the answer
        assert all(t.num_turns > 1 for t in bad)
        assert sum(t.policy_tokens() for t in bad) > sum(t.policy_tokens() for t in good)
        assert all(t.finish == "max_turns" for t in bad if t.outcome == 0)
    elif name == "math_refine":  # approving a guessed attempt: almost always wrong
        assert all(t.num_turns == 3 for t in good + bad)
        assert sum(t.outcome for t in bad) <= 2
        assert all(t.info["improvement"] >= 0 for t in good)  # the worked columns fix the guess
    else:
        assert sum(t.outcome for t in bad) <= 2


def test_addition_steps():
    assert synthetic.addition_steps(475, 382) == "5+2=7 7+8=15 4+3+1=8"
    assert synthetic.addition_steps(999, 999) == "9+9=18 9+9+1=19 9+9+1=19"
    assert synthetic.addition_steps(75, 48) == "5+8=13 7+4+1=12"     # the answer, 123, read backwards


def test_lookup_codes_only_in_the_corpus():
    train, heldout = envs.resolve("search").task.splits(50, 10, seed=0)
    corpus = synthetic.lookup_corpus(heldout + train)
    assert len(corpus) == 60 and len({p["title"] for p in corpus}) == 60
    row = heldout[0]
    assert row["answer"] not in row["prompt"]
    assert any(p["title"] == row["entity"] and row["answer"] in p["text"] for p in corpus)


def test_the_builtins_are_plugins_with_tasks():
    for name in synthetic.TASKS:
        spec = envs.resolve(name)
        assert spec.task is synthetic.TASKS[name] and spec.task.rows is not None and spec.task.demonstration
    answer = envs.resolve("math_answer").task   # no rows of its own: it demonstrates data.train_set's
    assert answer is synthetic.ANSWER_TASK and answer.rows is None and answer.any_row


def test_env_options_follow_params(tmp_path):
    cfg = Config.model_validate({"env": {"name": "code_tool", "options": {"timeout_s": 2.0}}})
    assert cfg.env.checked_options()["timeout_s"] == 2.0 and cfg.env.checked_options()["memory_mb"] == 256   # defaults filled
    cfg = Config.model_validate({"env": {"name": "intervention"}, "rollout": {"max_turns": 4}})
    assert cfg.env.factory(max_turns=cfg.rollout.max_turns, seed=cfg.seed)().max_turns == 4   # from the context: rollout.max_turns
    cfg = Config.model_validate({"env": {"name": "search"}})
    with pytest.raises(FileNotFoundError, match="dvc repro preprocess"):
        cfg.env.factory(max_turns=cfg.rollout.max_turns, seed=cfg.seed, data_dir=tmp_path)()
    cfg = Config.model_validate({"env": {"name": "math_refine", "options": {
        "feedback": "endpoint", "endpoint_url": "http://127.0.0.1:9/v1"}}})
    assert cfg.env.checked_options()["endpoint_url"] == "http://127.0.0.1:9/v1"


def test_prior_phase_trains_good_demonstrations_whole_and_bad_ones_at_their_choice(fmt, tmp_path):
    from turnrl.pipeline.prepare_model import warm_start_mask
    task = envs.resolve("code_tool").task
    train, heldout = task.splits(4, 2, seed=0)
    make_env = _make_env("code_tool", train, heldout, tmp_path)
    rng = random.Random(0)
    good, bad = task.demonstration(train[0], rng, True), task.demonstration(train[0], rng, False)
    t_good, t_bad = (replay(make_env(), fmt, train[0], d.turns) for d in (good, bad))
    assert warm_start_mask(t_good, good, True, "prior", fmt) == t_good.loss_mask       # every policy token
    assert warm_start_mask(t_bad, bad, False, "skill", fmt) == t_bad.loss_mask
    mask = warm_start_mask(t_bad, bad, False, "prior", fmt)                            # "<answer>" only
    kept = [i for i, m in zip(t_bad.response_ids, mask) if m]
    assert fmt.tokenizer.decode(kept) == "<answer>" and sum(mask) < sum(t_bad.loss_mask)
