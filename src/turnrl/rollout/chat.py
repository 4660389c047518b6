"""Token assembly for multi-turn conversations, token in and token out.

A trajectory is one growing list of token ids: the prompt (system + user message rendered by
the model's chat template, ending with the assistant generation prompt), then for each turn
the ids the policy sampled, exactly as sampled, then the observation block. The observation
block closes the assistant message, adds the environment's message in its role (tool or
user) and opens the next assistant message. It is rendered once from the chat template and
tokenized once; nothing already in the trajectory is ever decoded and re-encoded.

`template_type: base` (for base models, MuTIS's plain template) uses plain text instead of a
chat template.
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
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def prompt_ids(self, system: str, user: str) -> list[int]:
        return self.encode(self.prompt_text(system, user))

    def observation_text(self, observation: str, role: str, after_eos: bool = False) -> str:
        """Text that follows a policy turn: end of the assistant message, the observation
        message in `role`, and the start of the next assistant message. `after_eos`: the
        policy ended its turn with the end-of-turn token itself, so the frame must not
        repeat it."""
        if self.template_type == "base":
            label = "User" if role == "user" else "Tool"
            return f"\n{label}: {observation}\nAssistant:"
        before, after = _observation_frame(self.tokenizer, role)
        if after_eos and self.eos_token and before.startswith(self.eos_token):
            before = before[len(self.eos_token):]
        return before + observation + after

    def observation_ids(self, observation: str, role: str, after_eos: bool = False) -> list[int]:
        return self.encode(self.observation_text(observation, role, after_eos))

    @property
    def eos_token(self) -> str | None:
        return getattr(self.tokenizer, "eos_token", None)

    @property
    def eos_id(self) -> int | None:
        return getattr(self.tokenizer, "eos_token_id", None)

    def ends_turn(self, ids: Sequence[int]) -> bool:
        """True when a policy turn's ids end with the end-of-turn (eos) token."""
        return bool(ids) and self.eos_id is not None and ids[-1] == self.eos_id

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


_FRAMES: dict[tuple[int, str], tuple[str, str]] = {}


def _observation_frame(tokenizer, role: str) -> tuple[str, str]:
    """(text before, text after) an observation, found by rendering a conversation with and
    without one and taking the difference after the assistant message."""
    key = (id(tokenizer), role)
    if key not in _FRAMES:
        base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _ASSISTANT}]
        with_obs = base + [{"role": role, "content": _OBS}]
        full = tokenizer.apply_chat_template(with_obs, tokenize=False, add_generation_prompt=True)
        if _ASSISTANT not in full or _OBS not in full:
            raise ValueError(f"the chat template does not render {role!r} messages; "
                             "set model.template_type: base or use a template with that role")
        tail = full.split(_ASSISTANT, 1)[1]
        before, after = tail.split(_OBS, 1)
        _FRAMES[key] = (before, after)
    return _FRAMES[key]
