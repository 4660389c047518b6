"""preprocess: synthetic splits are disjoint and seeded; MATH-500 found or reported missing."""
import json

import pytest

from turnrl.config import Config
from turnrl.data.sources import read_parquet
from turnrl.data.synthetic import product_splits
from turnrl.preprocess import preprocess


def small() -> Config:
    return Config.model_validate({"data": {"train_examples": 300, "heldout_examples": 50}})


def test_splits_are_disjoint_seeded_and_need_the_tool():
    train, heldout = product_splits(300, 50, min_digits=3, max_digits=3, seed=0)
    assert {r["prompt"] for r in train}.isdisjoint({r["prompt"] for r in heldout})
    assert product_splits(300, 50, min_digits=3, max_digits=3, seed=0) == (train, heldout)
    assert product_splits(300, 50, min_digits=3, max_digits=3, seed=1)[1] != heldout
    for row in heldout:
        a, b = row["prompt"].removeprefix("Compute ").removesuffix(".").split(" * ")
        assert int(row["answer"]) == int(a) * int(b) and len(a) == len(b) == 3


def test_math500_is_written_when_the_data_dir_has_it(tmp_path, data_dir, monkeypatch):
    monkeypatch.setenv("TURNRL_DATA_DIR", str(data_dir))
    manifest = preprocess(small(), tmp_path)
    assert manifest["math500"]["available"] is True and manifest["math500"]["n"] == 500
    assert len(read_parquet(tmp_path / "math500.parquet")) == 500
    assert len(read_parquet(tmp_path / "train.parquet")) == 300


def test_math500_unreachable_is_explicit_not_silent(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("TURNRL_DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    manifest = preprocess(small(), tmp_path / "out")
    info = json.loads((tmp_path / "out" / "manifest.json").read_text())["math500"]
    assert info == manifest["math500"] and info["available"] is False
    assert "TURNRL_DATA_DIR" in info["reason"] and "data.math500_path" in info["reason"]
    assert any("math500" in r.message and r.levelname == "WARNING" for r in caplog.records)


def test_a_wrong_explicit_path_is_an_error(tmp_path):
    from turnrl.data.sources import DataSourceError
    cfg = Config.model_validate({"data": {"train_examples": 10, "heldout_examples": 5,
                                          "math500_path": str(tmp_path / "nope.jsonl")}})
    with pytest.raises(DataSourceError, match="nope.jsonl"):
        preprocess(cfg, tmp_path / "out")
