"""Chat Completions requests to token ids, and sampled ids back to an assistant message.

A request's messages are rendered by the model's own chat template (with its `tools`, in the
family's function-calling format), with one exception that keeps training exact: an assistant
message the gateway itself produced in this episode (found by its tool-call ids, or by its
content) is not re-rendered from its text but replaced by the ids that were sampled, and the
text after it is tokenized on its own, as the built-in rollouts tokenize an observation once.
So a program that sends back what it was answered, and appends tool results, gets a prompt that
extends the previous prompt + completion token for token, and its calls merge into one sample
(`turnrl.gateway.samples`). A program that edits what it was answered gets its text rendered as
written: a new sample, trained on what the model really saw.

The answer is parsed for tool calls in the family's format (`turnrl.envs.tools.parsers`, as the
`tools` environment reads them) and returned as OpenAI `tool_calls`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Collection, Sequence

from turnrl.envs.tools.parsers import ParsedTurn
from turnrl.rollout.chat import ChatFormat, renders_tools, tools_text

_MARK = "\u2063TURNRL_SAMPLED_{}\u2063"


class BadRequest(ValueError):
    """A request the gateway answers with HTTP 400 (the message says what to fix)."""


@dataclass(frozen=True)
class Produced:
    """An assistant message the gateway answered in this episode, and the ids behind it."""
    completion_ids: list[int]
    message: dict


def text_of(content: Any) -> str:
    """A message's content as text: a string, None, or OpenAI content parts (their text parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        try:
            content.encode("utf-8")
        except UnicodeEncodeError as exc:   # a lone surrogate (a client that cut an emoji in half)
            raise BadRequest(f"content is not valid Unicode (a lone surrogate at character {exc.start}: "
                             f"{content[max(0, exc.start - 20):exc.start]!r} ...)") from None
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text"):
                parts.append(text_of(str(part.get("text", ""))))
            elif isinstance(part, str):
                parts.append(text_of(part))
            else:
                raise BadRequest(f"content part {part!r:.80} is not text; the gateway serves text models")
        return "".join(parts)
    raise BadRequest(f"content must be a string or a list of content parts, not {type(content).__name__}")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet (Qwen's, Llama 3's): the character standing for each byte.
    Printable Latin-1 bytes stand for themselves; the others, in order, for U+0100 on."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + k): b for k, b in enumerate(others)}}


_BYTE_OF = _byte_level_alphabet()


def token_bytes(tokenizer: Any, token_id: int, byte_level: bool) -> list[int]:
    """The bytes token `token_id` stands for: a piece of a character (an emoji, an accented
    letter) is its own bytes, not the replacement character decoding it alone gives. Byte-level
    BPE pieces (`byte_level`: turnrl.rollout.chat.is_byte_level) through their alphabet, SentencePiece's
    byte tokens (<0xE9>) as that byte, other pieces as their text (▁ a space); a special token
    as its text."""
    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    if not isinstance(piece, str) or token_id in set(getattr(tokenizer, "all_special_ids", ())):
        return list(tokenizer.decode([token_id]).encode("utf-8"))
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return [int(piece[3:5], 16)]
        except ValueError:
            pass
    if byte_level and all(c in _BYTE_OF for c in piece):
        return [_BYTE_OF[c] for c in piece]
    return list(piece.replace("\u2581", " ").encode("utf-8"))


def _template_call(call: Any, default_id: str) -> dict:
    """An OpenAI tool call as chat templates take it: arguments as an object, not a JSON string;
    `default_id` where it has none."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise BadRequest(f"a tool call must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}, "
                         f"got {call!r:.120}")
    name = call["function"].get("name")
    if not isinstance(name, str) or not name.strip():
        raise BadRequest(f"a tool call's function needs a name (a non-empty string), got {name!r:.60} in "
                         f"{call!r:.120}")
    # name first, as models write their calls and OpenAI sends them (a client's own dump may sort the
    # keys): a template that dumps the function object then renders what the model would have sampled
    function = {"name": call["function"].get("name"), "arguments": call["function"].get("arguments"),
                **call["function"]}
    arguments = function["arguments"]
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise BadRequest(f"tool call {function.get('name')!r}: arguments are not valid JSON ({exc.msg})") from None
    call_id = str(call["id"]) if call.get("id") is not None else default_id
    return {"type": "function", "id": call_id, "function": function}


def normalize_messages(messages: Any) -> list[dict]:
    """The request's messages checked and in the shape chat templates take (string content,
    tool calls with object arguments); BadRequest naming the message that is wrong. A call
    without an id gets one from its place (`call_<message>_<k>`), a tool result without a
    `tool_call_id` the id of the call it answers: the last assistant message's calls, in order.
    An assistant message's `reasoning_content` goes to the template, which renders it where the
    model's format has a place for it (Qwen3's and DeepSeek-R1's <think>) and drops it elsewhere."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("`messages` must be a non-empty list of {role, content} objects")
    out = []
    unanswered: list[str] = []
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise BadRequest(f"messages[{k}]: must be an object whose role is system, developer, user, assistant "
                             f"or tool; got {m!r:.120}")
        role = "system" if m["role"] == "developer" else m["role"]
        if m.get("function_call") is not None:
            raise BadRequest(f"messages[{k}]: `function_call` (OpenAI's deprecated function calling) is not read; "
                             "write the call as `tool_calls` and its result as a `tool` message")
        try:
            message = {"role": role, "content": text_of(m.get("content"))}
            if role == "assistant" and m.get("reasoning_content"):
                message["reasoning_content"] = text_of(m["reasoning_content"])
            if role == "assistant" and m.get("tool_calls"):
                if not isinstance(m["tool_calls"], list):
                    raise BadRequest(f"tool_calls must be a list of tool calls, not {type(m['tool_calls']).__name__}")
                message["tool_calls"] = [_template_call(c, f"call_{k}_{j}") for j, c in enumerate(m["tool_calls"])]
                unanswered = [c["id"] for c in message["tool_calls"]]
        except BadRequest as exc:
            raise BadRequest(f"messages[{k}]: {exc}") from None
        if role == "tool":
            given = m.get("tool_call_id")
            answered = unanswered[0] if unanswered else f"call_{k}"
            message["tool_call_id"] = str(given) if given is not None else answered
            unanswered = [i for i in unanswered if i != message["tool_call_id"]]
        if m.get("name"):
            message["name"] = m["name"]
        out.append(message)
    return out


def _same_answer(message: dict, produced: Produced) -> bool:
    """Whether `message` is the assistant message `produced` answered (tool-call ids first:
    they are the gateway's own and unique; else the content and no tool calls)."""
    ours = produced.message
    calls, our_calls = message.get("tool_calls") or [], ours.get("tool_calls") or []
    if calls or our_calls:
        return [c.get("id") for c in calls] == [c.get("id") for c in our_calls] and \
            (message.get("content") or "") == (ours.get("content") or "")
    return (message.get("content") or "") == (ours.get("content") or "")


class Renderer:
    """Messages -> prompt ids (splicing in the episode's sampled ids), ids -> message."""

    def __init__(self, fmt: ChatFormat, parser: Callable[[str], ParsedTurn]):
        self.fmt, self.parser = fmt, parser

    def prompt_ids(self, messages: list[dict], tools: Sequence[dict] | None,
                   produced: Sequence[Produced] = ()) -> list[int]:
        """The prompt of normalized `messages` (+ `tools`), ending with the assistant's
        generation prompt; every assistant message of `produced` is its sampled ids."""
        matches = {}
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                match = next((p for p in reversed(produced) if _same_answer(m, p)), None)
                if match is not None:
                    matches[i] = match
        return self.spliced_prompt_ids(messages, tools, matches)

    def spliced_prompt_ids(self, messages: list[dict], tools: Sequence[dict] | None,
                           spliced_in: dict[int, Produced]) -> list[int]:
        """The prompt of normalized `messages` (+ `tools`), ending with the assistant's
        generation prompt; the message at each index of `spliced_in` is that Produced's ids."""
        marked, spliced = [], []
        for i, m in enumerate(messages):
            match = spliced_in.get(i)
            if match is None:
                marked.append(m)
            else:
                spliced.append((match, len(marked)))
                marked.append({"role": "assistant", "content": _MARK.format(len(spliced) - 1)})
        text = self.render(marked, tools)
        ids: list[int] = []
        seen = ""   # the rendered text up to here, marks included
        for k, (p, at) in enumerate(spliced):
            before, _, text = text.partition(_MARK.format(k))
            seen += before
            if before[-1:].isspace():
                # a template that writes a space before an assistant's content (Mistral v0.3, Llama 2):
                # the sampled ids followed the generation prompt, which has none
                asked = self.render(marked[:at], tools)
                if len(seen) > len(asked) and seen.rstrip() == asked.rstrip():
                    before = before[:len(before) - (len(seen) - len(asked))]
            seen += _MARK.format(k)
            ids += self.fmt.encode(before) + list(p.completion_ids)
            end = self.fmt.end_of_turn
            if self.fmt.ends_turn(p.completion_ids) and end and text.startswith(end):
                text = text[len(end):]   # the sampled ids already close the message
                seen += end
        return ids + self.fmt.encode(text)

    def render(self, messages: list[dict], tools: Sequence[dict] | None) -> str:
        tools = list(tools or [])
        tokenizer = self.fmt.tokenizer
        if tools and (self.fmt.template_type == "base" or not renders_tools(tokenizer)):
            messages = _with_system_text(messages, tools_text(tools))
            tools = []
        if self.fmt.template_type == "base":
            labels = {"system": "", "user": "User: ", "assistant": "Assistant: ", "tool": "Tool: "}
            body = "\n".join(labels[m["role"]] + m["content"] for m in messages)
            return body + "\nAssistant:"
        messages = self.fmt.messages_for_template(messages)   # roles, system and tool calls as this template takes them
        try:
            return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                 add_generation_prompt=True)
        except Exception as exc:   # jinja2's TemplateError: roles out of order, a role it refuses
            raise BadRequest(f"the model's chat template cannot render these messages: {exc}") from None

    def answer(self, completion_ids: Sequence[int], *, parse_tools: bool, call_id: Callable[[int], str],
               taken_ids: Collection[str] = ()) -> dict:
        """The assistant message of sampled ids: content, and `tool_calls` parsed from the
        model's own format when the request offered tools (a botched call stays in the content).
        A call's id is the one the model wrote (Mistral v0.3's format) unless it is missing or
        in `taken_ids` (the episode's earlier calls'), else `call_id(k)` for the turn's k-th call."""
        tokenizer = self.fmt.tokenizer
        text = tokenizer.decode(list(completion_ids), skip_special_tokens=True)
        if not parse_tools:
            return {"role": "assistant", "content": text}
        # the parser reads the turn with its special tokens (Mistral's [TOOL_CALLS] is one), not
        # the ones that close it (eos, end of turn), as the `tools` environment's rollouts read it
        ids, specials = list(completion_ids), set(getattr(tokenizer, "all_special_ids", []))
        while ids and ids[-1] in specials:
            ids.pop()
        turn = self.parser(tokenizer.decode(ids, skip_special_tokens=False))
        if not turn.calls or turn.errors:
            return {"role": "assistant", "content": text}
        taken = set(taken_ids)
        calls = []
        for k, c in enumerate(turn.calls):
            own = c.id if c.id and c.id not in taken else call_id(k)
            taken.add(own)
            calls.append({"id": own, "type": "function",
                          "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}})
        return {"role": "assistant", "content": turn.content or None, "tool_calls": calls}


def _with_system_text(messages: list[dict], extra: str) -> list[dict]:
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=(messages[0]["content"] + "\n\n" + extra).strip())
        return [first] + messages[1:]
    return [{"role": "system", "content": extra}] + messages
