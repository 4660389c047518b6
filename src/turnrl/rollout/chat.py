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
`turnrl.modelcheck`, the compatibility matrix):

- the token that ends an assistant turn is often not the tokenizer's eos (Gemma's
  `<end_of_turn>`, Phi-3's `<|end|>`, Llama 3's `<|eot_id|>` with eos `<|end_of_text|>`): it is read
  from the template (`end_of_turn`), and a turn the model ended with it is not closed twice;
- a template may refuse a system message (Gemma 2): the system prompt then opens the first user
  message, as the family's documentation advises (`prompt_text`);
- a template may not render a tool message (Mistral, Gemma: roles must alternate; Phi-3 drops
  it silently): tool observations then go as user messages (`rendered_role`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

_ASSISTANT = "\u2063ASSISTANT_MARK\u2063"
_OBS = "\u2063OBSERVATION_MARK\u2063"


@dataclass(frozen=True)
class ChatFormat:
    tokenizer: object
    template_type: str = "chat"

    def prompt_text(self, system: str, user: str) -> str:
        if self.template_type == "base":
            return f"{system}\n\nUser: {user}\nAssistant:"
        if not system:
            messages = [{"role": "user", "content": user}]
        elif _renders_system(self.tokenizer):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        else:   # the template refuses a system message: it opens the user message instead
            messages = [{"role": "user", "content": f"{system}\n\n{user}"}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def prompt_ids(self, system: str, user: str) -> list[int]:
        return self.encode(self.prompt_text(system, user))

    def observation_text(self, observation: str, role: str, after_eos: bool = False) -> str:
        """Text that follows a policy turn: end of the assistant message, the observation
        message in `role` (or in `rendered_role(role)`, when the template has no such role),
        and the start of the next assistant message. `after_eos`: the policy ended its turn
        with the end-of-turn token itself (`ends_turn`), so the frame must not repeat it."""
        if self.template_type == "base":
            label = "User" if role == "user" else "Tool"
            return f"\n{label}: {observation}\nAssistant:"
        before, after = _observation_frame(self.tokenizer, self.rendered_role(role))
        end = self.end_of_turn
        if after_eos and end and before.startswith(end):
            before = before[len(end):]
        return before + observation + after

    def rendered_role(self, role: str) -> str:
        """The role observations meant for `role` are rendered in: `role` itself, or "user"
        when the template cannot render `role` (it raises, or drops the message)."""
        if self.template_type == "base" or role == "user" or _frame_or_none(self.tokenizer, role) is not None:
            return role
        return "user"

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

    def observation_ids(self, observation: str, role: str, after_eos: bool = False) -> list[int]:
        return self.encode(self.observation_text(observation, role, after_eos))

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


_FRAMES: dict[tuple[int, str], tuple[str, str] | None] = {}
_SYSTEM: dict[int, bool] = {}
_END: dict[int, tuple[str | None, int | None]] = {}


def _frame_or_none(tokenizer, role: str) -> tuple[str, str] | None:
    """(text before, text after) an observation in `role`, found by rendering a conversation
    with one and taking what surrounds it after the assistant message; None when the template
    raises on the role or drops the message."""
    key = (id(tokenizer), role)
    if key not in _FRAMES:
        base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _ASSISTANT}]
        with_obs = base + [{"role": role, "content": _OBS}]
        try:
            full = tokenizer.apply_chat_template(with_obs, tokenize=False, add_generation_prompt=True)
        except Exception:   # jinja2's TemplateError from raise_exception(...), or the template's own bug
            full = ""
        if _ASSISTANT not in full or _OBS not in full:
            _FRAMES[key] = None
        else:
            tail = full.split(_ASSISTANT, 1)[1]
            before, after = tail.split(_OBS, 1)
            _FRAMES[key] = (before, after)
    return _FRAMES[key]


def _observation_frame(tokenizer, role: str) -> tuple[str, str]:
    frame = _frame_or_none(tokenizer, role)
    if frame is None:
        raise ValueError(f"the chat template does not render {role!r} messages after an assistant message; "
                         "set model.template_type: base or use a template with that role")
    return frame


def _renders_system(tokenizer) -> bool:
    """Whether the template takes a system message (Gemma 2's raises)."""
    key = id(tokenizer)
    if key not in _SYSTEM:
        try:
            text = tokenizer.apply_chat_template([{"role": "system", "content": _OBS}, {"role": "user", "content": "q"}],
                                                 tokenize=False, add_generation_prompt=True)
            _SYSTEM[key] = _OBS in text
        except Exception:
            _SYSTEM[key] = False
    return _SYSTEM[key]


def _end_of_turn(tokenizer) -> tuple[str | None, int | None]:
    """The special token the template writes right after an assistant message's content."""
    key = id(tokenizer)
    if key not in _END:
        frame = _frame_or_none(tokenizer, "user")
        closing = frame[0] if frame is not None else ""
        specials = set(getattr(tokenizer, "all_special_tokens", [])) | set(getattr(tokenizer, "added_tokens_encoder", {}))
        token = next((t for t in sorted(specials, key=len, reverse=True) if t and closing.startswith(t)), None)
        _END[key] = (token, tokenizer.convert_tokens_to_ids(token) if token is not None else None)
    return _END[key]
