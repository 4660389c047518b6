"""Data sources: the real sets through $TURNRL_DATA_DIR, field mapping, bad rows, resolution.

Tests marked ``needs_data`` read ../shared/data through $TURNRL_DATA_DIR and are skipped
without it; the rest build small files in tmp_path. No test touches the network: the hub is
replaced by a fake ``datasets`` module where it matters.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
import types
from collections import Counter
from pathlib import Path

import pytest

from turnrl.data import sources
from turnrl.data.sources import (
    DATASETS,
    SCHEMA_FIELDS,
    DataSourceError,
    LoadResult,
    load,
    load_rows,
    load_search_corpus,
    read_parquet,
    write_parquet,
)

DATA_DIR = os.environ.get("TURNRL_DATA_DIR", "")
needs_data = pytest.mark.skipif(not DATA_DIR, reason="set TURNRL_DATA_DIR to ../shared/data")


def _write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for r in rows:
            fh.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def _fake_datasets(monkeypatch, load_dataset) -> list:
    """Install a stand-in ``datasets`` module; returns the list of calls it received."""
    calls: list = []

    def _load(*args, **kwargs):
        calls.append((args, kwargs))
        return load_dataset(*args, **kwargs)

    mod = types.ModuleType("datasets")
    mod.load_dataset = _load  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "datasets", mod)
    return calls


def _offline(*args, **kwargs):
    raise ConnectionError("offline")


def _check_schema(rows: list[dict]) -> None:
    for r in rows:
        assert tuple(r)[: len(SCHEMA_FIELDS)] == SCHEMA_FIELDS
        assert isinstance(r["id"], str) and r["id"]
        assert isinstance(r["prompt"], str) and r["prompt"].strip()
        assert isinstance(r["answer"], str) and r["answer"].strip()
        assert isinstance(r["answers"], list) and r["answer"] in r["answers"]
        assert all(isinstance(a, str) for a in r["answers"])
        assert r["subject"] is None or isinstance(r["subject"], str)
        assert r["level"] is None or isinstance(r["level"], int)
        assert isinstance(r["source"], str)
    assert len({r["id"] for r in rows}) == len(rows)


# --------------------------------------------------------------------------- real data
@needs_data
@pytest.mark.parametrize(
    "name, n",
    [
        ("math500", 500),
        ("gsm8k_train", 7473),
        ("gsm8k_test", 1319),
        ("aime24", 30),
        ("aime25", 30),
        ("amc23", 40),
        ("nq_open", 2655),
    ],
)
def test_real_row_counts(name, n):
    res = load(name)
    assert len(res.rows) == n
    assert res.dropped == []
    assert res.origin.startswith(DATA_DIR.rstrip("/"))
    _check_schema(res.rows)
    assert {r["source"] for r in res.rows} == {name}


@needs_data
def test_math500_subjects_levels_and_fields():
    rows = load_rows("math500")
    assert Counter(r["subject"] for r in rows) == {
        "Algebra": 124,
        "Intermediate Algebra": 97,
        "Prealgebra": 82,
        "Number Theory": 62,
        "Precalculus": 56,
        "Geometry": 41,
        "Counting & Probability": 38,
    }
    assert Counter(r["level"] for r in rows) == {1: 43, 2: 90, 3: 105, 4: 128, 5: 134}
    first = rows[0]
    assert first["id"] == "test/precalculus/807.json"
    assert first["prompt"].startswith("Convert the point $(0,3)$")
    assert first["answer"] == r"\left( 3, \frac{\pi}{2} \right)"
    assert first["answers"] == [first["answer"]]


@needs_data
def test_gsm8k_answers_and_split_selection():
    test = load_rows("gsm8k", split="test")
    assert len(test) == 1319 and test[0]["source"] == "gsm8k_test"
    assert test[0]["answer"] == "18"
    assert test[0]["prompt"].startswith("Janet")
    assert test[0]["id"] == "gsm8k_test-0"
    train = load_rows("gsm8k_train")
    for r in train + test:
        assert "," not in r["answer"] and "####" not in r["answer"]
        float(r["answer"])  # every GSM8K final answer is a number


@needs_data
def test_competition_answers_are_canonical_strings():
    aime25 = load_rows("aime25")
    assert aime25[0]["answer"] == "70" and aime25[0]["id"] == "0"
    amc = load_rows("amc23")
    assert amc[0]["answer"] == "27"  # 27.0 in the file
    aime24 = load_rows("aime24")
    assert aime24[0]["id"] == "60" and aime24[0]["answer"] == "204"
    assert "25" in [r["answer"] for r in aime24]  # "025" in the file
    assert all(r["answer"].lstrip("-").isdigit() for r in aime24 + aime25 + amc)


@needs_data
def test_nq_open_rows_and_search_corpus():
    rows = load_rows("nq_open")
    assert rows[0]["prompt"] == "who got the first nobel prize in physics"
    assert rows[0]["answers"] == ["Wilhelm Conrad Röntgen"]
    assert rows[0]["passages"][0]["title"] == "List of Nobel laureates in Physics"
    corpus = load_search_corpus(rows)
    assert len(corpus) == 2600
    assert len({(p["title"], p["text"]) for p in corpus}) == 2600
    assert [p["id"] for p in corpus[:3]] == ["0", "1", "2"]
    assert set(corpus[0]) == {"id", "title", "text"}
    # the same corpus from the registered name and from the raw file path
    assert load_search_corpus("nq_open") == corpus
    raw = Path(DATA_DIR) / "nq_lost_in_middle" / "nq-open-oracle.jsonl.gz"
    assert load_search_corpus(raw) == corpus


# --------------------------------------------------------------------------- resolution order
MATH_ROWS = [
    {"problem": "1+1?", "answer": "2", "subject": "Algebra", "level": 1, "unique_id": "a"},
    {"problem": "2+2?", "answer": "4", "subject": "Algebra", "level": 2, "unique_id": "b"},
]


def test_explicit_path_beats_data_dir(tmp_path, monkeypatch):
    env_dir = tmp_path / "env"
    _write_jsonl(env_dir / "math500" / "test.jsonl", MATH_ROWS)
    mine = _write_jsonl(tmp_path / "mine.jsonl", MATH_ROWS[:1])
    monkeypatch.setenv("TURNRL_DATA_DIR", str(env_dir))
    assert len(load_rows("math500")) == 2
    res = load("math500", path=mine)
    assert res.origin == str(mine) and [r["id"] for r in res.rows] == ["a"]
    with pytest.raises(DataSourceError, match="no such file"):
        load("math500", path=tmp_path / "missing.jsonl")


def test_data_dir_argument_beats_env_and_parquet_variant(tmp_path, monkeypatch):
    monkeypatch.setenv("TURNRL_DATA_DIR", str(tmp_path / "nothing-here"))
    d = tmp_path / "arg"
    (d / "math500").mkdir(parents=True)
    write_parquet(MATH_ROWS, d / "math500" / "test.parquet")  # same stem, parquet instead of jsonl
    res = load("math500", data_dir=d, use_hub=False)
    assert res.origin.endswith("test.parquet")
    assert [(r["id"], r["answer"], r["level"]) for r in res.rows] == [("a", "2", 1), ("b", "4", 2)]


def test_hub_is_the_third_option(tmp_path, monkeypatch):
    monkeypatch.delenv("TURNRL_DATA_DIR", raising=False)
    calls = _fake_datasets(monkeypatch, lambda *a, **k: [dict(r) for r in MATH_ROWS])
    res = load("math500")
    assert calls == [(("HuggingFaceH4/MATH-500", None), {"split": "test"})]
    assert res.origin == "hf://HuggingFaceH4/MATH-500[test]"
    assert [r["answer"] for r in res.rows] == ["2", "4"]
    # gsm8k goes through its config
    calls.clear()
    _fake_datasets(monkeypatch, lambda *a, **k: [{"question": "q", "answer": "x\n#### 1,234"}])
    assert load_rows("gsm8k_test")[0]["answer"] == "1234"


def test_missing_source_error_names_the_three_options(tmp_path, monkeypatch):
    monkeypatch.delenv("TURNRL_DATA_DIR", raising=False)
    _fake_datasets(monkeypatch, _offline)
    with pytest.raises(DataSourceError) as err:
        load("math500")
    msg = str(err.value)
    assert "set `path`" in msg  # 1. an explicit path
    assert "TURNRL_DATA_DIR" in msg and "math500/test.jsonl" in msg  # 2. env var + file location
    assert "HuggingFaceH4/MATH-500" in msg and "ConnectionError: offline" in msg  # 3. hub id + why
    # with a data dir that lacks the file, the message shows where it looked
    with pytest.raises(DataSourceError, match=str(tmp_path / "gsm8k" / "train.jsonl")):
        load("gsm8k_train", data_dir=tmp_path)


def test_missing_source_without_datasets_installed(monkeypatch):
    monkeypatch.delenv("TURNRL_DATA_DIR", raising=False)
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(DataSourceError, match="datasets"):
        load("aime24")
    with pytest.raises(DataSourceError, match="lost-in-the-middle"):
        load("nq_open")  # no hub copy: says where to get the file
    with pytest.raises(DataSourceError, match="params_key.custom"):
        load("aime25", params_key="params_key.custom")


def test_unknown_name_and_split():
    with pytest.raises(DataSourceError, match="unknown data set 'nope'"):
        load("nope")
    with pytest.raises(DataSourceError, match="no split 'dev'"):
        load("gsm8k", split="dev")


# --------------------------------------------------------------------------- hub-only training sets
def test_limo_and_openr1_local_layout(tmp_path, monkeypatch):
    monkeypatch.setenv("TURNRL_DATA_DIR", str(tmp_path))
    _write_jsonl(
        tmp_path / "limo" / "train.jsonl",
        [
            {"question": "Find x if 2x=4.", "solution": "x=2 so \\boxed{2}", "answer": "2"},
            {"question": "Compute 3!", "solution": "6", "answer": " 6 "},
        ],
    )
    (tmp_path / "openr1_math").mkdir()
    write_parquet(
        [
            {"problem": "What is 1/2 + 1/2?", "solution": "1", "answer": "1", "uuid": "u1"},
            {"problem": "Solve y+1=3.", "solution": "y=2", "answer": "2", "uuid": "u2"},
            {"problem": "Area of unit square?", "solution": "1", "answer": "1", "uuid": "u3"},
        ],
        tmp_path / "openr1_math" / "train.parquet",
    )
    limo = load("limo", use_hub=False)
    assert [r["answer"] for r in limo.rows] == ["2", "6"]
    assert [r["id"] for r in limo.rows] == ["limo-0", "limo-1"]
    assert limo.rows[0]["prompt"] == "Find x if 2x=4."
    _check_schema(limo.rows)
    r1 = load("openr1_math", use_hub=False)
    assert r1.origin.endswith("openr1_math/train.parquet")
    assert [r["prompt"][:7] for r in r1.rows] == ["What is", "Solve y", "Area of"]
    _check_schema(r1.rows)
    assert DATASETS["limo"].hub_id == "GAIR/LIMO"
    assert DATASETS["openr1_math"].hub_id == "open-r1/OpenR1-Math-220k"


# --------------------------------------------------------------------------- custom field mapping
def test_custom_fields_user_jsonl(tmp_path):
    f = _write_jsonl(
        tmp_path / "mine.jsonl",
        [
            {"qid": 7, "meta": {"q": "Capital of France?", "topic": "geo", "difficulty": "Level 3"}, "golds": ["Paris", "paris, FR"]},
            {"qid": 8, "meta": {"q": "2^10?", "topic": "math", "difficulty": 2}, "golds": [1024.0]},
        ],
    )
    fields = {"id": "qid", "prompt": "meta.q", "answers": "golds", "subject": "meta.topic", "level": "meta.difficulty"}
    rows = load_rows(f, fields=fields, answer_transform="number")
    assert rows == [
        {"id": "7", "prompt": "Capital of France?", "answer": "Paris", "answers": ["Paris", "paris, FR"],
         "subject": "geo", "level": 3, "source": "mine"},
        {"id": "8", "prompt": "2^10?", "answer": "1024", "answers": ["1024"],
         "subject": "math", "level": 2, "source": "mine"},
    ]
    # the same through the path= argument under a name of one's own
    rows2 = load_rows("my_set", path=f, fields=fields)
    assert {r["source"] for r in rows2} == {"my_set"}
    # extra mapped fields are carried through
    rows3 = load_rows(f, fields={"prompt": "meta.q", "answers": "golds", "topic": "meta.topic"})
    assert rows3[0]["topic"] == "geo" and rows3[0]["id"] == "mine-0"


def test_custom_fields_user_parquet_and_guessing(tmp_path):
    p = write_parquet(
        [
            {"Question": "How many legs has a spider?", "Final": 8, "Tags": ["bio"], "Grade": 1},
            {"Question": "Half of 3?", "Final": 1.5, "Tags": [], "Grade": 2},
        ],
        tmp_path / "user.parquet",
    )
    rows = load_rows(p, fields={"prompt": "Question", "answer": "Final", "level": "Grade", "tags": "Tags"},
                     answer_transform="number")
    assert [(r["prompt"][:8], r["answer"], r["level"], r["tags"]) for r in rows] == [
        ("How many", "8", 1, ["bio"]),
        ("Half of ", "1.5", 2, []),
    ]
    # without fields, common column names are recognised
    g = _write_jsonl(tmp_path / "plain.jsonl", [{"question": "q?", "answer": "a", "id": "x1"}])
    assert load_rows(g)[0] == {"id": "x1", "prompt": "q?", "answer": "a", "answers": ["a"],
                               "subject": None, "level": None, "source": "plain"}
    h = _write_jsonl(tmp_path / "odd.jsonl", [{"text": "q?", "label": "a"}])
    with pytest.raises(DataSourceError, match="lacks prompt"):
        load_rows(h)
    with pytest.raises(DataSourceError, match="lacks answer"):
        load_rows(h, fields={"prompt": "text"})


def test_registered_set_with_overridden_fields(tmp_path):
    d = tmp_path / "math500"
    _write_jsonl(d / "test.jsonl", [{"q": "x?", "a": "1", "uid": "u"}])
    rows = load_rows("math500", data_dir=tmp_path, fields={"id": "uid", "prompt": "q", "answer": "a"})
    assert rows[0]["id"] == "u" and rows[0]["source"] == "math500"


# --------------------------------------------------------------------------- malformed rows
BAD_LINES = [
    {"problem": "ok 1", "answer": "1", "unique_id": "r1"},  # line 1
    "",  # line 2: blank, ignored
    "{not json",  # line 3
    {"answer": "1", "unique_id": "r4"},  # line 4: missing problem
    {"problem": "   ", "answer": "1", "unique_id": "r5"},  # line 5: empty prompt
    {"problem": 42, "answer": "1", "unique_id": "r6"},  # line 6: wrong type
    {"problem": "ok 7", "answer": "1", "unique_id": "r7", "level": "hard"},  # line 7: bad level
    {"problem": "ok 8", "answer": "1", "unique_id": "r1"},  # line 8: duplicate id
    {"problem": "ok 9", "answer": None, "unique_id": "r9"},  # line 9: null answer
    [1, 2],  # line 10: not an object
    {"problem": "ok 11", "answer": 11, "unique_id": "r11", "level": 3},  # line 11: fine
]


def test_bad_rows_fail_with_file_and_line(tmp_path):
    f = _write_jsonl(tmp_path / "bad.jsonl", [r if isinstance(r, str) else json.dumps(r) for r in BAD_LINES])
    with pytest.raises(DataSourceError, match=rf"{f}:3: bad JSON line"):
        load("math500", path=f)
    # each problem alone, with its line number
    expect = {
        4: "missing field 'problem'",
        5: "empty prompt",
        6: "must be a string, got int",
        7: "level must be an integer",
        8: "duplicate id 'r1'",
        9: "is null",
        10: "expected a JSON object",
    }
    for line, problem in expect.items():
        g = _write_jsonl(tmp_path / f"bad{line}.jsonl", [json.dumps(BAD_LINES[0])] + [""] * (line - 2)
                         + [BAD_LINES[line - 1] if isinstance(BAD_LINES[line - 1], str) else json.dumps(BAD_LINES[line - 1])])
        with pytest.raises(DataSourceError) as err:
            load("math500", path=g)
        assert f"{g}:{line}: " in str(err.value) and problem in str(err.value), str(err.value)


def test_bad_rows_dropped_and_counted(tmp_path):
    f = _write_jsonl(tmp_path / "bad.jsonl", [r if isinstance(r, str) else json.dumps(r) for r in BAD_LINES])
    with pytest.warns(UserWarning, match="dropped 8 malformed"):
        res = load("math500", path=f, on_bad_row="drop")
    assert isinstance(res, LoadResult)
    assert [r["id"] for r in res.rows] == ["r1", "r11"]
    assert res.rows[1]["answer"] == "11" and res.rows[1]["level"] == 3
    assert [line for line, _ in res.dropped] == [3, 4, 5, 6, 7, 8, 9, 10]
    assert res.n_dropped == 8
    with pytest.warns(UserWarning):
        assert len(load_rows("math500", path=f, on_bad_row="drop")) == 2
    with pytest.raises(DataSourceError, match="on_bad_row"):
        load("math500", path=f, on_bad_row="ignore")  # type: ignore[arg-type]


def test_bad_rows_in_parquet_and_gzip(tmp_path):
    p = write_parquet([{"problem": "a", "answer": "1"}, {"problem": "", "answer": "2"}], tmp_path / "x.parquet")
    with pytest.raises(DataSourceError, match=rf"{p}:2: empty prompt"):
        load_rows(p, fields={"prompt": "problem", "answer": "answer"})
    gz = tmp_path / "g.jsonl.gz"
    with gzip.open(gz, "wt") as fh:
        fh.write(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(DataSourceError, match=rf"{gz}:1: answer has no '#### "):
        load("gsm8k_test", path=gz)


# --------------------------------------------------------------------------- parquet helpers
def test_parquet_roundtrip_preserves_lists(tmp_path):
    rows = [
        {"id": "1", "prompt": "p", "answer": "a", "answers": ["a", "b"], "subject": None, "level": 3,
         "source": "s", "passages": [{"title": "t", "text": "x"}]},
        {"id": "2", "prompt": "q", "answer": "c", "answers": ["c"], "subject": "S", "level": None,
         "source": "s", "passages": [{"title": "u", "text": "y"}, {"title": "v", "text": "z"}]},
    ]
    p = write_parquet(rows, tmp_path / "sub" / "rows.parquet")
    back = read_parquet(p)
    assert back == rows
    assert isinstance(back[0]["answers"], list)
    # and the loader reads it back as schema rows (passages included, corpus buildable)
    again = load_rows(p)
    assert [r["answers"] for r in again] == [["a", "b"], ["c"]]
    assert [c["title"] for c in load_search_corpus(again)] == ["t", "u"]


def test_search_corpus_dedupes_by_title_and_text():
    rows = [
        {"ctxs": [{"title": "A", "text": "x"}, {"title": "Z", "text": "ignored"}]},
        {"ctxs": [{"title": "A", "text": "x"}]},
        {"ctxs": [{"title": "B", "text": "x"}]},
        {"passages": [{"title": "A", "text": "y"}]},
    ]
    assert load_search_corpus(rows) == [
        {"id": "0", "title": "A", "text": "x"},
        {"id": "1", "title": "B", "text": "x"},
        {"id": "2", "title": "A", "text": "y"},
    ]
    with pytest.raises(DataSourceError, match="no passages"):
        load_search_corpus([{"id": "q", "prompt": "x"}])


def test_registry_specs_are_complete():
    assert set(DATASETS) >= {"math500", "gsm8k_train", "gsm8k_test", "aime24", "aime25", "amc23",
                             "nq_open", "limo", "openr1_math"}
    for spec in DATASETS.values():
        assert "prompt" in spec.fields and ("answer" in spec.fields or "answers" in spec.fields)
        assert spec.answer_transform in sources.ANSWER_TRANSFORMS
        assert spec.hub_id or spec.hub_note


# --------------------------------------------------------------------------- a row's own fields
def test_unmapped_fields_follow_the_schema_unchanged(tmp_path):
    """A row's fields beyond the mapping (an int, a nested dict with a list, a null) are kept
    as they are; mapped columns are not repeated; a column named like a schema field is
    shadowed by the schema's value."""
    rows = [{"key": "k1", "question": "Sort 3 1 2", "target_list": [1, 2, 3], "length": 3,
             "case": {"input": [3, 1, 2], "seed": 7, "note": None}, "source": "theirs", "ctxs": [{"text": "x"}]}]
    p = _write_jsonl(tmp_path / "sortfix.jsonl", rows)
    (row,) = load_rows(p, fields={"id": "key", "prompt": "question", "answers": "target_list",
                                  "gold": "ctxs.0.text"})
    assert row["length"] == 3 and isinstance(row["length"], int)
    assert row["case"] == {"input": [3, 1, 2], "seed": 7, "note": None}
    assert row["gold"] == "x" and "ctxs" not in row                    # mapped through a dotted path
    assert "key" not in row and "question" not in row and "target_list" not in row
    assert row["source"] == "sortfix" and row["answers"] == ["1", "2", "3"]


def test_write_rows_round_trips_extra_fields_whatever_their_types(tmp_path):
    """The JSON `extra` column gives each row its own fields back: types that differ between
    rows and nested dicts with different keys stay as they were (columns of their own would
    fail or fill in keys)."""
    base = {"prompt": "p", "answer": "a", "answers": ["a"], "subject": None, "level": None, "source": "s"}
    rows = [{"id": "1", **base, "length": 3, "case": {"input": [3, 1, 2]}, "extra": "a column named extra"},
            {"id": "2", **base, "length": "three", "case": {"seed": 7, "deep": {"x": [1.5, None]}}},
            {"id": "3", **base}]
    path = sources.write_rows(rows, tmp_path / "rows.parquet")
    assert read_parquet(path) == rows
    import pandas as pd
    frame = pd.read_parquet(path)                                           # readable without turnrl
    assert list(frame.columns) == [*SCHEMA_FIELDS, "extra"] and json.loads(frame["extra"][2]) == {}
    assert read_parquet(sources.write_rows([], tmp_path / "empty.parquet")) == []


@needs_data
def test_registered_sets_keep_their_other_fields():
    """MATH-500's worked `solution` is no mapped field: it comes with the row."""
    rows = load_rows("math500")
    assert all(isinstance(r["solution"], str) and r["solution"] for r in rows)
    assert "problem" not in rows[0] and "unique_id" not in rows[0]
