"""On-policy distillation's teacher (`reward.teacher`): the logprob a teacher model gives each
token the policy sampled, in the trajectory's full multi-turn context (its prompt, the policy's
turns and the environment's observations, as the policy saw them), read from vLLM's OpenAI
completions API with `prompt_logprobs` (the prompt sent as token ids, so nothing is re-rendered).

    Teacher(cfg).annotate(trajs)     # t.teacher_logprobs: one per response token, 0.0 where the
                                     # policy did not sample (observations); with cfg.top_k also
                                     # t.teacher_top_ids / teacher_top_logprobs: k per token

`algorithm.name: opd` trains on them (turnrl.algos.builtin: the per-token reverse KL, top-1).
Calls run concurrently, at most `max_concurrency` in flight, with the retries of
turnrl.rewards.endpoint. A trajectory the teacher still gives no logprobs for is counted like an
environment error (never a silent zero): it ends `env_error` with the reason in
`info["env_error"]`, nothing of it is trained on (its loss mask is cleared), and more than
`env.max_error_fraction` of a step's trajectories so ended stops the run naming the teacher. The
teacher shares the policy's tokenizer (the ids are sent as they are), or `reward.teacher.tokenizer`
names its own and the ids go through their text (turnrl.rewards.token_mapping).
"""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Sequence

from turnrl.rewards import endpoint
from turnrl.rewards.token_mapping import Plan, TextMapping


MAPPING_INFO = "teacher_mapping"   # a trajectory's info: its sampled tokens' Plan.counts, when mapped


class Teacher:
    def __init__(self, cfg: Any, student_tokenizer: Any = None, chat_format: Any = None):
        """`cfg`: the checked `reward.teacher` params (turnrl.config TeacherCfg), its base_url set;
        `student_tokenizer`: the policy's, needed when `cfg.tokenizer` names the teacher's own;
        `chat_format`: tokenizer -> its ChatFormat (turnrl.rollout.chat), for the mapping's ends
        of turn and roles (TextMapping)."""
        self.cfg = cfg
        self.session = endpoint.Session.for_server(cfg, "reward.teacher")
        self.mapping = None
        if cfg.tokenizer:
            if student_tokenizer is None:
                raise ValueError("reward.teacher.tokenizer: mapping to the teacher's tokens needs the policy's tokenizer")
            from transformers import AutoTokenizer
            self.mapping = TextMapping(student_tokenizer, AutoTokenizer.from_pretrained(cfg.tokenizer), chat_format)

    def annotate(self, trajs: Sequence[Any]) -> None:
        """Set `teacher_logprobs` on every trajectory (and on each sample of an agent's episode);
        a trajectory with a row the teacher gave none for ends env_error, untrained (module doc)."""
        owned = [(t, s) for t in trajs for s in (t.samples or [t]) if s.response_ids]
        plans = [self._plan(row) for _, row in owned]   # a str: why a row has none
        sent = {k: plan.teacher_ids if plan else row.prompt_ids + row.response_ids
                for k, ((_, row), plan) in enumerate(zip(owned, plans)) if not isinstance(plan, str)}
        answers = dict(zip(sent, self._ask_all(list(sent.values()))))
        failed: dict[int, str] = {}
        for k, ((t, row), plan) in enumerate(zip(owned, plans)):
            answer, error = answers.get(k, (None, plan))
            if answer is None:
                failed.setdefault(id(t), f"reward.teacher ({self.cfg.model} at {self.cfg.base_url}) gave no logprobs "
                                         f"for the trajectory of prompt {row.example.get('id', '?')!r}: {error}")
                continue
            logprobs, top = answer
            start = len(row.prompt_ids)
            if isinstance(plan, Plan):   # the teacher's tokens, mapped back to the policy's
                mapped = TextMapping.to_student(plan, logprobs, [0.0] * start + list(row.engine_logprobs))
                response = [mapped.get(start + i, 0.0) for i in range(len(row.response_ids))]
                counts = t.info.setdefault(MAPPING_INFO, {"tokens": 0, "exact": 0, "unreadable": 0})
                for key, n in plan.counts().items():
                    counts[key] += n
            else:
                response = logprobs[start:]
            row.teacher_logprobs = [lp if m else 0.0 for lp, m in zip(response, row.loss_mask)]
            if top is not None:   # top_k (the policy's own tokenizer: config refuses it with a mapping)
                row.teacher_top_ids = [ids if m else [] for (ids, _), m in zip(top[start:], row.loss_mask)]
                row.teacher_top_logprobs = [lps if m else [] for (_, lps), m in zip(top[start:], row.loss_mask)]
        for t in trajs:
            if id(t) in failed:
                _untrained(t, failed[id(t)])

    def _plan(self, row: Any) -> Plan | str | None:
        """The row's mapping to the teacher's tokens (None: the ids go as they are), or why it has none."""
        if self.mapping is None:
            return None
        ids, sampled = row.prompt_ids + row.response_ids, [0] * len(row.prompt_ids) + list(row.loss_mask)
        try:
            if self.cfg.chat_template == "teacher":
                if not row.messages:
                    return ("reward.teacher.chat_template = teacher needs the conversation's messages, which this "
                            "trajectory does not keep (an agent program's calls sent none?); set it to policy")
                return self.mapping.plan_rendered(ids, sampled, row.messages, row.tools)
            return self.mapping.plan(ids, sampled)
        except Exception as exc:   # noqa: BLE001 - a template's own error too: this trajectory's, said
            return f"its tokens could not be mapped to the teacher's ({exc})"

    def _ask_all(self, sequences: list[list[int]]) -> list[tuple[tuple | None, str]]:
        async def ask_all(client, limit):
            return list(await asyncio.gather(*(self._ask(client, limit, ids) for ids in sequences)))
        return self.session.call(ask_all)

    async def _ask(self, client, limit: asyncio.Semaphore, ids: list[int]) -> tuple[tuple | None, str]:
        """((the logprob of each of `ids`, each position's top_k or None), "") or (None, why not)."""
        url = self.cfg.base_url.rstrip("/") + "/completions"
        body = {"model": self.cfg.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": self.cfg.top_k}
        reply = await endpoint.post(client, limit, url, body, retries=self.cfg.retries, timeout_s=self.cfg.timeout_s)
        if reply.body is None:
            return None, reply.error
        try:
            top = top_logprobs(reply.body, self.cfg.top_k) if self.cfg.top_k else None
            return (prompt_logprobs(reply.body, ids), top), ""
        except ValueError as exc:
            return None, str(exc)


def teacher_metrics(trajs: Sequence[Any]) -> dict[str, float]:
    """Over a batch's sampled tokens the teacher scored: `teacher_reverse_kl`, the mean of
    log pi(token) - log pi_T(token) (the sampled-token estimate of KL(policy || teacher), what
    distillation drives down); and, for a teacher of another tokenizer (reward.teacher.tokenizer),
    `teacher_exact_frac` (their chunk is one token each side: the teacher's own logprob) and
    `teacher_unreadable_frac` (a special token the teacher has no counterpart of, or bytes that
    are no UTF-8: no signal). Empty when no teacher scored anything."""
    gaps = [engine - teacher for t in trajs if t.finish != "env_error" for row in (t.samples or [t])
            if row.teacher_logprobs
            for engine, teacher, m in zip(row.engine_logprobs, row.teacher_logprobs, row.loss_mask) if m]
    out = {"teacher_reverse_kl": sum(gaps) / len(gaps)} if gaps else {}
    counts = [t.info[MAPPING_INFO] for t in trajs if MAPPING_INFO in (t.info or {})]
    tokens = sum(c["tokens"] for c in counts)
    if tokens:
        out.update(teacher_exact_frac=sum(c["exact"] for c in counts) / tokens,
                   teacher_unreadable_frac=sum(c["unreadable"] for c in counts) / tokens)
    return out


def _untrained(t: Any, reason: str) -> None:
    """`t` (a turnrl.rollout Trajectory) ended as an environment error for `reason`: counted, and
    none of it trained on (the trajectory's own `end_untrained`; rewards sit below the rollout)."""
    t.end_untrained(reason)
    for row in t.samples or [t]:
        row.teacher_logprobs = [0.0] * len(row.response_ids)
        row.teacher_top_ids, row.teacher_top_logprobs = [], []


def prompt_logprobs(body: dict, ids: Sequence[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for every i from a vLLM completions answer with prompt_logprobs
    (entry 0: 0.0); ValueError saying what is missing."""
    try:
        entries = body["choices"][0]["prompt_logprobs"]
    except (KeyError, IndexError, TypeError):
        entries = None
    if not isinstance(entries, list) or len(entries) != len(ids):
        raise ValueError("the answer has no prompt_logprobs for every token (a vLLM server's /v1/completions with "
                         f"prompt_logprobs is needed); got {str(body)[:200]}")
    out = [0.0]
    for position, (token, entry) in enumerate(zip(ids[1:], entries[1:]), start=1):
        found = (entry or {}).get(str(token))
        if not isinstance(found, dict) or not isinstance(found.get("logprob"), (int, float)):
            raise ValueError(f"no logprob for token {token} at position {position} in the teacher's answer")
        out.append(float(found["logprob"]))
    return out


def top_logprobs(body: dict, k: int) -> list[tuple[list[int], list[float]]]:
    """Each position's k most likely tokens (ids, logprobs; most likely first) from a completions
    answer with prompt_logprobs k, whose entries hold the top k and the prompt's own token
    (entry 0: ([], [])); ValueError where a position has fewer (a server started with a lower
    --max-logprobs)."""
    entries = body["choices"][0]["prompt_logprobs"]   # prompt_logprobs has checked the shape
    out: list[tuple[list[int], list[float]]] = [([], [])]
    for position, entry in enumerate(entries[1:], start=1):
        ranked = sorted(((-float(v["logprob"]), int(token)) for token, v in (entry or {}).items()
                         if isinstance(v, dict) and isinstance(v.get("logprob"), (int, float))))[:k]
        if len(ranked) < k:
            raise ValueError(f"reward.teacher.top_k = {k}: the teacher's answer has {len(ranked)} tokens at position "
                             f"{position} (start its vLLM server with --max-logprobs {k} or more)")
        out.append(([token for _, token in ranked], [-neg for neg, _ in ranked]))
    return out


def check_tokenizer(cfg: Any, student_dir: str) -> str | None:
    """Before any work: why the `reward.teacher` params (TeacherCfg) cannot score the policy of
    `student_dir`'s tokens, or None. A served checkpoint of another tokenizer needs `tokenizer`;
    a `tokenizer` given must load, and be fast (token_mapping reads its offsets), and with
    `chat_template: teacher` have a chat template that renders a conversation."""
    if cfg.tokenizer:
        from transformers import AutoTokenizer
        try:
            teacher = AutoTokenizer.from_pretrained(cfg.tokenizer)
        except (OSError, ValueError) as exc:
            return f"reward.teacher.tokenizer = {cfg.tokenizer}: it does not load as a tokenizer ({exc})"
        if not teacher.is_fast:
            return (f"reward.teacher.tokenizer = {cfg.tokenizer}: a slow (Python) tokenizer; the mapping reads a fast "
                    "(Rust) one's character offsets")
        if cfg.chat_template == "teacher":
            try:
                teacher.apply_chat_template(PROBE, tokenize=False)
            except Exception as exc:   # noqa: BLE001 - no template, or a template's own error
                return (f"reward.teacher.chat_template = teacher: the tokenizer {cfg.tokenizer} cannot render a user "
                        f"and an assistant message with its chat template ({exc}); set chat_template to policy")
        return None
    if cfg.serve and Path(cfg.serve).is_dir():
        return tokenizer_mismatch(cfg.serve, student_dir)
    return None


# A conversation whose rendering has the chat template's markup, numbers and words
PROBE = [{"role": "user", "content": "Probe: what is 12 + 30? Reply in <answer></answer>, please."},
         {"role": "assistant", "content": "12 + 30 = 42, so <answer>42</answer>"}]


def check_server_tokenizer(cfg: Any, student_dir: str) -> tuple[str | None, str | None]:
    """Once the teacher answers, before any step: (why it cannot score the policy's token ids, or
    None; a note when that cannot be checked, or None). The policy's rendering of PROBE is sent to
    the server's /tokenize (vLLM's); other ids than the policy's mean another tokenizer. With
    `cfg.tokenizer` (the text mapping) nothing needs checking."""
    if cfg.tokenizer or not cfg.base_url:
        return None, None
    import httpx
    from transformers import AutoTokenizer
    student = AutoTokenizer.from_pretrained(student_dir)
    try:
        text = student.apply_chat_template(PROBE, tokenize=False)
    except (ValueError, TypeError):   # no chat template: the words alone
        text = "\n".join(m["content"] for m in PROBE)
    ids = student(text, add_special_tokens=False)["input_ids"]
    root = cfg.base_url.rstrip("/").removesuffix("/v1")
    headers = endpoint.Session.for_server(cfg, "reward.teacher").headers
    try:
        reply = httpx.post(f"{root}/tokenize", json={"model": cfg.model, "prompt": text, "add_special_tokens": False},
                           headers=headers, timeout=min(cfg.timeout_s, 30.0))
        theirs = reply.json().get("tokens") if reply.status_code == 200 else None
    except (httpx.HTTPError, ValueError) as exc:
        theirs, reply = None, exc
    if not isinstance(theirs, list):
        return None, (f"reward.teacher at {cfg.base_url}: its tokenizer could not be checked ({root}/tokenize "
                      f"answered {getattr(reply, 'status_code', reply)}); it must share the policy's, or set "
                      "reward.teacher.tokenizer")
    if theirs == ids:
        return None, None
    differ = next((k for k, (a, b) in enumerate(zip(ids, theirs)) if a != b), min(len(ids), len(theirs)))
    return (f"reward.teacher at {cfg.base_url} tokenizes differently from the policy ({student_dir}): a probe "
            f"conversation is {len(theirs)} tokens there and {len(ids)} here, first differing at token {differ}; "
            "the teacher scores the policy's token ids as they are, so set reward.teacher.tokenizer to the "
            "teacher's tokenizer (its text mapping), or pick a teacher of the policy's tokenizer"), None


def tokenizer_mismatch(teacher_dir: str, student_dir: str) -> str | None:
    """Why the teacher's tokenizer (a local folder) cannot score the student's token ids, or None
    when both map every token to the same id."""
    from transformers import AutoTokenizer
    teacher, student = (AutoTokenizer.from_pretrained(d).get_vocab() for d in (teacher_dir, student_dir))
    if teacher == student:
        return None
    differ = sorted(t for t in set(teacher) | set(student) if teacher.get(t) != student.get(t))
    return (f"reward.teacher.serve = {teacher_dir}: its tokenizer differs from the policy's ({student_dir}) on "
            f"{len(differ)} tokens (e.g. {differ[:3]}); the teacher scores the policy's token ids as they are, so "
            "it must share the tokenizer: pick a teacher of the policy's family, or set "
            f"reward.teacher.tokenizer={teacher_dir} to map the policy's tokens to its own through their text")
