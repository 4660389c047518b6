"""Token assembly for multi-turn conversations, token in and token out.

A trajectory is one growing list of token ids: the prompt (system + user message rendered by
the model's chat template, ending with the assistant generation prompt), then for each turn
the ids the policy sampled, exactly as sampled, then the observation block. The observation
block closes the assistant message, adds the environment's message in its role (tool or
user) and opens the next assistant message. It is rendered once from the chat template and
tokenized once; nothing already in the trajectory is ever decoded and re-encoded.

`template_type: base` (for base models, MuTIS's plain template) uses plain text instead of a
chat template.

What families' templates differ in, and what is done about it (each found by
`turnrl.models.check`, the compatibility matrix):

- the token that ends an assistant turn is often not the tokenizer's eos (Gemma's
  `<end_of_turn>`, Phi-3's `<|end|>`, Llama 3's `<|eot_id|>` with eos `<|end_of_text|>`): it is read
  from the template (`end_of_turn`), and a turn the model ended with it is not closed twice;
- a template may refuse a system message (Gemma 2): the system prompt then opens the first user
  message, as the family's documentation advises (`prompt_text`);
- a template may not render a tool message (Mistral, Gemma: roles must alternate; Phi-3 drops
  it silently): tool observations then go as user messages (`rendered_role`).

Function calling (the `tools` environment): an environment's `tools` (JSON schemas, as
`apply_chat_template(tools=...)` takes them) are rendered into the prompt by the template itself,
the family's own format (Qwen's `<tools>` block in the system message, Llama 3.1's JSON in the
first user message, ...). A template that ignores `tools=` gets them as a `<tools>` block at the
end of the system prompt instead (`renders_tools`). An observation may be several messages (one
tool message per call of a turn): the frame around k messages is read from the template like
the frame around one, so consecutive tool messages render as the template groups them.
"""
from __future__ import annotations

import hashlib
import re
import string
import weakref
from itertools import groupby
from dataclasses import dataclass
from typing import Any, Callable, Sequence

_ASSISTANT = "\u2063ASSISTANT_MARK\u2063"
_OBS = "\u2063OBSERVATION_MARK\u2063"
def _probe_result_id(k: int) -> str:
    """The id the probed frame's k-th tool result answers (distinct, so `observation_text` can
    put each result's own call id in its place)."""
    return f"turnrl{k + 1:03d}"


# The probes' tool-call id: nine alphanumerics, the only ids Mistral v0.3's template takes (it raises on others)
_PROBE_CALL_ID = _probe_result_id(0)


def _probe_call(call_id: str = _PROBE_CALL_ID) -> dict:
    return {"type": "function", "id": call_id,
            "function": {"name": "turnrl_probe_tool", "arguments": {"turnrl_probe_argument": 1}}}


@dataclass(frozen=True)
class ChatFormat:
    tokenizer: object
    template_type: str = "chat"

    def prompt_text(self, system: str, user: str, tools: Sequence[dict] | None = None) -> str:
        """The prompt up to the assistant's generation prompt; `tools` (JSON schemas) rendered
        by the chat template, or described in the system prompt where the template cannot."""
        tools = list(tools or [])
        if tools and (self.template_type == "base" or not renders_tools(self.tokenizer)):
            system = (system + "\n\n" if system else "") + tools_text(tools)
            tools = []
        if self.template_type == "base":
            return f"{system}\n\nUser: {user}\nAssistant:"
        kwargs = {"tools": tools} if tools else {}
        if not system:
            messages = [{"role": "user", "content": user}]
        elif _renders_system(self.tokenizer):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        else:   # the template refuses a system message: it opens the user message instead
            messages = [{"role": "user", "content": f"{system}\n\n{user}"}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)

    def prompt_ids(self, system: str, user: str, tools: Sequence[dict] | None = None) -> list[int]:
        return self.encode(self.prompt_text(system, user, tools))

    def observation_text(self, observation: str | Sequence[str], role: str, after_eos: bool = False,
                         call_ids: Sequence[str | None] | None = None) -> str:
        """Text that follows a policy turn: end of the assistant message, the observation
        message in `role` (or in `rendered_role(role)`, when the template has no such role),
        and the start of the next assistant message. `after_eos`: the policy ended its turn
        with the end-of-turn token itself (`ends_turn`), so the frame must not repeat it.
        A list is several messages in `role` (a tool result per call), rendered as the template
        renders consecutive messages of that role, or as one message, a line each, where the
        template needs the roles to alternate (Mistral's and Gemma's user turns).
        `call_ids`: the id of the call each result answers (None: not known), written where the
        template names it (Mistral v0.3's [TOOL_RESULTS]); an unknown one stays the probe's."""
        messages = [observation] if isinstance(observation, str) else list(observation)
        if not messages:
            messages = [""]
        if self.template_type == "base":
            label = "User" if role == "user" else "Tool"
            return "".join(f"\n{label}: {m}" for m in messages) + "\nAssistant:"
        rendered = self.rendered_role(role)
        messages = _in_a_row(self.tokenizer, rendered, messages)
        pieces = _observation_frame(self.tokenizer, rendered, len(messages))
        if call_ids and rendered == "tool" and len(messages) == len(call_ids):
            pieces = _naming_calls(self.tokenizer, pieces, call_ids)
        before = pieces[0]
        end = self.end_of_turn
        if after_eos and end and before.startswith(end):
            before = before[len(end):]
        return before + "".join(m + piece for m, piece in zip(messages, pieces[1:]))

    def rendered_role(self, role: str) -> str:
        """The role observations meant for `role` are rendered in: `role` itself, or "user"
        when the template cannot render `role` (it raises, or drops the message)."""
        if self.template_type == "base" or role == "user" or _frame_or_none(self.tokenizer, role) is not None:
            return role
        return "user"

    def messages_for_template(self, messages: Sequence[dict]) -> list[dict]:
        """`messages` as this template renders them, the way `prompt_text` and `rendered_role`
        adapt a conversation: each observation in the role the template has for it (else user),
        observations in a row as one message, a line each, where the template cannot render them
        in a row (as `observation_text`), a system message it refuses opening the first user
        message, and an assistant message's `tool_calls` (arguments as objects) written into its
        content in the Hermes format `tools_text` asks for, where the template would drop them
        (Gemma, Phi-3, Qwen2); tool-call ids rewritten to nine alphanumerics where the template
        refuses others (Mistral v0.3), the same id for a call and its result."""
        out: list[dict] = []
        for role, run in groupby(messages, key=lambda m: m.get("role")):
            run = [dict(m) for m in run]
            if role in ("system", "user", "assistant"):
                out += run
                continue
            # observations in a row (a tool result per call): as observation_text renders them
            rendered = self.rendered_role(role)
            contents = [m.get("content") or "" for m in run]
            if self.template_type != "base":
                contents = _in_a_row(self.tokenizer, rendered, contents)
            if len(contents) < len(run):
                out.append(dict(run[0], role=rendered, content=contents[0]))
            else:
                out += [dict(m, role=rendered) for m in run]
        if any(m.get("tool_calls") for m in out) and not renders_tool_calls(self.tokenizer):
            out = [_calls_as_text(m) if m.get("tool_calls") else m for m in out]
        if any(m.get("tool_calls") or m.get("role") == "tool" for m in out) and wants_nine_char_ids(self.tokenizer):
            out = _with_nine_char_ids(out)
        if out and out[0].get("role") == "system" and not _renders_system(self.tokenizer):
            system, out = out[0], out[1:]
            first = next((m for m in out if m.get("role") == "user"), None)
            if first is None:
                out.insert(0, {"role": "user", "content": system.get("content", "")})
            else:
                first["content"] = f"{system.get('content', '')}\n\n{first.get('content', '')}"
        return out

    @property
    def end_of_turn(self) -> str | None:
        """The special token the template closes an assistant message with (e.g. <|im_end|>,
        <|eot_id|>, <end_of_turn>, <|end|>, </s>); None when none does (then the tokenizer's
        eos is taken for it)."""
        if self.template_type == "base":
            return self.eos_token
        return _end_of_turn(self.tokenizer)[0] or self.eos_token

    @property
    def end_of_turn_id(self) -> int | None:
        if self.template_type == "base":
            return self.eos_id
        token, token_id = _end_of_turn(self.tokenizer)
        return token_id if token is not None else self.eos_id

    def observation_ids(self, observation: str | Sequence[str], role: str, after_eos: bool = False,
                        call_ids: Sequence[str | None] | None = None) -> list[int]:
        return self.encode(self.observation_text(observation, role, after_eos, call_ids))

    @property
    def eos_token(self) -> str | None:
        return getattr(self.tokenizer, "eos_token", None)

    @property
    def eos_id(self) -> int | None:
        return getattr(self.tokenizer, "eos_token_id", None)

    def ends_turn(self, ids: Sequence[int]) -> bool:
        """True when a policy turn's ids end with the end-of-turn token (`end_of_turn_id`)."""
        end = self.end_of_turn_id
        return bool(ids) and end is not None and ids[-1] == end

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


# What each tokenizer's template does, probed once per tokenizer. Weakly keyed by the tokenizer
# itself: a cache keyed by id() handed a dead tokenizer's answers to a new one at the same address.
_PROBES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _probed(tokenizer, key: tuple, probe: Callable[[], Any]) -> Any:
    try:
        answers = _PROBES.setdefault(tokenizer, {})
    except TypeError:   # an object without weak references: probe every time
        return probe()
    if key not in answers:
        answers[key] = probe()
    return answers[key]


def is_byte_level(tokenizer) -> bool:
    """Whether the tokenizer writes its pieces in GPT-2's byte-level alphabet (a space as Ġ)."""
    def probe() -> bool:
        ids = tokenizer.encode(" a", add_special_tokens=False)
        return bool(ids) and str(tokenizer.convert_ids_to_tokens(ids[0])).startswith("\u0120")
    return _probed(tokenizer, ("byte_level",), probe)


def _obs_mark(k: int) -> str:
    return _OBS if k == 0 else f"\u2063OBSERVATION_MARK_{k}\u2063"


def _frame_or_none(tokenizer, role: str, count: int = 1) -> tuple[str, ...] | None:
    """The text around `count` consecutive observations in `role` (before the first, between
    them, after the last: count + 1 pieces), found by rendering a conversation with them and
    taking what surrounds them after the assistant message; None when the template raises on
    the role or drops a message."""
    return _probed(tokenizer, ("frame", role, count), lambda: _probe_frame(tokenizer, role, count))


def _probe_frame(tokenizer, role: str, count: int) -> tuple[str, ...] | None:
    marks = [_obs_mark(k) for k in range(count)]
    base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _ASSISTANT}]
    # a tool result answers a call: each its own id, so its place in the frame can be found
    answers = [{"tool_call_id": _probe_result_id(k)} if role == "tool" else {} for k in range(count)]
    with_obs = base + [{"role": role, "content": m, **a} for m, a in zip(marks, answers)]
    try:
        full = tokenizer.apply_chat_template(with_obs, tokenize=False, add_generation_prompt=True)
    except Exception:   # jinja2's TemplateError from raise_exception(...), or the template's own bug
        full = ""
    tail = full.split(_ASSISTANT, 1)[1] if _ASSISTANT in full else ""
    pieces: list[str] = []
    for m in marks:
        if m not in tail:
            return None
        piece, tail = tail.split(m, 1)
        pieces.append(piece)
    return tuple(pieces) + (tail,) if pieces else None


def _naming_calls(tokenizer, pieces: tuple[str, ...], call_ids: Sequence[str | None]) -> tuple[str, ...]:
    """The frame's pieces with each probed result's id replaced by the id of the call it answers
    (as nine alphanumerics where the template takes no other, as `messages_for_template` writes it)."""
    nine = wants_nine_char_ids(tokenizer)
    names = {_probe_result_id(k): nine_char_id(str(c)) if nine else str(c) for k, c in enumerate(call_ids) if c}
    if not names:
        return pieces
    probed = re.compile("|".join(map(re.escape, names)))   # in one pass: a call's id may look like a probe's
    return tuple(probed.sub(lambda m: names[m.group(0)], piece) for piece in pieces)


def _in_a_row(tokenizer, role: str, contents: list[str]) -> list[str]:
    """Observations meant to follow each other in `role`: as they are, or one message, a line
    each, where the template cannot render them in a row (it needs the roles to alternate)."""
    if len(contents) > 1 and _frame_or_none(tokenizer, role, len(contents)) is None:
        return ["\n".join(contents)]
    return contents


def _observation_frame(tokenizer, role: str, count: int = 1) -> tuple[str, ...]:
    frame = _frame_or_none(tokenizer, role, count)
    if frame is None:
        raise ValueError(f"the chat template does not render {count} {role!r} message(s) after an assistant message; "
                         "set model.template_type: base or use a template with that role")
    return frame


def renders_tools(tokenizer) -> bool:
    """Whether the chat template renders `tools=` (their schemas show up in the prompt)."""
    def probe() -> bool:
        tool = {"type": "function", "function": {"name": "turnrl_probe_tool", "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": "q"}], tools=[tool], tokenize=False,
                                                 add_generation_prompt=True)
        except Exception:
            return False
        return "turnrl_probe_tool" in text
    return _probed(tokenizer, ("tools",), probe)


def tools_text(tools: Sequence[dict]) -> str:
    """The tools described in plain text, for a template that does not render `tools=`: the
    schemas in a <tools> block and how to call one (the Hermes / Qwen format, `hermes` parser)."""
    import json
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (f"# Tools\n<tools>\n{lines}\n</tools>\n"
            'Call a tool as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.')


def renders_tool_calls(tokenizer) -> bool:
    """Whether the chat template writes an assistant message's `tool_calls` (their names show up)."""
    def probe() -> bool:
        try:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [_probe_call()]}],
                tokenize=False)
        except Exception:
            return False
        return "turnrl_probe_tool" in text
    return _probed(tokenizer, ("tool_calls",), probe)


def _calls_as_text(message: dict) -> dict:
    """An assistant message whose tool calls are written after its content, one
    <tool_call>{"name": ..., "arguments": {...}}</tool_call> each, as a model taught by
    `tools_text` writes them (and the `hermes` parser reads them)."""
    import json
    calls = [json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]}, ensure_ascii=False)
             for c in message["tool_calls"]]
    calls = [f"<tool_call>\n{call}\n</tool_call>" for call in calls]
    text = "\n".join(filter(None, [message.get("content") or "", *calls]))
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": text}


def wants_nine_char_ids(tokenizer) -> bool:
    """Whether the template renders a call and its result with a nine-alphanumeric id but
    refuses another id (Mistral v0.3's raises "Tool call IDs should be alphanumeric strings
    with length 9!")."""
    def renders(call_id: str) -> bool:
        try:
            tokenizer.apply_chat_template([{"role": "user", "content": "q"},
                                           {"role": "assistant", "content": "", "tool_calls": [_probe_call(call_id)]},
                                           {"role": "tool", "tool_call_id": call_id, "content": "r"}], tokenize=False)
        except Exception:
            return False
        return True
    return _probed(tokenizer, ("call_ids",), lambda: renders(_PROBE_CALL_ID) and not renders("call_turnrl_probe"))


_NINE_ALNUM = re.compile(r"[A-Za-z0-9]{9}")
_ALNUM = string.ascii_letters + string.digits


def nine_char_id(call_id: str) -> str:
    """`call_id` as nine alphanumerics: itself if it is, else a digest of it (the same id gives
    the same digest in every render, so a conversation's prefix renders alike call after call)."""
    if _NINE_ALNUM.fullmatch(call_id):
        return call_id
    return "".join(_ALNUM[b % len(_ALNUM)] for b in hashlib.sha256(call_id.encode()).digest()[:9])


def _with_nine_char_ids(messages: list[dict]) -> list[dict]:
    """Every call's id and every result's `tool_call_id` as nine alphanumerics (`nine_char_id`)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = dict(m, tool_calls=[dict(c, id=nine_char_id(str(c.get("id")))) for c in m["tool_calls"]])
        elif m.get("role") == "tool":
            m = dict(m, tool_call_id=nine_char_id(str(m.get("tool_call_id"))))
        out.append(m)
    return out


def _renders_system(tokenizer) -> bool:
    """Whether the template takes a system message (Gemma 2's raises)."""
    def probe() -> bool:
        try:
            text = tokenizer.apply_chat_template([{"role": "system", "content": _OBS}, {"role": "user", "content": "q"}],
                                                 tokenize=False, add_generation_prompt=True)
        except Exception:
            return False
        return _OBS in text
    return _probed(tokenizer, ("system",), probe)


def _end_of_turn(tokenizer) -> tuple[str | None, int | None]:
    """The special token the template writes right after an assistant message's content."""
    def probe() -> tuple[str | None, int | None]:
        frame = _frame_or_none(tokenizer, "user", 1)
        closing = frame[0] if frame is not None else ""
        specials = set(getattr(tokenizer, "all_special_tokens", [])) | set(getattr(tokenizer, "added_tokens_encoder", {}))
        token = next((t for t in sorted(specials, key=len, reverse=True) if t and closing.startswith(t)), None)
        return token, tokenizer.convert_tokens_to_ids(token) if token is not None else None
    return _probed(tokenizer, ("end",), probe)
