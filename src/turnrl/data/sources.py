"""Real data sets loaded into one row schema.

Every loader returns rows shaped as::

    {"id": str,               # the set's own id, or "<source>-<index>" when it has none
     "prompt": str,           # the problem / question text, no chat template
     "answer": str,           # the canonical answer
     "answers": list[str],    # every acceptable answer ([answer] for math)
     "subject": str | None,
     "level": int | None,
     "source": str}           # the data set name

plus any extra keys the field mapping names (``nq_open`` adds ``passages``: a list of
``{"title", "text"}`` with the gold passage first), plus every field of the record the mapping
does not use, unchanged (a row's own metadata, for the environment's ``reset``; MATH-500's
``solution``). A record's field named like a schema field but not mapped to it is shadowed.
Written with :func:`write_rows`, the extra fields round-trip through parquet as JSON.

Where a set comes from, in order:

1. an explicit ``path`` (in params, a benchmark's ``path`` or the data set file itself),
2. ``<data_dir>/<set dir>/<file>``, ``data_dir`` being the argument or ``$TURNRL_DATA_DIR``
   (``.jsonl``, ``.jsonl.gz``, ``.json`` and ``.parquet`` copies of the file are all accepted),
3. the Hugging Face hub through ``datasets`` (optional; any failure is caught).

If none works, :class:`DataSourceError` says how to provide each of the three.

Field mapping is data, not code: a spec's ``fields`` maps schema field -> source field (dotted
paths such as ``"ctxs.0.text"`` reach into nested values) and ``answer_transform`` names one of
:data:`ANSWER_TRANSFORMS`. A user file with other column names loads with
``load_rows("my.jsonl", fields={"prompt": "q", "answer": "a"})``.

Malformed rows (bad JSON, missing or empty fields, wrong types, duplicate ids) are reported as
``file:line: problem`` (1-based line of a JSONL file, 1-based row of a parquet file). With
``on_bad_row="fail"`` (the default) the first one raises; with ``"drop"`` they are skipped and
listed in :attr:`LoadResult.dropped`.
"""

from __future__ import annotations

import math
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from turnrl.data.files import (EXTRA_COLUMN, SCHEMA_FIELDS, DataSourceError, MalformedDataError, _BadRow, _BLANK,
                               _iter_records, read_parquet, write_parquet, write_rows)
from turnrl.data.registry_sets import (DATASETS, ENV_VAR, DatasetSpec, _data_dir, _load_hub, _lookup,
                                       _missing_error, resolve_local_path)

__all__ = [
    "ENV_VAR",
    "SCHEMA_FIELDS",
    "EXTRA_COLUMN",
    "ANSWER_TRANSFORMS",
    "DatasetSpec",
    "DATASETS",
    "DataSourceError",
    "MalformedDataError",
    "LoadResult",
    "load",
    "load_rows",
    "load_search_corpus",
    "resolve_local_path",
    "write_parquet",
    "write_rows",
    "read_parquet",
]

OnBadRow = Literal["fail", "drop"]


# --------------------------------------------------------------------------- answer transforms
def _gsm8k_final(value: Any) -> str:
    """GSM8K: the text after the last ``#### ``, thousands separators removed."""
    text = _scalar_str(value, "answer")
    if "####" not in text:
        raise _BadRow("answer has no '#### <final answer>' marker")
    final = text.rsplit("####", 1)[1].strip().replace(",", "")
    if not final:
        raise _BadRow("nothing after the '####' marker in answer")
    return final


_INT_RE = re.compile(r"[+-]?\d+")


def _number(value: Any) -> str:
    """Integer-valued numbers as plain integers (``27.0`` -> ``"27"``, ``"025"`` -> ``"25"``,
    ``70`` -> ``"70"``); other values stripped and kept as written."""
    if isinstance(value, bool):
        raise _BadRow(f"answer must be a string or number, got bool {value!r}")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _BadRow(f"answer is not a finite number: {value!r}")
        return str(int(value)) if value.is_integer() else repr(value)
    text = _scalar_str(value, "answer").strip()
    if _INT_RE.fullmatch(text):
        return str(int(text))
    return text


def _strip(value: Any) -> str:
    return _scalar_str(value, "answer").strip()


def _boxed(value: Any) -> str:
    """The content of the field's last balanced ``\\boxed{}`` (a worked solution's answer)."""
    from turnrl.rewards.math import last_boxed
    text = _scalar_str(value, "answer")
    content = last_boxed(text)
    if content is None or not content.strip():
        raise _BadRow("answer field has no \\boxed{...} to take the answer from")
    return content.strip()


#: Named answer transforms usable from configuration (``answer_transform: gsm8k``).
ANSWER_TRANSFORMS: Mapping[str, Callable[[Any], str]] = MappingProxyType(
    {"gsm8k": _gsm8k_final, "number": _number, "strip": _strip, "boxed": _boxed}
)

# --------------------------------------------------------------------------- results
@dataclass
class LoadResult:
    """Rows in the schema, the rows dropped as ``(line, reason)``, and where they came from."""

    rows: list[dict[str, Any]]
    dropped: list[tuple[int, str]] = field(default_factory=list)
    origin: str = ""

    @property
    def n_dropped(self) -> int:
        return len(self.dropped)

def _get(rec: Mapping[str, Any], key: str) -> Any:
    """``rec[key]``, or follow a dotted path (``"ctxs.0.text"``); raises KeyError if absent."""
    if key in rec:
        return rec[key]
    cur: Any = rec
    for part in key.split("."):
        if isinstance(cur, Mapping) and part in cur:
            cur = cur[part]
        elif isinstance(cur, (list, tuple)) and part.lstrip("-").isdigit() and -len(cur) <= int(part) < len(cur):
            cur = cur[int(part)]
        else:
            raise KeyError(key)
    return cur


def _scalar_str(value: Any, what: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _BadRow(f"{what} must be a string or number, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise _BadRow(f"{what} is not a finite number: {value!r}")
    return str(value)


def _level(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise _BadRow(f"level must be an integer, got bool {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(?:level\s*)?(\d+)\s*", value, flags=re.IGNORECASE)  # "3", "Level 3"
        if m:
            return int(m.group(1))
        if value.strip() in ("", "?", "Level ?"):
            return None
    raise _BadRow(f"level must be an integer, got {type(value).__name__} {value!r}")


def _passages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, (list, tuple)) or not value:
        raise _BadRow("passages must be a non-empty list of {title, text} objects")
    out = []
    for j, p in enumerate(value):
        if not isinstance(p, Mapping) or not isinstance(p.get("text"), str):
            raise _BadRow(f"passage {j} must be an object with a string 'text'")
        title = p.get("title", "")
        out.append({"title": title if isinstance(title, str) else str(title), "text": p["text"]})
    return out


# --------------------------------------------------------------------------- row mapping
def _resolve_transform(t: str | Callable[[Any], str] | None) -> Callable[[Any], str]:
    if t is None:
        return _strip
    if callable(t):
        return t
    try:
        return ANSWER_TRANSFORMS[t]
    except KeyError:
        raise DataSourceError(
            f"unknown answer_transform {t!r}; use one of {sorted(ANSWER_TRANSFORMS)} or a callable"
        ) from None


def _field(rec: Mapping[str, Any], fields: Mapping[str, str], key: str, required: bool = True) -> Any:
    """The value of schema field ``key`` in ``rec`` by the mapping; ``_BadRow`` if a required one
    is missing or null, None for a missing optional one."""
    src = fields.get(key)
    if src is None:
        return None
    try:
        value = _get(rec, src)
    except KeyError:
        if not required:
            return None
        raise _BadRow(f"missing field {src!r} (mapped to {key!r})") from None
    if value is None and required:
        raise _BadRow(f"field {src!r} (mapped to {key!r}) is null")
    return value


def _answers(rec: Mapping[str, Any], fields: Mapping[str, str], transform: Callable[[Any], str]) -> tuple[str, list[str]]:
    """(answer, answers): a list answer means any of its elements is right."""
    answers: list[str] | None = None
    if "answers" in fields:
        raw = _field(rec, fields, "answers")
        if isinstance(raw, (str, int, float)) and not isinstance(raw, bool):
            raw = [raw]
        if not isinstance(raw, (list, tuple)):
            raise _BadRow(f"answers field {fields['answers']!r} must be a list, got {type(raw).__name__}")
        answers = [transform(a) for a in raw]
    answer: str | None = None
    if "answer" in fields:
        raw_answer = _field(rec, fields, "answer")
        if isinstance(raw_answer, (list, tuple)):   # a list answer: any of its elements is right
            listed = [transform(a) for a in raw_answer]
            if not listed:
                raise _BadRow(f"answer field {fields['answer']!r} is an empty list")
            answer, answers = listed[0], [*listed, *(a for a in (answers or []) if a not in listed)]
        else:
            answer = transform(raw_answer)
    if answer is None:
        if not answers:
            raise _BadRow(f"answers field {fields['answers']!r} is an empty list")
        answer = answers[0]
    if answers is None:
        answers = [answer]
    elif answer not in answers:
        answers = [answer, *answers]
    if not answer.strip():
        raise _BadRow("empty answer")
    return answer, [a for a in answers if a.strip()]


def _row_id(rec: Mapping[str, Any], fields: Mapping[str, str], source: str, index: int) -> str:
    if "id" not in fields:
        return f"{source}-{index}"
    rid = _field(rec, fields, "id")
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        raise _BadRow(f"id field {fields['id']!r} must be a string or integer, got {type(rid).__name__}")
    if not str(rid).strip():
        raise _BadRow(f"empty id (field {fields['id']!r})")
    return str(rid)


def _map_row(
    rec: Any,
    fields: Mapping[str, str],
    transform: Callable[[Any], str],
    source: str,
    index: int,
) -> dict[str, Any]:
    """One source record -> one schema row; raises ``_BadRow`` with the problem. The record's
    fields the mapping does not use follow the schema's unchanged (a row's own metadata, for
    the environment's ``reset``); one named like a schema field is shadowed by it."""
    if not isinstance(rec, Mapping):
        raise _BadRow(f"row is a {type(rec).__name__}, expected a JSON object")
    prompt = _field(rec, fields, "prompt")
    if not isinstance(prompt, str):
        raise _BadRow(f"prompt field {fields['prompt']!r} must be a string, got {type(prompt).__name__}")
    if not prompt.strip():
        raise _BadRow(f"empty prompt (field {fields['prompt']!r})")
    answer, answers = _answers(rec, fields, transform)
    rid = _row_id(rec, fields, source, index)
    subject = _field(rec, fields, "subject", required=False)
    if subject is not None and not isinstance(subject, str):
        raise _BadRow(f"subject field {fields['subject']!r} must be a string, got {type(subject).__name__}")
    row: dict[str, Any] = {"id": rid, "prompt": prompt, "answer": answer, "answers": answers, "subject": subject,
                           "level": _level(_field(rec, fields, "level", required=False)), "source": source}
    # extra mapped fields, copied through (passages are normalized)
    for key in fields:
        if key not in row:
            row[key] = _passages(_field(rec, fields, key)) if key == "passages" \
                else _field(rec, fields, key, required=False)
    used = {src.split(".")[0] for src in fields.values()} | set(fields.values())
    for key, value in rec.items():
        if key not in used and key not in row:
            row[key] = value
    for key, value in row.items():
        _check_unicode(value, key)
    return row


def _check_unicode(value: Any, key: str) -> None:
    """JSON may escape a lone surrogate (\\ud800) that no UTF-8 file (parquet) can hold."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise _BadRow(f"{key} is not valid Unicode text ({exc.reason} at character {exc.start})") from None
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _check_unicode(k, key)
            _check_unicode(v, key)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _check_unicode(v, key)


def _check_fields(fields: Mapping[str, str], where: str) -> dict[str, str]:
    if not isinstance(fields, Mapping):
        raise DataSourceError(f"{where}: fields must be a mapping schema_field -> source_field, got {fields!r}")
    fields = dict(fields)
    bad = {k: v for k, v in fields.items() if not isinstance(k, str) or not isinstance(v, str) or not v}
    if bad:
        raise DataSourceError(f"{where}: fields values must be non-empty source column names, got {bad}")
    if "source" in fields:
        raise DataSourceError(f"{where}: 'source' is set by the loader and cannot be mapped from a column")
    missing = [k for k in ("prompt",) if k not in fields]
    if "answer" not in fields and "answers" not in fields:
        missing.append("answer (or answers)")
    if missing:
        raise DataSourceError(
            f"{where}: the field mapping {fields} lacks {', '.join(missing)}; give fields like "
            '{"prompt": "<question column>", "answer": "<answer column>"}'
        )
    return fields


_GUESS = {
    "prompt": ("prompt", "problem", "question", "query", "input"),
    "answer": ("answer", "final_answer", "target", "output"),
}


def _guess_fields(path: Path) -> dict[str, str]:
    """A mapping for a user file given without ``fields``: common column names, else an error."""
    first = None
    for _, rec in _iter_records(path):
        if isinstance(rec, Mapping):
            first = rec
            break
    if first is None:
        raise DataSourceError(f"{path}: no JSON object rows to infer fields from; give the field names "
                              "(data.fields in params.yaml, fields= in Python), e.g. {prompt: question, answer: solution}")
    fields: dict[str, str] = {}
    for key, cands in _GUESS.items():
        for c in cands:
            if c in first:
                fields[key] = c
                break
    if "answers" in first:
        fields["answers"] = "answers"
    for col in ("passages", "ctxs"):
        if col in first:
            fields["passages"] = col
            break
    for opt in ("id", "subject", "level"):
        if opt in first:
            fields[opt] = opt
    return _check_fields(fields, f"{path} (columns {sorted(first)})")


def _warn(msg: str) -> None:
    """A UserWarning attributed to the first caller outside this module."""
    if sys.version_info >= (3, 12):
        warnings.warn(msg, UserWarning, skip_file_prefixes=(os.path.dirname(__file__),))
    else:  # pragma: no cover - 3.11
        warnings.warn(msg, UserWarning, stacklevel=4)


_DROP_HINT = "pass on_bad_row='drop' to skip malformed rows"


def _map_records(
    records: Iterable[tuple[int, Any]],
    fields: Mapping[str, str],
    transform: Callable[[Any], str],
    source: str,
    where: str,
    on_bad_row: OnBadRow,
    drop_hint: str = _DROP_HINT,
) -> LoadResult:
    rows: list[dict[str, Any]] = []
    dropped: list[tuple[int, str]] = []
    seen: set[str] = set()
    index = 0
    for lineno, rec in records:
        if rec is _BLANK:
            continue
        try:
            if isinstance(rec, _BadRow):
                raise rec
            row = _map_row(rec, fields, transform, source, index)
            if row["id"] in seen:
                raise _BadRow(f"duplicate id {row['id']!r}")
        except _BadRow as exc:
            if on_bad_row == "fail":
                raise MalformedDataError(f"{where}:{lineno}: {exc} ({drop_hint})") from None
            dropped.append((lineno, str(exc)))
        else:
            seen.add(row["id"])
            rows.append(row)
        index += 1
    if dropped:
        _warn(f"{where}: dropped {len(dropped)} malformed row(s), first: line {dropped[0][0]}: {dropped[0][1]}")
    return LoadResult(rows=rows, dropped=dropped, origin=where)


def _load_file(path: Path, fields, transform, source, on_bad_row, drop_hint=_DROP_HINT) -> LoadResult:
    if not path.is_file():
        raise DataSourceError(f"{path}: no such file")
    return _map_records(_iter_records(path), fields, transform, source, str(path), on_bad_row, drop_hint)

# --------------------------------------------------------------------------- public API
def load(
    name_or_path: str | os.PathLike[str],
    *,
    path: str | os.PathLike[str] | None = None,
    fields: Mapping[str, str] | None = None,
    split: str | None = None,
    data_dir: str | os.PathLike[str] | None = None,
    on_bad_row: OnBadRow = "fail",
    answer_transform: str | Callable[[Any], str] | None = None,
    source: str | None = None,
    use_hub: bool = True,
    params_key: str | None = None,
    drop_hint: str = _DROP_HINT,
) -> LoadResult:
    """Load a data set into the schema; see the module docstring for the resolution order.

    ``name_or_path``: a name in :data:`DATASETS` (``split`` may pick ``gsm8k`` + ``"test"`` ->
    ``gsm8k_test``) or a path to a file. ``fields`` / ``answer_transform`` override the spec's
    (for a path without ``fields``, common column names are tried). ``source`` overrides the
    ``source`` column. ``use_hub=False`` skips the hub. ``params_key`` is the params.yaml key
    named in the not-found error (e.g. ``eval.benchmarks[0].path``); ``drop_hint`` is how the
    caller turns on dropping, named in the error of a malformed row.
    """
    if on_bad_row not in ("fail", "drop"):
        raise DataSourceError(f"on_bad_row must be 'fail' or 'drop', got {on_bad_row!r}")

    key = os.fspath(name_or_path)
    is_registered = key in DATASETS or (split is not None and f"{key}_{split}" in DATASETS)
    if not is_registered and (path is not None or Path(key).suffix or os.sep in key or "/" in key):
        # a user file: name_or_path is the path (or `path` given with a free-form name)
        file = Path(path if path is not None else key).expanduser()
        if not file.is_file():
            raise DataSourceError(f"{file}: no such file (a data set path was given for {key!r})")
        flds = _check_fields(fields, str(file)) if fields is not None else _guess_fields(file)
        src = source or (key if path is not None else file.name.split(".")[0])
        return _load_file(file, flds, _resolve_transform(answer_transform or "strip"), src, on_bad_row,
                          drop_hint)

    spec = _lookup(key, split)
    src = source or spec.name
    transform = _resolve_transform(answer_transform or spec.answer_transform)
    flds = _check_fields(fields if fields is not None else spec.fields, spec.name)

    # 1. explicit path
    if path is not None and os.fspath(path):
        file = Path(path).expanduser()
        if not file.is_file():
            raise DataSourceError(
                f"{file}: no such file (explicit path for data set {spec.name!r}"
                f"{'; ' + params_key if params_key else ''}); fix the path or leave it empty to use "
                f"${ENV_VAR}/{spec.relpath} or the hub"
            )
        return _load_file(file, flds, transform, src, on_bad_row, drop_hint)

    # 2. data directory
    base = _data_dir(data_dir)
    local = resolve_local_path(spec.name, data_dir)
    if local is not None:
        return _load_file(local, flds, transform, src, on_bad_row, drop_hint)

    # 3. hub
    hub_why = "skipped (use_hub=False)" if not use_hub else ""
    if use_hub:
        records, hub_why = _load_hub(spec)
        if records is not None:
            hflds = _check_fields(fields if fields is not None else (spec.hub_fields or spec.fields), spec.name)
            where = f"hf://{spec.hub_id}[{spec.hub_split}]"
            return _map_records(records, hflds, transform, src, where, on_bad_row, drop_hint)

    raise _missing_error(spec, params_key or "path", base, hub_why)


def load_rows(
    name_or_path: str | os.PathLike[str],
    *,
    path: str | os.PathLike[str] | None = None,
    fields: Mapping[str, str] | None = None,
    split: str | None = None,
    data_dir: str | os.PathLike[str] | None = None,
    on_bad_row: OnBadRow = "fail",
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """:func:`load` returning just the rows (dropped rows, if any, are reported as a warning)."""
    return load(
        name_or_path, path=path, fields=fields, split=split, data_dir=data_dir, on_bad_row=on_bad_row, **kwargs
    ).rows


def load_search_corpus(
    rows_or_path: Iterable[Mapping[str, Any]] | str | os.PathLike[str] = "nq_open",
    **load_kwargs: Any,
) -> list[dict[str, str]]:
    """The distinct gold passages (the first of each row's ``passages``) as ``{id, title, text}``.

    ``rows_or_path``: schema rows (with ``passages``), raw NQ rows (with ``ctxs``), a registered
    name, or a path to an NQ-shaped file. Passages are deduplicated by ``(title, text)`` and keep
    first-seen order; ids are ``"0"``, ``"1"``, ... in that order.
    """
    if isinstance(rows_or_path, (str, os.PathLike)):
        key = os.fspath(rows_or_path)
        if key not in DATASETS:
            load_kwargs.setdefault("fields", DATASETS["nq_open"].fields)
            load_kwargs.setdefault("source", "nq_open")
        rows: Iterable[Mapping[str, Any]] = load_rows(key, **load_kwargs)
    else:
        rows = rows_or_path
    corpus: list[dict[str, str]] = []
    seen: set[tuple[str, str]] = set()
    for i, row in enumerate(rows):
        ps = row.get("passages") or row.get("ctxs")
        if not ps:
            raise DataSourceError(
                f"row {i} (id {row.get('id')!r}) has no passages/ctxs: a search corpus needs rows "
                "loaded from nq_open (or a mapping with 'passages')"
            )
        gold = ps[0]
        k = (str(gold.get("title", "")), str(gold["text"]))
        if k not in seen:
            seen.add(k)
            corpus.append({"id": str(len(corpus)), "title": k[0], "text": k[1]})
    return corpus
