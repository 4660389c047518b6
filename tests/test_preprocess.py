"""preprocess: synthetic splits are disjoint and seeded; MATH-500 found or reported missing."""
import json

import pytest

from turnrl.config import Config
from turnrl.data.sources import read_parquet
from turnrl.data.synthetic import TASKS
from turnrl.pipeline.preprocess import preprocess


def small() -> Config:
    return Config.model_validate({"data": {"train_examples": 300, "heldout_examples": 50}})


@pytest.mark.parametrize("env", sorted(TASKS))
def test_synthetic_splits_are_disjoint_and_seeded(env):
    task = TASKS[env]
    train, heldout = task.splits(300, 50, seed=0)
    assert len(train) == 300 and len(heldout) == 50
    assert {r["prompt"] for r in train}.isdisjoint({r["prompt"] for r in heldout})
    assert len({r["prompt"] for r in train}) == 300
    assert task.splits(300, 50, seed=0) == (train, heldout)
    assert task.splits(300, 50, seed=1)[1] != heldout


def test_product_rows_need_the_tool():
    for row in TASKS["code_tool"].splits(10, 50, seed=0)[1]:
        a, b = row["prompt"].removeprefix("Compute ").removesuffix(".").split(" * ")
        assert int(row["answer"]) == int(a) * int(b) and len(a) == len(b) == 3


def test_math500_is_written_when_the_data_dir_has_it(tmp_path, data_dir, monkeypatch):
    monkeypatch.setenv("TURNRL_DATA_DIR", str(data_dir))
    manifest = preprocess(small(), tmp_path)
    assert manifest["benchmarks"]["math500"]["available"] is True and manifest["benchmarks"]["math500"]["n"] == 500
    assert len(read_parquet(tmp_path / "benchmarks" / "math500.parquet")) == 500
    assert len(read_parquet(tmp_path / "train.parquet")) == 300


def test_math500_unreachable_is_explicit_not_silent(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("TURNRL_DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    manifest = preprocess(small(), tmp_path / "out")
    info = json.loads((tmp_path / "out" / "manifest.json").read_text())["benchmarks"]["math500"]
    assert info == manifest["benchmarks"]["math500"] and info["available"] is False
    assert "TURNRL_DATA_DIR" in info["reason"] and "eval.benchmarks[0].path" in info["reason"]
    assert any("math500" in r.message and r.levelname == "WARNING" for r in caplog.records)


def test_a_wrong_explicit_path_is_an_error(tmp_path):
    from turnrl.data.sources import DataSourceError
    cfg = Config.model_validate({"data": {"train_examples": 10, "heldout_examples": 5},
                                 "eval": {"benchmarks": [{"name": "math500", "path": str(tmp_path / "nope.jsonl")}]}})
    with pytest.raises(DataSourceError, match="nope.jsonl"):
        preprocess(cfg, tmp_path / "out")


def _cfg(**data) -> Config:
    env = data.pop("env", "code_tool")
    return Config.model_validate({"env": {"name": env}, "data": data, "eval": {"benchmarks": []}})


def test_search_writes_the_synthetic_corpus(tmp_path):
    manifest = preprocess(_cfg(env="search", train_examples=40, heldout_examples=10), tmp_path)
    corpus = read_parquet(tmp_path / "corpus.parquet")
    assert manifest["corpus"]["n"] == len(corpus) == 50
    heldout = read_parquet(tmp_path / "heldout.parquet")
    assert {r["entity"] for r in heldout} <= {p["title"] for p in corpus}


def test_gsm8k_train_and_test_sets(tmp_path, data_dir, monkeypatch):
    monkeypatch.setenv("TURNRL_DATA_DIR", str(data_dir))
    cfg = _cfg(train_set="gsm8k_train", heldout_set="gsm8k_test", train_examples=100000, heldout_examples=64)
    manifest = preprocess(cfg, tmp_path)
    train, heldout = read_parquet(tmp_path / "train.parquet"), read_parquet(tmp_path / "heldout.parquet")
    assert len(heldout) == 64 and manifest["heldout"]["n"] == 64
    # every training problem, minus any that also occur in the test sample
    assert len(train) == 7473 - manifest["train"]["dropped_heldout_overlap"]
    assert {r["prompt"] for r in train}.isdisjoint({r["prompt"] for r in heldout})
    assert all(r["answer"] and r["prompt"] for r in heldout)


def test_nq_open_is_split_and_its_gold_passages_are_the_corpus(tmp_path, data_dir, monkeypatch):
    monkeypatch.setenv("TURNRL_DATA_DIR", str(data_dir))
    cfg = _cfg(env="search", train_set="nq_open", heldout_set="nq_open", train_examples=100000, heldout_examples=100)
    manifest = preprocess(cfg, tmp_path)
    train, heldout = read_parquet(tmp_path / "train.parquet"), read_parquet(tmp_path / "heldout.parquet")
    assert (len(train), len(heldout)) == (2555, 100)
    assert {r["id"] for r in train}.isdisjoint({r["id"] for r in heldout})
    corpus = read_parquet(tmp_path / "corpus.parquet")
    assert manifest["corpus"]["n"] == len(corpus) and 2500 < len(corpus) <= 2655
    # fewer training prompts do not shrink the corpus
    small = preprocess(_cfg(env="search", train_set="nq_open", heldout_set="nq_open", train_examples=50,
                            heldout_examples=10), tmp_path / "small")
    assert small["train"]["n"] == 50 and small["corpus"]["n"] == len(corpus)


def test_search_on_a_set_without_passages_says_what_to_set(tmp_path, data_dir, monkeypatch):
    from turnrl.data.sources import DataSourceError
    monkeypatch.setenv("TURNRL_DATA_DIR", str(data_dir))
    cfg = _cfg(env="search", train_set="gsm8k_train", heldout_set="gsm8k_test", train_examples=10,
               heldout_examples=5)
    with pytest.raises(DataSourceError, match="env.options.corpus"):
        preprocess(cfg, tmp_path)


def test_own_file_with_other_field_names(tmp_path):
    import json as _json
    rows = [{"q": f"What is {i} + {i}?", "sol": str(2 * i)} for i in range(30)]
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(_json.dumps(r) for r in rows))
    cfg = _cfg(train_set=str(path), heldout_set=str(path), heldout_examples=10,
               fields={"prompt": "q", "answer": "sol"})
    preprocess(cfg, tmp_path / "out")
    train, heldout = read_parquet(tmp_path / "out" / "train.parquet"), read_parquet(tmp_path / "out" / "heldout.parquet")
    assert (len(train), len(heldout)) == (20, 10)
    assert all(int(r["answer"]) == 2 * int(r["prompt"].split()[2]) for r in train + heldout)


def test_rows_keep_their_own_fields_through_the_parquet_files(tmp_path):
    """A file's unmapped fields and a synthetic task's own keys are read back from the
    preprocessed splits as they were (ints stay ints, a nested dict stays a dict)."""
    import json as _json
    rows = [{"q": f"Sort {i} 0", "sol": f"0 {i}", "length": 2, "case": {"input": [i, 0], "seed": i}}
            for i in range(1, 13)]
    path = tmp_path / "sortfix.jsonl"
    path.write_text("".join(_json.dumps(r) + "\n" for r in rows))
    cfg = _cfg(train_set=str(path), heldout_set=str(path), heldout_examples=4, fields={"prompt": "q", "answer": "sol"})
    preprocess(cfg, tmp_path / "out")
    by_prompt = {r["q"]: r for r in rows}
    back = read_parquet(tmp_path / "out" / "train.parquet") + read_parquet(tmp_path / "out" / "heldout.parquet")
    assert len(back) == 12
    for row in back:
        assert (row["length"], row["case"]) == (2, by_prompt[row["prompt"]]["case"])
    # code_tool's synthetic rows carry their factors
    preprocess(_cfg(train_examples=5, heldout_examples=3), tmp_path / "synthetic")
    for row in read_parquet(tmp_path / "synthetic" / "heldout.parquet"):
        assert isinstance(row["a"], int) and row["a"] * row["b"] == int(row["answer"])


def test_a_held_out_prompt_never_trains_however_the_files_repeat_it(tmp_path):
    """One file split in two whose prompts repeat (40 rows, 10 questions): no held-out question is
    trained on. Two files sharing questions: the training rows are counted after the shared ones
    leave, so train_examples clean rows remain where the file has them."""
    import json as _json
    repeated = tmp_path / "repeated.jsonl"
    repeated.write_text("\n".join(_json.dumps({"id": f"r{i}", "q": f"What is {i % 10} + 1?", "sol": str(i % 10 + 1)})
                                  for i in range(40)))
    manifest = preprocess(_cfg(train_set=str(repeated), heldout_set=str(repeated), heldout_examples=4,
                               fields={"prompt": "q", "answer": "sol"}), tmp_path / "one")
    train, heldout = (read_parquet(tmp_path / "one" / f"{s}.parquet") for s in ("train", "heldout"))
    held = {r["prompt"] for r in heldout}
    assert len(held) >= 1 and not held & {r["prompt"] for r in train}
    assert manifest["train"]["dropped_heldout_overlap"] == 40 - 4 - len(train) > 0

    train_file, heldout_file = tmp_path / "train.jsonl", tmp_path / "heldout.jsonl"
    train_file.write_text("\n".join(_json.dumps({"q": f"Q{i}", "sol": str(i)}) for i in range(50)))
    heldout_file.write_text("\n".join(_json.dumps({"q": f"Q{i}", "sol": str(i)}) for i in range(10)))
    manifest = preprocess(_cfg(train_set=str(train_file), heldout_set=str(heldout_file), train_examples=40,
                               heldout_examples=10, fields={"prompt": "q", "answer": "sol"}), tmp_path / "two")
    train = read_parquet(tmp_path / "two" / "train.parquet")
    assert len(train) == 40 and manifest["train"]["dropped_heldout_overlap"] == 10
    assert not {r["prompt"] for r in train} & {f"Q{i}" for i in range(10)}


def test_data_fields_map_your_own_file_not_a_registered_set_beside_it(tmp_path, data_dir, monkeypatch):
    import json as _json
    monkeypatch.setenv("TURNRL_DATA_DIR", str(data_dir))
    mine = tmp_path / "mine.jsonl"
    mine.write_text("\n".join(_json.dumps({"q": {"text": f"What is {i} + 1?"}, "meta": {"ans": str(i + 1)}})
                              for i in range(30)))
    manifest = preprocess(_cfg(train_set=str(mine), heldout_set="gsm8k_test", heldout_examples=8,
                               fields={"prompt": "q.text", "answer": "meta.ans"}), tmp_path / "out")
    assert manifest["train"]["n"] == 30 and manifest["heldout"]["n"] == 8
    assert all(r["prompt"] and r["answer"] for r in read_parquet(tmp_path / "out" / "heldout.parquet"))


def test_a_csv_file_or_an_hf_id_as_task_data_says_what_to_give(tmp_path, monkeypatch):
    from turnrl.config import checks
    from turnrl.data.sources import DataSourceError
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.csv").write_text("question,answer\nWhat is 1 + 1?,2\n")
    with pytest.raises(DataSourceError, match=r"data.csv: a CSV file; turnrl reads jsonl, json and parquet: convert"):
        preprocess(_cfg(train_set="data.csv", heldout_set="data.csv"), tmp_path / "out")
    problem, = checks.data_problems(_cfg(train_set="hf:openai/gsm8k", heldout_set="synthetic"))
    assert problem.startswith("data.train_set = 'hf:openai/gsm8k': Hugging Face ids are read by sft.data only")


def test_answer_from_reads_gsm8k_style_worked_answers_of_your_own_file(tmp_path, caplog):
    """A file of GSM8K-style answers ('... #### 1,234'): data.answer_from: gsm8k grades the final
    answer; left as the field, preprocess warns naming the key (every sample would score 0); a row
    without the marker is an error naming its line."""
    import json as _json
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(_json.dumps({"question": f"What is {i} x 1000?", "answer": f"{i} x 1000 = {i * 1000}\n"
                                           f"#### {i * 1000:,}"}) for i in range(1, 21)))
    preprocess(_cfg(train_set=str(path), heldout_set=str(path), heldout_examples=5, answer_from="gsm8k"),
               tmp_path / "out")
    rows = read_parquet(tmp_path / "out" / "train.parquet") + read_parquet(tmp_path / "out" / "heldout.parquet")
    assert len(rows) == 20 and all(r["answer"] == str(int(r["prompt"].split()[2]) * 1000) for r in rows)
    with caplog.at_level("WARNING"):
        preprocess(_cfg(train_set=str(path), heldout_set=str(path), heldout_examples=5), tmp_path / "as_is")
    assert "data.train_set: 100% of the answers hold '####'" in caplog.text and "data.answer_from: gsm8k" in caplog.text
    with path.open("a") as fh:
        fh.write("\n" + _json.dumps({"question": "What is 1 + 1?", "answer": "2"}))
    from turnrl.data.sources import MalformedDataError
    with pytest.raises(MalformedDataError, match=r"mine.jsonl:21: answer has no '#### <final answer>' marker"):
        preprocess(_cfg(train_set=str(path), heldout_set=str(path), heldout_examples=5, answer_from="gsm8k"),
                   tmp_path / "bad")
