"""Fuzzing the rows of a user's data file (data.train_set / data.heldout_set) with hypothesis.

A file mixes good rows with malformed ones (bad JSON, not an object, not UTF-8, a lone
surrogate, missing / null / empty / wrongly typed prompt or answer, non-finite numbers) and
blank lines, as jsonl, jsonl.gz or parquet. `preprocess` must then, with `data.bad_rows: fail`,
stop with a MalformedDataError naming the file and the line of the first malformed row; with
`drop`, keep exactly the good rows and count the dropped ones, by line, in the manifest.
Never another exception. TURNRL_FUZZ_EXAMPLES sets the number of files tried (default 200).
"""
from __future__ import annotations

import gzip
import json
import os
import tempfile
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnrl.config import Config
from turnrl.data.sources import DataSourceError, MalformedDataError, read_parquet
from turnrl.pipeline.preprocess import preprocess

from conftest import print_past_capture

EXAMPLES = int(os.environ.get("TURNRL_FUZZ_EXAMPLES", "200"))
TRIED: Counter = Counter()

text = st.text(max_size=12)
blank = st.sampled_from(["", " ", "\t", "  \u3000 "])          # str.strip() removes all of these
# allow_subnormal=False: the warm start (turnrl.models.tiny, run in-process by earlier tests) sets torch.set_flush_denormal,
# and hypothesis refuses to generate subnormal floats then.
finite = st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False, width=32, allow_subnormal=False)
not_a_string = st.integers() | st.booleans() | st.lists(st.integers(), max_size=2) | st.dictionaries(text, text, max_size=2)


def _obj(**kv) -> str:
    return json.dumps(kv)


# (kind, strategy of one JSONL line as bytes, malformed?) ; "{i}" makes good prompts distinct
JSONL_KINDS = {
    "good": (st.builds(lambda t, a: _obj(q="P{i} " + t, a=a), text, text.filter(str.strip) | finite), False),
    "good_extra_keys": (st.builds(lambda t: _obj(q="P{i} x", a="1", other=t, more=[1, {"b": None}]), text), False),
    "blank": (blank, None),
    "bad_json": (st.builds(lambda k: _obj(q="P x", a="1")[:k], st.integers(1, 20)), True),
    "not_an_object": (st.sampled_from(["[1, 2]", '"text"', "3", "null", "true"]), True),
    "not_utf8": (st.just(b'{"q": "P \xff\xfe", "a": "1"}'), True),
    "lone_surrogate": (st.just('{"q": "P \\ud800", "a": "1"}'), True),
    "missing_prompt": (st.just(_obj(a="1")), True),
    "missing_answer": (st.just(_obj(q="P x")), True),
    "null_prompt": (st.just(_obj(q=None, a="1")), True),
    "null_answer": (st.just(_obj(q="P x", a=None)), True),
    "empty_prompt": (blank.map(lambda b: _obj(q=b, a="1")), True),
    "empty_answer": (blank.map(lambda b: _obj(q="P x", a=b)), True),
    "prompt_not_a_string": (not_a_string.map(lambda v: _obj(q=v, a="1")), True),
    # a list of answers is valid (any element is right); an empty one, or one of non-answers, is not
    "answer_wrong_type": ((st.booleans() | st.just([]) | st.lists(st.dictionaries(text, text, max_size=1), min_size=1,
                                                                  max_size=2) | st.dictionaries(text, text, max_size=1))
                          .map(lambda v: _obj(q="P x", a=v)), True),
    "answer_not_finite": (st.sampled_from(["NaN", "Infinity", "-Infinity"])
                          .map(lambda v: '{"q": "P x", "a": %s}' % v), True),
}
PARQUET_KINDS = {
    "good": (st.builds(lambda t, a: ("P{i} " + t, a), text, text.filter(str.strip)), False),
    "null_prompt": (st.just((None, "1")), True),
    "null_answer": (st.just(("P x", None)), True),
    "empty_prompt": (blank.map(lambda b: (b, "1")), True),
    "empty_answer": (blank.map(lambda b: ("P x", b)), True),
}


@st.composite
def data_files(draw):
    fmt = draw(st.sampled_from(["jsonl", "jsonl.gz", "parquet"]))
    kinds = JSONL_KINDS if fmt != "parquet" else PARQUET_KINDS
    names = draw(st.lists(st.sampled_from(sorted(kinds) + ["good"] * len(kinds)), min_size=1, max_size=14))
    rows = []
    for i, name in enumerate(names):
        value = draw(kinds[name][0])
        if isinstance(value, str):
            value = value.replace("{i}", str(i))
        elif isinstance(value, tuple) and isinstance(value[0], str):
            value = (value[0].replace("{i}", str(i)), value[1])
        rows.append((name, value, kinds[name][1]))
    return fmt, rows


def _write(path: Path, fmt: str, rows) -> None:
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        table = pa.table({"q": pa.array([v[0] for _, v, _ in rows], pa.string()),
                          "a": pa.array([v[1] for _, v, _ in rows], pa.string())})
        pq.write_table(table, path)
        return
    data = b"\n".join(v if isinstance(v, bytes) else v.encode("utf-8", "surrogatepass") for _, v, _ in rows) + b"\n"
    path.write_bytes(gzip.compress(data) if fmt.endswith(".gz") else data)


def _good_prompts(rows) -> list[str]:
    out = []
    for name, value, bad in rows:
        if bad is False:
            out.append(value[0] if isinstance(value, tuple) else json.loads(value)["q"])
    return out


@pytest.mark.filterwarnings("ignore:.*malformed row:UserWarning")
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(file=data_files(), policy=st.sampled_from(["fail", "drop"]), same_set=st.booleans())
def test_malformed_rows_fail_with_file_and_line_or_are_dropped_and_counted(file, policy, same_set):
    fmt, rows = file
    TRIED[fmt] += 1
    bad_lines = [n for n, (_, _, bad) in enumerate(rows, start=1) if bad]
    good = _good_prompts(rows)
    with tempfile.TemporaryDirectory(prefix="turnrl-fuzz-") as tmp:
        path = Path(tmp) / f"mine.{fmt}"
        _write(path, fmt, rows)
        cfg = Config.model_validate({
            "data": {"train_set": str(path), "heldout_set": str(path) if same_set else "synthetic",
                     "fields": {"prompt": "q", "answer": "a"}, "bad_rows": policy,
                     "train_examples": 100, "heldout_examples": 4},
            "eval": {"benchmarks": []}})
        out = Path(tmp) / "out"
        try:
            manifest = preprocess(cfg, out)
        except MalformedDataError as exc:
            assert policy == "fail" and bad_lines, exc
            assert str(exc).startswith(f"{path}:{bad_lines[0]}: "), (str(exc), bad_lines)
            assert "data.bad_rows: drop" in str(exc)
            TRIED["answered: failed at the first malformed row"] += 1
            return
        except DataSourceError as exc:   # nothing (or too little) left to train on
            assert len(good) < (2 if same_set else 1), (exc, good)
            assert "no rows" in str(exc) or "too few" in str(exc)
            TRIED["answered: too few good rows"] += 1
            return
        assert policy == "drop" or not bad_lines
        written = [r["prompt"] for r in read_parquet(out / "train.parquet")]
        if same_set:
            written += [r["prompt"] for r in read_parquet(out / "heldout.parquet")]
        assert sorted(written) == sorted(good)
        bad = manifest["bad_rows"]
        assert bad["dropped"] == len(bad_lines)
        if bad_lines:
            first = bad["files"][str(path)]["first"]
            assert [int(r.split(":")[0].split()[1]) for r in first] == bad_lines[:10]
        TRIED["answered: kept the good rows, counted the dropped"] += 1


@pytest.mark.filterwarnings("ignore:.*malformed row:UserWarning")
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(content=st.binary(max_size=300) | st.builds(lambda b, k: gzip.compress(b)[:k], st.binary(max_size=200),
                                                  st.integers(0, 60)),
       suffix=st.sampled_from([".jsonl", ".jsonl.gz", ".json", ".parquet"]),
       policy=st.sampled_from(["fail", "drop"]))
def test_any_bytes_as_a_data_file_give_rows_or_a_clear_error(content, suffix, policy):
    """Random or truncated bytes under any accepted suffix: rows, or a DataSourceError naming the file."""
    from turnrl.data.sources import load
    TRIED["bytes"] += 1
    with tempfile.TemporaryDirectory(prefix="turnrl-fuzz-") as tmp:
        path = Path(tmp) / f"mine{suffix}"
        path.write_bytes(content)
        try:
            load(str(path), fields={"prompt": "q", "answer": "a"}, on_bad_row=policy)
        except DataSourceError as exc:
            assert str(exc).startswith(str(path)), exc
            TRIED["answered: a DataSourceError naming the file"] += 1
        else:
            TRIED["answered: rows"] += 1


@pytest.fixture(scope="module", autouse=True)
def _print_counts(request):
    yield
    if TRIED:
        formats = {k: v for k, v in TRIED.items() if not k.startswith("answered")}
        print_past_capture(request, f"\ndata-row fuzz: {sum(formats.values())} files tried ("
                           + ", ".join(f"{k} {v}" for k, v in sorted(formats.items())) + "), all answered cleanly: "
                           + ", ".join(f"{k[10:]} {v}" for k, v in sorted(TRIED.items()) if k.startswith("answered")))
