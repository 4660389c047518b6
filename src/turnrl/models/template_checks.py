"""The chat template's checks, which need no model: the generation prompt, the system, tool and
user roles, the end-of-turn token and the stop ids (`template_checks`), and a two-turn
conversation assembled token by token as the rollout loop does, against the template's
rendering of the same messages (`trajectory_check`)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from turnrl.models.check_report import Result
from turnrl.errors import one_line

MARK_A = "\u2063MARKA\u2063"   # placeholders no tokenizer merges with their neighbours
MARK_B = "\u2063MARKB\u2063"


def _render(tokenizer, messages: list[dict], **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def _template_error(exc: Exception) -> str:
    return one_line(exc, 200)


def template_checks(tokenizer) -> tuple[list[Result], dict]:
    """The chat template's static checks: generation prompt, system role, observation roles,
    end-of-turn token. Returns the results and what they found (for the later checks)."""
    from turnrl.rollout.chat import ChatFormat, renders_tool_calls, renders_tools, wants_nine_char_ids
    found: dict[str, Any] = {}
    out: list[Result] = []
    if not getattr(tokenizer, "chat_template", None):
        out.append(Result("template", "FAIL", "the tokenizer has no chat template",
                          "add a chat_template to tokenizer_config.json (or chat_template.jinja), or train the base "
                          "model with model.template_type: base (plain 'User:/Assistant:' text)"))
        return out, found
    header, failure = _generation_prompt_header(tokenizer)
    if failure is not None:
        out.append(failure)
        return out, found
    details = ["generation prompt opens the assistant turn" + (f" (leaves {header!r} to the model)" if header else "")]
    fmt = ChatFormat(tokenizer)
    status, notes = _system_role(tokenizer, found, details)
    found["prompt_header"] = header
    failure = _observation_roles(tokenizer, fmt, found)
    if failure is not None:
        out.append(failure)
        return out, found
    tool_role = fmt.rendered_role("tool")
    found["tool_rendered_as"] = tool_role
    if tool_role == "tool":
        details.append("tool observations in the tool role")
    else:
        details.append("no tool role: tool observations go as user messages")
        status = "WARN"
        notes.append("tool results (code_tool, search) reach the model as user messages")
    # informational: how an agent's or a conversation file's tools and calls reach this template
    details.append("tools= rendered" if renders_tools(tokenizer) else "no tools=: tools described in the system text")
    details.append("tool_calls rendered" if renders_tool_calls(tokenizer) else
                   "no tool_calls: calls written into the content as <tool_call>{...}</tool_call> (hermes)")
    if wants_nine_char_ids(tokenizer):
        details.append("call ids of nine alphanumerics only: other ids rendered as a nine-character digest")
    out.append(Result("template", status, "; ".join(details),
                      "" if status == "OK" else "nothing to do if this is how the model was trained (" +
                      "; ".join(notes) + "); otherwise give the template those roles"))
    out.append(_end_of_turn_check(tokenizer, found))
    return out, found


_USER = [{"role": "user", "content": "q"}]


def _generation_prompt_header(tokenizer) -> tuple[str | None, Result | None]:
    """The prompt for an assistant turn must be everything the template puts before an assistant
    message's content: (what the generation prompt leaves to the model, None), or (None, the
    failure)."""
    try:
        prompt = _render(tokenizer, _USER, add_generation_prompt=True)
        no_prompt = _render(tokenizer, _USER, add_generation_prompt=False)
        with_answer = _render(tokenizer, _USER + [{"role": "assistant", "content": MARK_A}])
    except Exception as exc:
        return None, Result("template", "FAIL", f"the chat template fails on a user/assistant conversation "
                            f"({_template_error(exc)})", "fix the template: it must render user and assistant messages")
    if MARK_A not in with_answer:
        return None, Result("template", "FAIL", "the chat template drops assistant messages",
                            "fix the template: it must render assistant messages")
    before_answer = with_answer.split(MARK_A, 1)[0]
    if not before_answer.startswith(prompt):
        return None, Result("template", "FAIL",
                            f"the prompt with add_generation_prompt=True ({_tail(prompt)}) is not how the template "
                            f"starts an assistant message ({_tail(before_answer)})",
                            "fix the template's add_generation_prompt branch: it must emit the assistant header")
    header = before_answer[len(prompt):]
    if prompt == no_prompt and before_answer != prompt and header.strip():
        return None, Result("template", "FAIL",
                            f"add_generation_prompt adds nothing, and the model would have to write the assistant "
                            f"header {header!r} itself", "add an `{% if add_generation_prompt %}` branch to the "
                            f"chat template that emits {header!r}")
    if header.strip():
        return None, Result("template", "FAIL",
                            f"the generation prompt stops short of the assistant header: {header!r} is missing",
                            f"make the add_generation_prompt branch emit {header!r}")
    return header, None


def _system_role(tokenizer, found: dict, details: list[str]) -> tuple[str, list[str]]:
    """Whether the template renders a system message (appended to `details`): ("OK", []), or
    ("WARN", [what turnrl does instead])."""
    try:
        text = _render(tokenizer, [{"role": "system", "content": MARK_B}] + _USER, add_generation_prompt=True)
        if MARK_B not in text:
            raise ValueError("the system message is dropped")
        details.append("system role rendered")
        return "OK", []
    except Exception as exc:
        found["system_error"] = _template_error(exc)
        details.append(f"system role refused ({_template_error(exc)}): the system prompt opens the first user "
                       "message instead")
        return "WARN", ["the system prompt goes into the first user message"]


def _observation_roles(tokenizer, fmt, found: dict) -> Result | None:
    """The observation frames of the tool and user roles (into found["roles"]); the failure when
    the template cannot render a user message after an assistant one."""
    roles = {}
    for role in ("tool", "user"):
        try:
            roles[role] = fmt.observation_text(MARK_B, role)
        except Exception as exc:
            roles[role] = None
            found[f"{role}_error"] = _template_error(exc)
    found["roles"] = roles
    if roles["user"] is not None:
        return None
    try:
        _render(tokenizer, _USER + [{"role": "assistant", "content": "a"}, {"role": "user", "content": MARK_B}],
                add_generation_prompt=True)
        why = "the message is dropped"
    except Exception as exc:
        why = _template_error(exc)
    return Result("template", "FAIL", "the template cannot render a user message after an assistant message "
                  f"({why}): multi-turn conversations are impossible",
                  "fix the chat template (it must render user / assistant / user ...), or train with "
                  "model.template_type: base")


def _end_of_turn_check(tokenizer, found: dict) -> Result:
    """The token that closes an assistant message, and whether generation stops on it."""
    closing = _closing_text(tokenizer)
    found["closing"] = closing
    eot_id, eot = _end_of_turn(tokenizer, closing)
    found["end_of_turn_id"], found["end_of_turn"] = eot_id, eot
    stops = stop_ids(tokenizer)
    found["stop_ids"] = sorted(stops)
    if eot_id is None:
        return Result("end_of_turn", "FAIL",
                      f"an assistant message is closed by {closing!r}, which does not start with a special "
                      "token: nothing tells the model its turn is over",
                      "give the template an end-of-turn token (a special token such as <|im_end|>) after "
                      "assistant messages")
    if eot_id not in stops:
        names = [tokenizer.convert_ids_to_tokens(i) for i in sorted(stops)]
        return Result("end_of_turn", "FAIL",
                      f"assistant turns end with {eot!r} (id {eot_id}), but generation stops only on {names}: "
                      "vLLM and transformers would go on past the end of the turn",
                      f"add {eot_id} to eos_token_id in generation_config.json (or set the tokenizer's "
                      f"eos_token to {eot!r})")
    extra = "" if eot_id == tokenizer.eos_token_id else f" (not the tokenizer's eos {tokenizer.eos_token!r})"
    return Result("end_of_turn", "OK", f"assistant turns end with {eot!r}{extra}; generation stops on it")
def _tail(text: str, n: int = 40) -> str:
    return repr(text[-n:]) if len(text) > n else repr(text)


def _closing_text(tokenizer) -> str:
    """What the template writes right after an assistant message's content (up to the next
    message or the end)."""
    conv = [{"role": "user", "content": "q"}, {"role": "assistant", "content": MARK_A},
            {"role": "user", "content": MARK_B}]
    try:
        text = _render(tokenizer, conv, add_generation_prompt=True)
        return text.split(MARK_A, 1)[1].split(MARK_B, 1)[0]
    except Exception:
        text = _render(tokenizer, conv[:2])
        return text.split(MARK_A, 1)[1]


def _end_of_turn(tokenizer, closing: str) -> tuple[int | None, str | None]:
    """The special token `closing` starts with, if any."""
    specials = sorted(set(tokenizer.all_special_tokens) | set(getattr(tokenizer, "added_tokens_encoder", {})),
                      key=len, reverse=True)
    for token in specials:
        if token and closing.startswith(token):
            return tokenizer.convert_tokens_to_ids(token), token
    return None, None


def stop_ids(tokenizer_or_dir) -> set[int]:
    """Token ids generation stops on: the folder's generation_config.json eos_token_id and the
    tokenizer's eos (what vLLM and transformers' generate use)."""
    tokenizer = tokenizer_or_dir
    ids = set()
    folder = getattr(tokenizer, "name_or_path", None)
    if folder and (Path(folder) / "generation_config.json").exists():
        value = json.loads((Path(folder) / "generation_config.json").read_text()).get("eos_token_id")
        ids |= set(value if isinstance(value, list) else [value] if value is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


# --------------------------------------------------------------------------- trajectory check
class TwoTurnEnv:
    """Answers the first turn with an observation in `role`, ends after the second."""
    stop: tuple[str, ...] = ()

    def __init__(self, role: str, observation: str = "<output>42</output>",
                 system_prompt: str = "You are a careful assistant. Use the tool when it helps."):
        self.observation_role, self.observation, self.system_prompt = role, observation, system_prompt

    def reset(self, example: dict) -> str:
        self.turns = 0
        return example["prompt"]

    def step(self, text: str):
        from turnrl.envs.base import StepResult
        self.turns += 1
        done = self.turns >= 2
        return StepResult(None if done else self.observation, 0.0, done, {"reason": "answer"} if done else {})


def reference_messages(tokenizer, messages: list[dict]) -> list[dict]:
    """`messages` as the template takes them: a system message it refuses goes in front of the
    first user message, tool messages it cannot render go as user messages."""
    out = [dict(m) for m in messages]
    if out and out[0]["role"] == "system":
        try:
            _render(tokenizer, out[:2], add_generation_prompt=True)
        except Exception:
            system = out.pop(0)["content"]
            out[0]["content"] = system + "\n\n" + out[0]["content"]
    if any(m["role"] == "tool" for m in out):
        probe = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                 {"role": "tool", "content": MARK_B}]
        try:
            ok = MARK_B in _render(tokenizer, probe, add_generation_prompt=True)
        except Exception:
            ok = False
        if not ok:
            out = [dict(m, role="user") if m["role"] == "tool" else m for m in out]
    return out


def trajectory_check(tokenizer, turns: Sequence[str] = ("<code>print(6 * 7)</code>", "The answer is 42."),
                     prompt: str = "What is 6 times 7?") -> tuple[Result, dict]:
    """A two-turn conversation assembled by `replay` (token ids as the rollout loop builds them)
    against the chat template's rendering of the same messages, for a tool and a user
    observation: the context before each turn and the whole conversation."""
    from turnrl.rollout.chat import ChatFormat
    from turnrl.rollout.multi_turn import replay
    fmt = ChatFormat(tokenizer)
    problems, info = [], {}
    for role in ("tool", "user"):
        env = TwoTurnEnv(role)
        try:
            t = replay(env, fmt, {"prompt": prompt}, list(turns))
        except Exception as exc:
            problems.append(f"{role}: the rollout loop cannot assemble it ({_template_error(exc)})")
            continue
        decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)   # noqa: E731
        messages = [{"role": "system", "content": env.system_prompt}, {"role": "user", "content": prompt},
                    {"role": "assistant", "content": turns[0]}, {"role": role, "content": env.observation},
                    {"role": "assistant", "content": turns[1]}]
        ref = reference_messages(tokenizer, messages)
        ids = t.prompt_ids + t.response_ids
        second = len(t.prompt_ids) + next(i for i, k in enumerate(t.turn_ids) if k == 1) if 1 in t.turn_ids else None
        if second is None:
            problems.append(f"{role}: the trajectory has no second turn")
            continue
        # where each turn starts, the context must be what the template renders with a generation prompt
        answers = [i for i, msg in enumerate(ref) if msg["role"] == "assistant"]
        for label, got, want in (
                ("turn 1's prompt", decode(t.prompt_ids),
                 _render(tokenizer, ref[:answers[0]], add_generation_prompt=True)),
                ("turn 2's prompt", decode(ids[:second]),
                 _render(tokenizer, ref[:answers[1]], add_generation_prompt=True))):
            if got != want:
                problems.append(f"{role}: {label} differs from the template: {_diff(got, want)}")
        whole = decode(ids)
        rendered = _render(tokenizer, ref)
        if not rendered.startswith(whole):
            problems.append(f"{role}: the conversation differs from the template: {_diff(whole, rendered)}")
        else:
            rest = rendered[len(whole):]
            info[f"{role}_after_last_turn"] = rest
        closed = tokenizer.decode(t.response_ids[-1:], skip_special_tokens=False)
        info[f"{role}_last_token"] = closed
    if problems:
        return Result("trajectory", "FAIL", "; ".join(problems),
                      "the rollout loop's observation frame (turnrl.rollout.chat.ChatFormat) and this template "
                      "disagree: see which part differs"), info
    return Result("trajectory", "OK", "two-turn conversations (tool and user observations) decode exactly to the "
                                      "template's rendering, turn by turn"), info


def _diff(got: str, want: str) -> str:
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return f"at char {i}: assembled {got[max(0, i - 30):i + 30]!r}, template {want[max(0, i - 30):i + 30]!r}"

