"""LLM judges as rewards (`reward.judges`): a model behind an OpenAI-compatible endpoint scores
each trajectory from a prompt template; the score, mapped onto [0, 1], is one more named reward
(`reward_<name>_mean`, times its weight in the reward), scored through the same door as the
reward functions (turnrl.rewards.functions), as a batch.

    reward:
      judges:
        - name: helpful
          base_url: http://judge-host:8000/v1       # vLLM, SGLang, a hosted API: any Chat Completions server
                                                   # (or serve: CHECKPOINT, turnrl.training.served_models)
          model: Qwen/Qwen3-8B
          template: "Question: {question}\\nAnswer: {response}\\nReference: {reference}\\nScore 0-10:"
          score: number                            # or json:<field>, or labels
          range: [0, 10]
          scope: episode                           # or turn (each policy turn), or group (RULER-style)
          max_concurrency: 8                       # requests in flight at once
          timeout_s: 60
          retries: 2
          hedge_after: p90                         # a call still out then gets a twin (or seconds; null: never)

The rollout actor scores each trajectory as it finishes (in async training, each group as the
stream hands it out; with scope: group, each group as its last member ends), on a thread of its
own, while the rest of the batch generates (turnrl.rollout.scored): the engines are not held
while the judge thinks. What is finished at once is one batch here: its calls run concurrently;
batches scored at once share the judge's session (turnrl.rewards.endpoint.Session), so at most
max_concurrency calls are in flight in all, and an identical prompt is asked once per step
(a later batch's waits for the call in flight, or reads its answer; a failed call is not kept). A
request that times out, cannot connect or gets 429 / 5xx is retried (`retries` more times,
backing off); one still out after `hedge_after` is sent again beside it, the first answer taken;
an answer with no score in it, or one outside `range`, is a parse failure. A failure goes to the reward functions' `reward.on_error`: fail stops the step naming
the judge; zero scores it 0, counted as reward_<name>_errors. Each trajectory's verdicts are in
its info (`judge_<name>`: per call the prompt, the judge's answer, the score, seconds, tries,
whether cached, the error) and so in its MLflow trace, one span per call; `judge_metrics` sums
a batch's calls into the step's metrics (latency p50/p99, retries, unparsable answers, failures,
cache hits).

`scope: turn` asks about every policy turn ({response} is that turn, {turn} its number,
{history} the turns and observations before it); each turn's score times the weight is added to
its turn reward, which the turn-level algorithms (mt_grpo, ms_grpo, ms_po, mlmt) train on, and
the trajectory's score is the mean over its turns.

`scope: group` (RULER-style, relative judging) asks once per group: {responses} lists the group's
responses (each its last turn) numbered from 1, {count} says how many, and the judge answers a
JSON object whose field (`score: json:<field>`) is the list of their scores in that order.

A template field that is neither built in (question, response, transcript, reference, history,
turn) nor a field of every row is an error before any rollout (`missing_fields`).
"""
from __future__ import annotations

import asyncio
import json
import math
import re
import string
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from turnrl.rewards import endpoint

HEDGE_MIN_CALLS = 20   # answered calls before a quantile of them sets hedge_after: pNN
MAX_SHARED_PROMPTS = 4096   # a step's prompts kept for identical ones (Judge._asked)
BUILT_IN_FIELDS = ("question", "response", "transcript", "reference", "history", "turn", "responses", "count")
_NUM = r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"
_NUMBER = re.compile(_NUM)
# "8/10", "7 out of 10": a score on a scale the judge states
_FRACTION = re.compile(rf"({_NUM})\s*(?:/|out of)\s*({_NUM})", re.IGNORECASE)
# "Score: 7", "rating is 8/10", "I'd rate it 6": the number a score word introduces
_LABELED = re.compile(rf"\b(?:score|rating|rate|grade)[a-z]*\b[^\d\n+-]{{0,24}}({_NUM})(?:\s*(?:/|out of)\s*({_NUM}))?",
                      re.IGNORECASE)


class JudgeError(RuntimeError):
    """The judge gave no score for a trajectory (down, timed out, unparsable, out of range)."""


def template_fields(template: str) -> list[str]:
    """The `{field}` names a template uses."""
    return [name for _, name, _, _ in string.Formatter().parse(template) if name]


def missing_fields(template: str, rows: Sequence[dict]) -> tuple[str, int] | None:
    """(a field the template needs, the first row without it), or None when every row has them."""
    for field in template_fields(template):
        if field in BUILT_IN_FIELDS:
            continue
        for i, row in enumerate(rows):
            if field not in row:
                return field, i
    return None


def check_rows(judges: Sequence[Any], rows: Sequence[dict], what: str) -> None:
    """Raise ValueError naming the judge, the field and the row when a template needs a field
    the rows (`what`: e.g. "the training rows") do not all have."""
    for k, judge in enumerate(judges):
        missing = missing_fields(judge.template, rows)
        if missing is not None:
            field, i = missing
            raise ValueError(f"reward.judges[{k}] ({judge.name}): the template uses {{{field}}}, and row {i} of {what} "
                             f"(id {rows[i].get('id', '?')!r}) has no field {field!r}; its fields: "
                             f"{', '.join(sorted(rows[i]))}. Built-in fields: {', '.join(BUILT_IN_FIELDS)}")


def _label_at(text: str, label: str) -> int:
    """Where `label` first stands as a word of `text` (not inside one: "no" in "know"), or -1."""
    m = re.search(rf"(?<!\w){re.escape(label.lower())}(?!\w)", text.lower())
    return m.start() if m else -1


def _number_in(text: str, low: float, high: float) -> float:
    """The score a free-text answer gives: the number a score word introduces ("Score: 7",
    "rating 8/10"; the last such), else the last "N/M" or "N out of M", else the last number.
    N of a scale M other than the range's top is mapped onto the range (4/5 on [0, 10] is 8)."""
    found = _LABELED.findall(text) or _FRACTION.findall(text) or [(n, "") for n in _NUMBER.findall(text)]
    if not found:
        raise ValueError("no number in the answer")
    number, scale = found[-1]
    value = float(number)
    if scale and float(scale) != high:
        if float(scale) <= 0:
            raise ValueError(f"the score {number}/{scale} has no scale")
        value = low + value / float(scale) * (high - low)
    return value


def parse_score(text: str, cfg: Any) -> float:
    """The judge's answer as a score in [0, 1]; ValueError saying why not."""
    if cfg.score == "labels":
        found = [(at, -len(label), label) for label in cfg.labels if (at := _label_at(text, label)) >= 0]
        if not found:
            raise ValueError(f"none of the labels {sorted(cfg.labels)} in the answer")
        low, high = cfg.range   # (the config keeps every label's score within it)
        return (float(cfg.labels[min(found)[2]]) - low) / (high - low)
    low, high = cfg.range
    if cfg.score.startswith("json:"):
        field = cfg.score[5:]
        value = _json_field(text, field)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"no number in the JSON field {field!r} of the answer")
    else:
        value = _number_in(text, low, high)
    if not math.isfinite(value) or not low <= value <= high:
        raise ValueError(f"the score {value:g} is outside range [{low:g}, {high:g}]")
    return (value - low) / (high - low)


def _row_fields(example: dict) -> dict:
    """A row's fields for a template: its own by name, and {question} / {reference}."""
    return {**{name: v for name, v in example.items() if isinstance(name, str)},
            "question": example.get("prompt", ""), "reference": example.get("answer", "")}


def _json_field(text: str, field: str) -> Any:
    """`field` of the JSON object in a judge's answer (from its first "{" to its last "}"), or None."""
    start, end = text.find("{"), text.rfind("}")
    try:
        return json.loads(text[start:end + 1])[field] if start >= 0 else None
    except (json.JSONDecodeError, KeyError, TypeError):
        return None


def parse_scores(text: str, cfg: Any, count: int) -> list[float]:
    """`scope: group`: the JSON field `cfg.score` names (json:<field>) as `count` scores in [0, 1];
    ValueError saying why not."""
    field = cfg.score[5:]
    values = _json_field(text, field)
    if not isinstance(values, list) or len(values) != count:
        raise ValueError(f"no list of {count} scores in the JSON field {field!r} of the answer")
    low, high = cfg.range
    out = []
    for k, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not low <= value <= high:
            raise ValueError(f"score {k + 1} ({value!r}) is not a number in range [{low:g}, {high:g}]")
        out.append((value - low) / (high - low))
    return out


@dataclass
class Verdict:
    score: float | None
    answer: str
    seconds: float
    error: str = ""
    tries: int = 1
    cached: bool = False
    unparsable: bool = False   # the judge answered, without a score in range
    hedged: bool = False       # a twin request was sent (hedge_after)

    def record(self, prompt: str, turn: int | None = None) -> dict:
        return {"prompt": prompt, "answer": self.answer, "score": self.score, "seconds": round(self.seconds, 4),
                "tries": self.tries, "cached": self.cached, "unparsable": self.unparsable, "hedged": self.hedged,
                **({"turn": turn + 1} if turn is not None else {}), **({"error": self.error} if self.error else {})}


def verdicts(info: dict) -> list[tuple[str, dict]]:
    """(judge name, verdict record) for every call recorded in a trajectory's info."""
    return [(key[6:], record) for key, records in sorted(info.items())
            if key.startswith("judge_") and isinstance(records, list)
            for record in records if isinstance(record, dict) and "prompt" in record]


def judge_metrics(trajs: Sequence[Any]) -> dict[str, float]:
    """Per judge, over a batch's verdicts: `judge_<name>_calls` (requests answered or failed, not
    cached), `_latency_p50_s` / `_latency_p99_s` (their seconds, retries included), `_retries`,
    `_hedged` (calls that sent a twin request, hedge_after), `_unparsable` (answers with no score
    in range), `_failures` (no answer: down, timeouts, HTTP errors) and `_cached_frac` (verdicts
    read from an identical prompt's)."""
    by_judge: dict[str, list[dict]] = {}
    for t in trajs:
        for name, record in verdicts(t.info or {}):
            by_judge.setdefault(name, []).append(record)
    out: dict[str, float] = {}
    for name, records in by_judge.items():
        records = [r for r in records if not r.get("shared")]   # scope group: the group's call once
        asked = [r for r in records if not r.get("cached")]
        seconds = [float(r["seconds"]) for r in asked]
        out[f"judge_{name}_calls"] = float(len(asked))
        if seconds:   # linearly interpolated quantiles
            out[f"judge_{name}_latency_p50_s"] = float(np.quantile(seconds, 0.50))
            out[f"judge_{name}_latency_p99_s"] = float(np.quantile(seconds, 0.99))
        out[f"judge_{name}_retries"] = float(sum(max(0, int(r.get("tries", 1)) - 1) for r in asked))
        out[f"judge_{name}_hedged"] = float(sum(bool(r.get("hedged")) for r in asked))
        out[f"judge_{name}_unparsable"] = float(sum(bool(r.get("unparsable")) for r in asked))
        out[f"judge_{name}_failures"] = float(sum(r["score"] is None and not r.get("unparsable") for r in asked))
        out[f"judge_{name}_cached_frac"] = 1.0 - len(asked) / len(records)
    return out


class Judge:
    """One `reward.judges` entry (its checked params, turnrl.config JudgeCfg): a batch scorer for
    turnrl.rewards.functions.RewardFunctions."""
    batch = True

    def __init__(self, cfg: Any, key: str = "reward.judges"):
        self.cfg, self.key, self.weight = cfg, key, cfg.weight
        self.session = endpoint.Session.for_server(cfg, key)
        self.latencies: deque[float] = deque(maxlen=512)   # recent answered calls' seconds (hedge_after: pNN)
        # this step's calls by prompt (asyncio tasks, touched on the session's loop only): asked once a step
        self._asked: dict[str, asyncio.Future] = {}

    @property
    def by_group(self) -> bool:
        """scope: group sees a group's responses together (turnrl.rollout.scored scores whole groups)."""
        return self.cfg.scope == "group"

    def new_step(self) -> None:
        """A new policy version's samples come: their identical prompts are asked anew."""
        self._asked = {}

    def __getstate__(self) -> dict:   # sent to another process (Ray): its calls in flight stay here
        return {**self.__dict__, "_asked": {}}

    def hedge_after_s(self) -> float | None:
        """When a call still out gets a twin (`hedge_after`): its seconds, the quantile of this
        judge's recent latencies (none until HEDGE_MIN_CALLS calls answered), or None."""
        hedge = self.cfg.hedge_after
        if hedge is None or isinstance(hedge, (int, float)):
            return hedge
        if len(self.latencies) < HEDGE_MIN_CALLS:
            return None
        return float(np.quantile(list(self.latencies), int(hedge[1:]) / 100))

    def prompt(self, t: Any, decode: Callable[[list[int]], str], turn: int | None = None) -> str:
        """The template filled for trajectory `t`: about its last turn, or about policy turn
        `turn` (0-based) with {history} the turns and observations before it."""
        example = t.example or {}
        k = len(t.turn_texts) - 1 if turn is None else turn
        before = [text for i in range(max(k, 0)) for text in (t.turn_texts[i], *t.observations[i:i + 1])]
        fields = {**_row_fields(example),
                  "response": t.turn_texts[k] if t.turn_texts else "", "transcript": decode(t.response_ids),
                  "history": "\n".join(before), "turn": k + 1}
        return self.cfg.template.format_map(fields)

    def score_batch(self, trajs: Sequence[Any], decode: Callable[[list[int]], str]) -> list[float | Exception]:
        """Each trajectory's score, or the JudgeError it got; its verdict goes in its info. With
        `scope: turn` each policy turn is asked: its score times the weight is added to that
        turn's turn reward (the turn-level algorithms' signal) and the trajectory's score is
        the mean of its turns'. `scope: group` asks once per group (`_score_groups`)."""
        if self.cfg.scope == "group":
            return self._score_groups(trajs, decode)
        asks = [(i, k, self.prompt(t, decode, k)) for i, t in enumerate(trajs)
                for k in (range(t.num_turns) if self.cfg.scope == "turn" else [None])]
        unique = list(dict.fromkeys(prompt for _, _, prompt in asks))
        verdicts = dict(zip(unique, self._ask_all(unique)))
        seen: set[str] = set()
        for t in trajs:
            t.info[f"judge_{self.cfg.name}"] = []
        records: list[list[tuple[int | None, Verdict]]] = [[] for _ in trajs]
        for i, k, prompt in asks:
            verdict = verdicts[prompt]
            if prompt in seen:   # asked once for the batch: the others read the same verdict
                verdict = Verdict(verdict.score, verdict.answer, 0.0, verdict.error, 0, cached=True,
                                  unparsable=verdict.unparsable)
            seen.add(prompt)
            records[i].append((k, verdict))
            trajs[i].info[f"judge_{self.cfg.name}"].append(verdict.record(prompt, k))
        out: list[float | Exception] = []
        for t, asked in zip(trajs, records):
            failed = [v.error for _, v in asked if v.score is None]
            for k, verdict in asked:
                if k is not None and verdict.score is not None and k < len(t.turn_rewards):
                    t.turn_rewards[k] += self.weight * verdict.score
            if failed:
                out.append(JudgeError(f"judge {self.cfg.name!r} at {self.cfg.base_url}: {failed[0]}"))
            elif not asked:   # no policy turn to judge (scope: turn)
                out.append(JudgeError(f"judge {self.cfg.name!r}: the trajectory has no turn to score"))
            else:
                out.append(sum(v.score for _, v in asked) / len(asked))
        return out

    def _score_groups(self, trajs: Sequence[Any], decode: Callable[[list[int]], str]) -> list[float | Exception]:
        """`scope: group`: one call per group (the trajectories of one prompt), its answer a JSON
        list of scores, one per response in {responses}' order."""
        groups: dict[int, list[int]] = {}
        for i, t in enumerate(trajs):
            groups.setdefault(id(t.example), []).append(i)
        prompts = {key: self.group_prompt([trajs[i] for i in members]) for key, members in groups.items()}
        unique = list(dict.fromkeys(prompts.values()))
        sizes = {prompts[key]: len(members) for key, members in groups.items()}
        verdicts = dict(zip(unique, self._ask_all(unique, [lambda text, n=sizes[p]: parse_scores(text, self.cfg, n)
                                                         for p in unique])))
        out: list[float | Exception] = [0.0] * len(trajs)
        for key, members in groups.items():
            verdict = verdicts[prompts[key]]
            for k, i in enumerate(members):
                score = verdict.score[k] if verdict.score is not None else None
                record = Verdict(score, verdict.answer, verdict.seconds, verdict.error, verdict.tries,
                                 cached=verdict.cached, unparsable=verdict.unparsable,
                                 hedged=verdict.hedged).record(prompts[key])
                record.update(group_index=k + 1, shared=k > 0)   # one call for the group: counted once
                trajs[i].info[f"judge_{self.cfg.name}"] = [record]
                out[i] = (JudgeError(f"judge {self.cfg.name!r} at {self.cfg.base_url}: {verdict.error}")
                          if score is None else score)
        return out

    def group_prompt(self, group: Sequence[Any]) -> str:
        """The template filled for a group: {responses} numbered, each response's last turn."""
        example = group[0].example or {}
        responses = "\n\n".join(f"Response {k + 1}:\n{t.turn_texts[-1] if t.turn_texts else ''}"
                                 for k, t in enumerate(group))
        fields = {**_row_fields(example), "responses": responses, "count": len(group)}
        return self.cfg.template.format_map(fields)

    def _ask_all(self, prompts: list[str], parsers: Sequence[Callable[[str], Any]] | None = None) -> list[Verdict]:
        """The verdicts on `prompts`, asked concurrently through this judge's session."""
        parsers = parsers or [lambda text: parse_score(text, self.cfg)] * len(prompts)
        hedge_after_s = self.hedge_after_s()

        async def ask_all(client, limit):
            asked, calls, shared = self._asked, [], []
            if len(asked) > MAX_SHARED_PROMPTS:   # no new_step for long (a stream without weight pushes)
                asked.clear()
            for prompt, parse in zip(prompts, parsers):
                call = asked.get(prompt)
                shared.append(call is not None)
                if call is None:
                    call = asked[prompt] = asyncio.ensure_future(self._ask(client, limit, prompt, parse, hedge_after_s))
                    call.add_done_callback(lambda c, p=prompt: _forget_failed(asked, p, c))
                calls.append(call)
            # shielded: a call another batch waits for too is never cancelled with this one
            verdicts = await asyncio.gather(*(asyncio.shield(c) for c in calls))
            return [Verdict(v.score, v.answer, 0.0, v.error, 0, cached=True, unparsable=v.unparsable) if reused else v
                    for v, reused in zip(verdicts, shared)]
        verdicts = self.session.call(ask_all)
        self.latencies.extend(v.seconds for v in verdicts if v.error == "" and not v.cached)
        return verdicts

    async def _ask(self, client, limit: asyncio.Semaphore, prompt: str, parse: Callable[[str], Any],
                   hedge_after_s: float | None) -> Verdict:
        url = self.cfg.base_url.rstrip("/") + "/chat/completions"
        body = {"model": self.cfg.model, "messages": [{"role": "user", "content": prompt}], "temperature": 0.0,
                "max_tokens": self.cfg.max_tokens}
        start = time.perf_counter()
        reply = await endpoint.post_hedged(client, limit, url, body, retries=self.cfg.retries,
                                           timeout_s=self.cfg.timeout_s, hedge_after_s=hedge_after_s)
        seconds, tries, hedged = time.perf_counter() - start, reply.tries, reply.hedged
        if reply.body is None:
            return Verdict(None, "", seconds, reply.error, tries=tries, hedged=hedged)
        try:
            answer = reply.body["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            return Verdict(None, "", seconds, f"not a chat completion: {reply.text[:200]}", tries=tries, hedged=hedged)
        try:
            return Verdict(parse(answer), answer, seconds, tries=tries, hedged=hedged)
        except ValueError as exc:   # a parse failure is the judge's answer, not a fault to retry
            return Verdict(None, answer, seconds, f"unparsable: {exc}: {answer[:200]!r}", tries=tries,
                           unparsable=True, hedged=hedged)


def _forget_failed(asked: dict, prompt: str, call: asyncio.Future) -> None:
    """A call that got no score is not kept: the prompt's next batch asks again."""
    if not call.cancelled() and call.exception() is None and call.result().score is None and asked.get(prompt) is call:
        del asked[prompt]
