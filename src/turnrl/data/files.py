"""Reading data files (JSONL, gzip, JSON, parquet) record by record, and writing rows to parquet.

Rows written with :func:`write_rows` (the preprocessed splits and benchmarks) keep the common
schema's fields as their own columns and every other field of a row (a row's own metadata:
a test case, a seed, ``passages``) in one JSON column, ``extra``, marked in the file's metadata;
:func:`read_parquet` decodes it back into each row, so a list stays a list, a nested dict a
dict and an int an int, whatever the other rows hold (columns of their own would turn mixed
types into an error and give nested dicts every key any row has). ``pandas.read_parquet``
shows the JSON text.
"""

from __future__ import annotations

import codecs
import gzip
import json
import os
import zlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

#: The fields every row has, in order.
SCHEMA_FIELDS: tuple[str, ...] = ("id", "prompt", "answer", "answers", "subject", "level", "source")

#: The column of a row file holding the other fields as JSON, and the metadata key marking it.
EXTRA_COLUMN = "extra"
_EXTRA_MARK = b"turnrl.extra"

class DataSourceError(RuntimeError):
    """A data set could not be found, or a row in it is malformed. The message says how to fix it."""


class MalformedDataError(DataSourceError):
    """A file was found but a row in it (or the whole file) cannot be read; names file and line."""


class _BadRow(ValueError):
    """Internal: one row is malformed; the message is the problem (without file:line)."""



# --------------------------------------------------------------------------- reading files
def _is_parquet(path: Path) -> bool:
    """By its name (.parquet, .pq, any case), or by parquet's magic bytes where the name says nothing."""
    if path.suffix.lower() in (".parquet", ".pq"):
        return True
    if path.suffix.lower() in (".jsonl", ".json", ".gz", ".ndjson") or not path.is_file():
        return False
    with path.open("rb") as fh:
        return fh.read(4) == b"PAR1"


def _iter_records(path: Path) -> Iterator[tuple[int, Any]]:
    """Yield ``(line_or_row_number, record)``; a record that could not be decoded is a ``_BadRow``.
    A file that cannot be read at all (not parquet, broken gzip) is a ``DataSourceError``."""
    if path.suffix.lower() in (".csv", ".tsv"):
        raise MalformedDataError(f"{path}: a {path.suffix[1:].upper()} file; turnrl reads jsonl, json and parquet: "
                                 "convert it (python -c \"import pandas as pd; pd.read_csv('data.csv').to_json("
                                 "'data.jsonl', orient='records', lines=True)\")")
    if _is_parquet(path):
        try:
            records = read_parquet(path)
        except Exception as exc:  # pyarrow's ArrowInvalid, OSError, ...: not a parquet file
            raise MalformedDataError(f"{path}: not a readable parquet file ({type(exc).__name__}: "
                                  f"{str(exc)[:200]}); write it with pandas/pyarrow or use .jsonl") from None
        for i, rec in enumerate(records, start=1):
            yield i, rec
        return
    if path.suffix.lower() == ".json":
        raw = path.read_bytes().removeprefix(codecs.BOM_UTF8)   # Notepad's and PowerShell's UTF-8
        whole = raw.lstrip().startswith(b"[")
        if not whole and raw.lstrip().startswith(b"{"):   # one object, perhaps written over several lines
            try:
                json.loads(raw.decode("utf-8"))
                whole = True
            except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
                pass   # JSON lines, read line by line below
        if whole:
            try:
                data = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise MalformedDataError(f"{path}: not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
            except json.JSONDecodeError as exc:
                raise MalformedDataError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}") from None
            except RecursionError:
                raise MalformedDataError(f"{path}: JSON nested too deeply to read") from None
            for i, rec in enumerate(data if isinstance(data, list) else [data], start=1):
                yield i, rec
            return
        # otherwise a .json file holding JSON lines: fall through
    opener = gzip.open if path.name.endswith(".gz") else open
    lineno = 0
    try:
        with opener(path, "rb") as fh:
            for lineno, raw_line in enumerate(fh, start=1):
                yield lineno, _decode_line(raw_line)
    except (OSError, EOFError, zlib.error) as exc:  # a truncated or corrupt .gz
        raise MalformedDataError(f"{path}:{lineno + 1}: cannot read the file further ({type(exc).__name__}: "
                              f"{exc}); is it a complete {'gzip' if path.name.endswith('.gz') else 'text'} "
                              "file?") from None


_BLANK = object()


def _decode_line(raw: bytes) -> Any:
    """One JSONL line to a record, ``_BadRow`` if it is not a JSON value, ``_BLANK`` if empty."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return _BadRow(f"not UTF-8 text (byte {exc.start} of the line)")
    line = line.removeprefix("\ufeff")   # a byte-order mark opening the file
    if not line.strip():
        return _BLANK
    try:
        return json.loads(line.rstrip("\r\n"))  # so that a cut-off line's column is on this line
    except json.JSONDecodeError as exc:
        return _BadRow(f"bad JSON line: {exc.msg} (column {exc.colno})")
    except RecursionError:
        return _BadRow("bad JSON line: nested too deeply")


def write_rows(rows: Iterable[Mapping[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Write schema rows to parquet: the schema's fields as columns, every other field of a row
    as JSON in the column ``extra`` (read back by :func:`read_parquet`); returns the path.
    Values JSON cannot hold (a parquet file's timestamps or bytes) are stored as their text."""
    packed = []
    for row in rows:
        out = {k: row.get(k) for k in SCHEMA_FIELDS}
        out[EXTRA_COLUMN] = json.dumps({k: v for k, v in row.items() if k not in SCHEMA_FIELDS}, default=str)
        packed.append(out)
    return write_parquet(packed, path, columns=(*SCHEMA_FIELDS, EXTRA_COLUMN), metadata={_EXTRA_MARK: b"json"})


def write_parquet(rows: Iterable[Mapping[str, Any]], path: str | os.PathLike[str],
                  columns: tuple[str, ...] = SCHEMA_FIELDS, metadata: dict[bytes, bytes] | None = None) -> Path:
    """Write rows (list-valued columns included) to a parquet file; returns the path.
    ``columns``: the (null) columns of a file with no rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [dict(r) for r in rows]
    try:
        table = pa.Table.from_pylist(rows) if rows else pa.table({k: pa.array([], pa.null()) for k in columns})
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
        raise DataSourceError(f"{path}: cannot store the rows as parquet: {_mixed_column(rows) or exc}") from None
    if metadata:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
    tmp = path.with_name(path.name + ".tmp")
    try:
        pq.write_table(table, tmp)
        tmp.replace(path)          # a failed write (a full disk) never leaves a half file at `path`
    except OSError as exc:         # pyarrow's errors do not say which file
        exc.filename = exc.filename or str(path)
        raise
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _mixed_column(rows: list[dict[str, Any]]) -> str:
    """Which column pyarrow cannot store, and why (values of several types), or ""."""
    import pyarrow as pa

    for key in dict.fromkeys(k for r in rows for k in r):
        values = [r.get(key) for r in rows]
        try:
            pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
            kinds = sorted({type(v).__name__ for v in values if v is not None})
            return (f"field {key!r} holds values of different types ({', '.join(kinds)}); map only "
                    "fields with one type in data.fields, or make the values one type")
    return ""


def read_parquet(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read a parquet file back as a list of plain-Python dicts (lists stay lists); a file of
    :func:`write_rows` gets each row's other fields back from its ``extra`` column."""
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    rows = table.to_pylist()
    if (table.schema.metadata or {}).get(_EXTRA_MARK) == b"json":
        for row in rows:
            text = row.pop(EXTRA_COLUMN, None)
            row.update(json.loads(text) if text else {})
    return rows