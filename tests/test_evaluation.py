"""The evaluation used by baseline_eval and eval, with a scripted engine standing in for the
model (a unit test of the code around the engine; the real engines run in the e2e tests)."""
import re

import pytest
from transformers import AutoTokenizer

from turnrl.config import Config
from turnrl.evaluation import evaluate, pass_at_k
from turnrl.preprocess import preprocess
from turnrl.rollout.loop import Sample


class Oracle:
    """Calls the tool on every problem, then copies the tool output: always right."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def generate(self, prompts, *, max_tokens, stop, temperature, top_p, seeds):
        out = []
        for ids in prompts:
            text = self.tokenizer.decode(ids)
            if "<output>" in text.rsplit("Compute", 1)[-1]:
                turn = "<answer>" + re.findall(r"<output>(\d+)</output>", text)[-1] + "</answer>"
            else:
                a, b = re.findall(r"Compute (\d+) \* (\d+)\.", text)[-1]
                turn = f"<code>print({a} * {b})</code>"
            tok = self.tokenizer(turn, add_special_tokens=False)["input_ids"]
            out.append(Sample(tok, [-0.1] * len(tok), "stop"))
        return out


@pytest.fixture
def cfg():
    return Config.model_validate({"data": {"train_examples": 40, "heldout_examples": 12}})


def test_task_metrics_and_generations(tmp_path, tiny_model_dir, cfg, monkeypatch):
    monkeypatch.delenv("TURNRL_DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    preprocess(cfg, tmp_path / "data")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    metrics = evaluate(cfg, Oracle(tokenizer), tokenizer, tmp_path / "data", tmp_path / "eval")
    task = metrics["task"]
    assert task["accuracy"] == 1.0 and task["accuracy_greedy"] == 1.0 and task["n"] == 12
    assert task["mean_turns"] == 2.0 and task["tokens_per_correct"] == task["mean_response_tokens"]
    # MATH-500 could not be found: the block says so instead of disappearing
    assert metrics["math500"]["available"] is False and "TURNRL_DATA_DIR" in metrics["math500"]["reason"]
    import pandas as pd
    rows = pd.read_parquet(tmp_path / "eval" / "task.parquet")
    assert len(rows) == 24 and set(rows["decoding"]) == {"greedy", "temperature=1.0"}
    assert rows["correct"].all() and (rows["extracted"] == rows["answer"]).all()


@pytest.mark.parametrize("n, c, k, expected", [
    (5, 2, 1, 0.4),            # pass@1 = c / n
    (5, 2, 2, 0.7),            # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (5, 2, 4, 1.0),            # n - c = 3 < k = 4: any 4 samples include a correct one
    (10, 0, 3, 0.0),
    (4, 1, 2, 0.5),            # 1 - C(3,2)/C(4,2) = 1 - 3/6
])
def test_pass_at_k_matches_the_closed_form(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_k_samples_give_mean_at_k_and_pass_at_k(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.delenv("TURNRL_DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    cfg = Config.model_validate({"data": {"train_examples": 40, "heldout_examples": 6},
                                 "eval": {"samples": 3, "greedy": False}})
    preprocess(cfg, tmp_path / "data")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    task = evaluate(cfg, Oracle(tokenizer), tokenizer, tmp_path / "data", tmp_path / "eval")["task"]
    assert task["n"] == 6 and task["samples_per_problem"] == 3
    assert task["accuracy"] == 1.0 and task["pass_at_3"] == 1.0 and "accuracy_greedy" not in task
