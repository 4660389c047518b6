"""On-policy distillation's teacher (`reward.teacher`): the logprob a teacher model gives each
token the policy sampled, in the trajectory's full multi-turn context (its prompt, the policy's
turns and the environment's observations, as the policy saw them), read from vLLM's OpenAI
completions API with `prompt_logprobs` (the prompt sent as token ids, so nothing is re-rendered).

    Teacher(cfg).annotate(trajs)     # t.teacher_logprobs: one per response token, 0.0 where the
                                     # policy did not sample (observations)

`algorithm.name: opd` trains on them (turnrl.algos.builtin: the per-token reverse KL, top-1).
Calls run concurrently, at most `max_concurrency` in flight, with the retries of
turnrl.rewards.endpoint; a trajectory the teacher gives no logprobs for raises a TeacherError
naming the teacher and the reason (never a silent zero). The teacher must share the policy's
tokenizer (the ids are sent as they are).
"""
from __future__ import annotations

import asyncio
import os
from typing import Any, Sequence

from turnrl.rewards import endpoint


class TeacherError(RuntimeError):
    """The teacher gave no logprobs for a trajectory (down, timed out, not a vLLM answer)."""


class Teacher:
    def __init__(self, cfg: Any):
        """`cfg`: the checked `reward.teacher` params (turnrl.config TeacherCfg), its base_url set."""
        self.cfg = cfg
        self.api_key = os.environ.get(cfg.api_key_env, "") if cfg.api_key_env else ""

    def annotate(self, trajs: Sequence[Any]) -> None:
        """Set `teacher_logprobs` on every trajectory (and on each sample of an agent's episode)."""
        rows = [s for t in trajs for s in (t.samples or [t]) if s.response_ids]
        results = endpoint.run(self._ask_all([s.prompt_ids + s.response_ids for s in rows]))
        for row, (logprobs, error) in zip(rows, results):
            if logprobs is None:
                raise TeacherError(f"reward.teacher ({self.cfg.model} at {self.cfg.base_url}) gave no logprobs for the "
                                   f"trajectory of prompt {row.example.get('id', '?')!r}: {error}")
            response = logprobs[len(row.prompt_ids):]
            row.teacher_logprobs = [lp if m else 0.0 for lp, m in zip(response, row.loss_mask)]

    async def _ask_all(self, sequences: list[list[int]]) -> list[tuple[list[float] | None, str]]:
        import httpx
        limit = asyncio.Semaphore(self.cfg.max_concurrency)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        async with httpx.AsyncClient(timeout=self.cfg.timeout_s, headers=headers) as client:
            return list(await asyncio.gather(*(self._ask(client, limit, ids) for ids in sequences)))

    async def _ask(self, client, limit: asyncio.Semaphore, ids: list[int]) -> tuple[list[float] | None, str]:
        url = self.cfg.base_url.rstrip("/") + "/completions"
        body = {"model": self.cfg.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
        reply = await endpoint.post(client, limit, url, body, retries=self.cfg.retries, timeout_s=self.cfg.timeout_s)
        if reply.body is None:
            return None, reply.error
        try:
            return prompt_logprobs(reply.body, ids), ""
        except ValueError as exc:
            return None, str(exc)


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
            "it must share the tokenizer: pick a teacher of the policy's family")
