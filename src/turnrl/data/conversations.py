"""Conversations for supervised fine-tuning (the `sft` stage): rows in the OpenAI messages
format, from a jsonl/parquet file or a Hugging Face dataset.

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": null, "tool_calls": [{"id": "c0", "type": "function",
                   "function": {"name": "calculator", "arguments": "{\\"expression\\": \\"2 * 3\\"}"}}]},
                  {"role": "tool", "tool_call_id": "c0", "content": "6"},
                  {"role": "assistant", "content": "<answer>6</answer>"}],
     "tools": [{"type": "function", "function": {"name": "calculator", ...}}]}

Parquet files and Hugging Face datasets hold a list of messages as Arrow structs, which give
every row every key any row has: a user message gets `tool_calls: null`, a tool's parameters get
the other tools' property names as nulls. So in rows read from them (not in JSON text, where a
null is written on purpose) a null key is read as absent; a message keeps its `content`.

Only the shape is checked here (a row is an object with a non-empty list of messages, each an
object with a role); whether the model's chat template can render it is checked when it is
rendered (turnrl.gateway.conversations), which names the same file and row.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, Iterator

from turnrl.data.files import _BLANK, _BadRow, _is_parquet, _iter_records
from turnrl.data.sources import DataSourceError, MalformedDataError


@dataclass
class Conversation:
    """One row: its messages, its tools, and where it came from (`source:row`, for errors)."""
    messages: list[dict]
    tools: list[dict] = field(default_factory=list)
    where: str = ""


def load_conversations(source: str, messages_field: str = "messages", tools_field: str = "tools",
                       limit: int | None = None) -> list[Conversation]:
    """Every row of `source` (a .jsonl/.json/.parquet path, or hf:<id>[:split]) as a
    Conversation, or its first `limit` rows; MalformedDataError naming the file and row of the
    first bad one."""
    arrow = source.startswith("hf:") or _is_parquet(Path(source))   # rows of structs: a null key is an absent one
    rows = _hf_rows(source[3:]) if source.startswith("hf:") else _file_rows(Path(source))
    out = []
    for where, record in islice(rows, limit):
        if isinstance(record, _BadRow):
            raise MalformedDataError(f"{where}: {record}")
        if record is _BLANK:
            continue
        out.append(_conversation(record, where, messages_field, tools_field, arrow))
    if not out:
        raise DataSourceError(f"sft.data = {source!r}: no conversations in it")
    return out


def _file_rows(path: Path) -> Iterator[tuple[str, Any]]:
    if not path.exists():
        raise DataSourceError(f"sft.data = {str(path)!r}: no such file; give a jsonl or parquet file of conversations "
                              "in the OpenAI messages format, hf:<dataset id>, demonstrations, or none")
    for number, record in _iter_records(path):
        yield f"{path}:{number}", record


def _hf_rows(spec: str) -> Iterator[tuple[str, Any]]:
    name, _, split = spec.partition(":")
    try:
        import datasets
        rows = datasets.load_dataset(name, split=split or "train")
    except Exception as exc:   # offline, unknown id, no access
        raise DataSourceError(f"sft.data = 'hf:{spec}': the Hugging Face dataset could not be loaded "
                              f"({type(exc).__name__}: {str(exc)[:200]}); use a local jsonl/parquet file") from None
    for number, record in enumerate(rows, start=1):
        yield f"hf:{spec} row {number}", record


def _conversation(record: Any, where: str, messages_field: str, tools_field: str, arrow: bool = False) -> Conversation:
    if not isinstance(record, dict):
        raise MalformedDataError(f"{where}: a row must be an object with a {messages_field!r} list, "
                                 f"got {type(record).__name__}")
    messages = _json_text(record.get(messages_field))   # a parquet column of JSON text (eval generations)
    tools = _json_text(record.get(tools_field)) or []
    if arrow and not isinstance(record.get(messages_field), str) and isinstance(messages, list):
        messages = [_struct_message(m) if isinstance(m, dict) else m for m in messages]
    if arrow and not isinstance(record.get(tools_field), str):
        tools = _without_nulls(tools)
    if not isinstance(messages, list) or not messages:
        raise MalformedDataError(f"{where}: field {messages_field!r} must be a non-empty list of messages "
                                 f"(set sft.messages_field to the field that holds them); row keys: {sorted(record)[:8]}")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise MalformedDataError(f"{where}: {messages_field}[{k}] must be an object with a role, got {m!r:.80}")
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise MalformedDataError(f"{where}: field {tools_field!r} must be a list of OpenAI tool objects")
    return Conversation(messages=[dict(m) for m in messages], tools=[dict(t) for t in tools], where=where)


def _struct_message(message: dict) -> dict:
    """A message read from Arrow structs: its null keys dropped at any depth, but its `content`
    (an assistant's tool-call message has a null one, and templates read it)."""
    return {k: v if k == "content" else _without_nulls(v) for k, v in message.items() if v is not None or k == "content"}


def _without_nulls(value: Any) -> Any:
    """`value` with every null-valued key of its objects dropped, at any depth."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _json_text(value: Any) -> Any:
    """A field as given, or the JSON it holds when it is text that parses (else the text)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value
