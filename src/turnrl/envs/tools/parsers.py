"""Reading tool calls from a policy turn, in the model family's own format (`env.options.parser`):

    hermes   <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number per turn
             (Qwen 2.5 / 3, Hermes, the embedded tiny model)
    llama3   the turn is a JSON object {"name": ..., "parameters": {...}} (after an optional
             <|python_tag|>), several separated by ";" (Llama 3.1 / 3.2 JSON tool calling)
    mistral  [TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}, ...] (v3), [TOOL_CALLS]name[ARGS]{...}
             (v11), [TOOL_CALLS]name[CALL_ID]id[ARGS]{...} (Mistral Small 3.2, Magistral, Devstral)
    module:function   your own: text -> ParsedTurn (or a list of {"name", "arguments"} dicts)

A botched call is never an exception: it becomes a string saying why it is not a call, which
the environment returns as an error observation.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from turnrl.plugins import PluginError, is_import_path, load_object


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    id: str | None = None   # the call's id where the model writes one (Mistral v0.3's format)


@dataclass
class ParsedTurn:
    """A policy turn: its calls in the order written, each a `ToolCall` or, for a botched one,
    a string saying why it is not a call (it gets an error message); and the text around them."""
    items: list[ToolCall | str] = field(default_factory=list)
    content: str = ""

    @property
    def calls(self) -> list[ToolCall]:
        return [c for c in self.items if isinstance(c, ToolCall)]

    @property
    def errors(self) -> list[str]:
        return [c for c in self.items if not isinstance(c, ToolCall)]

    @property
    def is_answer(self) -> bool:
        return not self.items


def _as_call(obj: Any, arguments_key: str = "arguments") -> ToolCall | str:
    """A call from a parsed JSON value, or why it is not one."""
    if not isinstance(obj, dict):
        return f"a tool call must be a JSON object with \"name\" and \"{arguments_key}\", not {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return "the tool call has no \"name\""
    args = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):       # OpenAI-style: the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return f"the arguments of {name} are not valid JSON ({exc.msg})"
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return f"the arguments of {name} must be a JSON object, not {type(args).__name__}"
    call_id = obj.get("id")
    return ToolCall(name.strip(), args, call_id if isinstance(call_id, str) and call_id else None)


def _loads(body: str) -> tuple[Any, str | None]:
    try:
        return json.loads(body), None
    except json.JSONDecodeError as exc:
        return None, f"the tool call is not valid JSON ({exc.msg} at character {exc.pos})"


_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_HERMES_HINT = 'Write <tool_call>{"name": ..., "arguments": {...}}</tool_call>.'


def parse_hermes(text: str) -> ParsedTurn:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them."""
    turn = ParsedTurn()
    rest, last = [], 0
    for m in _HERMES.finditer(text):
        rest.append(text[last:m.start()])
        last = m.end()
        if not m.group(2):
            turn.items.append(f"the tool call is not closed with </tool_call>. {_HERMES_HINT}")
            continue
        value, problem = _loads(m.group(1).strip())
        call = _as_call(value) if problem is None else f"{problem}. {_HERMES_HINT}"
        turn.items.append(call)
    rest.append(text[last:])
    turn.content = "".join(rest).strip()
    return turn


_LLAMA_END = re.compile(r"(<\|eot_id\|>|<\|eom_id\|>|<\|end_of_text\|>)\s*$")


def parse_llama3(text: str) -> ParsedTurn:
    """Llama 3.1 / 3.2 JSON tool calling: the turn is `{"name": ..., "parameters": {...}}`
    (optionally after <|python_tag|>), several separated by ";". Other text is an answer; text
    after the calls is the turn's content."""
    body = _LLAMA_END.sub("", text).strip()
    tagged = body.startswith("<|python_tag|>")
    body = body.removeprefix("<|python_tag|>").strip()
    if not tagged and not body.startswith("{"):
        return ParsedTurn(content=text.strip())
    turn = ParsedTurn()
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(body):
        if turn.items and body[pos] != "{":   # prose after the calls: the turn's text, not a botched call
            turn.content = body[pos:].strip()
            break
        try:
            value, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError as exc:
            turn.items.append(f"the tool call is not valid JSON ({exc.msg} at character {exc.pos}). "
                              'Write {"name": ..., "parameters": {...}}.')
            break
        call = _as_call(value, "parameters")
        turn.items.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \n\t;":
            pos += 1
    return turn


# from v11 on: the name, the call's id where the template writes one, then the arguments (after
# [ARGS], or straight after the name in the shortest form)
_MISTRAL_NAMED = re.compile(r"\[TOOL_CALLS\]\s*([A-Za-z0-9_.\-]+)\s*(?:\[CALL_ID\]\s*([A-Za-z0-9_\-]+)\s*)?"
                            r"(?:\[ARGS\]|(?=\{))", re.DOTALL)


def parse_mistral(text: str) -> ParsedTurn:
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v3) or, from v11 on,
    `[TOOL_CALLS]name[ARGS]{...}` once per call, with `[CALL_ID]id` before `[ARGS]` where the
    template writes the call's id (Mistral Small 3.2, Magistral, Devstral)."""
    if "[TOOL_CALLS]" not in text:
        return ParsedTurn(content=text.strip())
    turn = ParsedTurn(content=text[:text.index("[TOOL_CALLS]")].strip())
    decoder = json.JSONDecoder()
    named = list(_MISTRAL_NAMED.finditer(text))
    if named:
        for m in named:
            try:
                value, _ = decoder.raw_decode(text, m.end())
            except json.JSONDecodeError as exc:
                turn.items.append(f"the arguments of {m.group(1)} are not valid JSON ({exc.msg})")
                continue
            call = _as_call({"name": m.group(1), "arguments": value, "id": m.group(2)})
            turn.items.append(call)
        return turn
    start = text.index("[TOOL_CALLS]") + len("[TOOL_CALLS]")
    try:
        value, _ = decoder.raw_decode(text[start:].lstrip())
    except json.JSONDecodeError as exc:
        turn.items.append(f"the tool calls are not valid JSON ({exc.msg}). "
                          'Write [TOOL_CALLS][{"name": ..., "arguments": {...}}].')
        return turn
    for item in value if isinstance(value, list) else [value]:
        call = _as_call(item)
        turn.items.append(call)
    return turn


PARSERS: dict[str, Callable[[str], ParsedTurn]] = {"hermes": parse_hermes, "qwen": parse_hermes,
                                                   "llama3": parse_llama3, "mistral": parse_mistral}


def resolve_parser(name: str, key: str = "env.options.parser") -> Callable[[str], ParsedTurn]:
    """A built-in parser by name (hermes, qwen, llama3, mistral) or your own by import path:
    `fn(text) -> ParsedTurn`, or a list of {"name", "arguments"} dicts (then every other text
    of the turn is its content)."""
    if name in PARSERS:
        return PARSERS[name]
    if not is_import_path(name):
        raise PluginError(f"{key} = {name!r}: must be one of {', '.join(PARSERS)} or an import path "
                          "module:function (text -> ParsedTurn)")
    fn = load_object(name, key)
    if not callable(fn):
        raise PluginError(f"{key} = {name!r}: {fn!r} is not callable; it must be parse(text) -> ParsedTurn")

    def parse(text: str) -> ParsedTurn:
        out = fn(text)
        if isinstance(out, ParsedTurn):
            return out
        turn = ParsedTurn(content=text.strip())
        for item in out or []:
            turn.items.append(item if isinstance(item, ToolCall) else _as_call(item))
        return turn
    return parse
