"""On-policy distillation's teacher (`reward.teacher`): the logprob a teacher model gives each
token the policy sampled, in the trajectory's full multi-turn context (its prompt, the policy's
turns and the environment's observations, as the policy saw them), read from vLLM's OpenAI
completions API with `prompt_logprobs` (the prompt sent as token ids, so nothing is re-rendered).

    Teacher(cfg).annotate(trajs)     # t.teacher_logprobs: one per response token, 0.0 where the
                                     # policy did not sample (observations)

`algorithm.name: opd` trains on them (turnrl.algos.builtin: the per-token reverse KL, top-1).
Calls run concurrently, at most `max_concurrency` in flight, with the retries of
turnrl.rewards.endpoint. A trajectory the teacher still gives no logprobs for is counted like an
environment error (never a silent zero): it ends `env_error` with the reason in
`info["env_error"]`, nothing of it is trained on (its loss mask is cleared), and more than
`env.max_error_fraction` of a step's trajectories so ended stops the run naming the teacher. The
teacher must share the policy's tokenizer (the ids are sent as they are).
"""
from __future__ import annotations

import asyncio
from typing import Any, Sequence

from turnrl.rewards import endpoint


class Teacher:
    def __init__(self, cfg: Any):
        """`cfg`: the checked `reward.teacher` params (turnrl.config TeacherCfg), its base_url set."""
        self.cfg = cfg
        self.session = endpoint.Session.for_server(cfg, "reward.teacher")

    def annotate(self, trajs: Sequence[Any]) -> None:
        """Set `teacher_logprobs` on every trajectory (and on each sample of an agent's episode);
        a trajectory with a row the teacher gave none for ends env_error, untrained (module doc)."""
        owned = [(t, s) for t in trajs for s in (t.samples or [t]) if s.response_ids]
        results = self._ask_all([s.prompt_ids + s.response_ids for _, s in owned])
        failed: dict[int, str] = {}
        for (t, row), (logprobs, error) in zip(owned, results):
            if logprobs is None:
                failed.setdefault(id(t), f"reward.teacher ({self.cfg.model} at {self.cfg.base_url}) gave no logprobs "
                                         f"for the trajectory of prompt {row.example.get('id', '?')!r}: {error}")
                continue
            response = logprobs[len(row.prompt_ids):]
            row.teacher_logprobs = [lp if m else 0.0 for lp, m in zip(response, row.loss_mask)]
        for t in trajs:
            if id(t) in failed:
                _untrained(t, failed[id(t)])

    def _ask_all(self, sequences: list[list[int]]) -> list[tuple[list[float] | None, str]]:
        async def ask_all(client, limit):
            return list(await asyncio.gather(*(self._ask(client, limit, ids) for ids in sequences)))
        return self.session.call(ask_all)

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


def _untrained(t: Any, reason: str) -> None:
    """`t` (a turnrl.rollout Trajectory) ended as an environment error for `reason`: counted, and
    none of it trained on (the trajectory's own `end_untrained`; rewards sit below the rollout)."""
    t.end_untrained(reason)
    for row in t.samples or [t]:
        row.teacher_logprobs = [0.0] * len(row.response_ids)


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
