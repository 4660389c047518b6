"""`search` (RoSTE, MT-GRPO / MS-GRPO): the policy searches a local BM25 index before it answers.

Protocol, one policy turn at a time:
    <search>who discovered x-rays</search>   -> observation (role "tool"):
        <result>
        [1] Wilhelm Röntgen: Wilhelm Conrad Röntgen was a German physicist who ...
        [2] X-ray: X-rays were discovered in 1895 by ...
        </result>
    <answer>Wilhelm Röntgen</answer>          -> done, outcome = exact match

The index is BM25 from the ``bm25s`` library over a corpus of ``{id, title, text}`` passages
(title and text are indexed together). Each result line is ``[rank] title: text``, cut to
``max_passage_chars`` characters (ending in "..." when cut), so an observation is at most about
``top_k * (max_passage_chars + 6)`` characters plus the two tag lines. Passages that share no
term with the query (BM25 score 0) are not returned, so a query can come back with no results.

The index can also live in a service (`turnrl serve-search`, :mod:`turnrl.envs.search_server`):
with ``endpoint`` set the environment asks it over HTTP (:class:`RemoteIndex`), so rollout
workers on many nodes share one index; the observations are the same as with a local index of
the same corpus.

Building an index costs seconds on a real corpus, and an environment is made per trajectory:
:func:`build_index` caches indexes at module level (by corpus content, or by file for a path
or a registered data set name), so every ``SearchEnv(corpus=same corpus)`` shares one index;
or build it once and pass ``SearchEnv(index=...)``. :class:`SearchIndex` is safe to share
between the rollout loop's environment threads.

Rewards
-------
Turn (step) reward of a search turn, ``StepResult.reward``::

    tool_reward * tool_ok + retrieval_reward * answer_in_results      (defaults 0.5 + 0.5)

- ``tool_ok``: the search ran (non-empty query, under the search limit) and returned at
  least one passage: MT-GRPO's verifiable "the tool call worked" turn reward.
- ``answer_in_results``: a gold answer occurs (as whole normalized words,
  :func:`turnrl.rewards.qa.contains_answer`) in the retrieved text exactly as shown to the
  policy (after truncation), gold answers being the example's ``answers`` list, else
  ``[answer]``: the "answer appears in the retrieved passages" step reward of RoSTE / MS-GRPO.

Both are 0/1 verifiable signals; summing them with weights 0.5 keeps the step reward in
[0, 1], on the scale of the outcome (exact match), which is what MS-PO's
``R_tot = R_step + gamma * R_out`` and MT-GRPO's ``A = A_out + c * A_turn`` assume; a query that
runs but misses the answer earns half. The trainer reads the FIRST turn's reward
(``Trajectory.turn_rewards[0]``) as the turn/step reward, i.e. the first search's reward when
the policy searches first; later search turns get the same formula (for logging and for
per-turn estimators). An answer turn's ``StepResult.reward`` is 0.0 (no tool call: a policy
that answers without searching earns no turn reward); its outcome is ``info["outcome"]``.
The parts are in ``info`` (``tool_ok``, ``answer_in_results``) to recombine differently.

Outcome (the ``<answer>`` turn): ``info["outcome"]`` = normalized exact match against the gold
answers; also ``info["f1"]`` (token F1), ``info["format"]`` (:func:`format_reward`: well-formed
tags and a non-empty answer) and ``info["xml_wellformed"]``, both over the policy's own text of
all its turns so far (observations excluded: they are the environment's, not the policy's).

Endings (``info["reason"]``): ``answer``; ``no_action`` (a turn with neither a complete
``<search>...</search>`` nor ``<answer>...</answer>``: outcome 0). An empty query, a query past
``max_searches`` or a query with no results are not errors in the trainer: they come back as
text inside ``<result>`` with turn reward 0 and the trajectory goes on.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import bm25s
from pydantic import BaseModel, ConfigDict, Field

from turnrl.data import synthetic
from turnrl.envs.base import EnvContext, EnvSpec, StepResult
from turnrl.rewards.format import format_reward, xml_wellformed
from turnrl.rewards.qa import contains_answer, exact_match, f1

__all__ = ["SYSTEM_PROMPT", "RemoteIndex", "SearchEnv", "SearchIndex", "build_index", "clear_index_cache",
           "load_corpus", "parse_action", "format_results", "remote_index", "shown_passages"]

SYSTEM_PROMPT = (
    "Answer the question. You can search Wikipedia by writing <search>query</search>; the top "
    "passages come back in <result>...</result>. Search as often as you need, then give a short "
    "final answer as <answer>...</answer>."
)

_SEARCH = re.compile(r"<search>(.*?)</search>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)

#: Stop words removed from passages and queries alike (bm25s's English list).
STOPWORDS = "en"


def parse_action(text: str) -> tuple[str, str | None]:
    """('answer', content) | ('search', query) | ('none', None), by the first complete tag."""
    answer, search = _ANSWER.search(text), _SEARCH.search(text)
    if answer and (not search or answer.start() < search.start()):
        return "answer", answer.group(1).strip()
    if search:
        return "search", search.group(1).strip()
    return "none", None


# --------------------------------------------------------------------------- corpus
def _passage(i: int, p: Mapping[str, Any]) -> dict[str, str]:
    if not isinstance(p, Mapping) or not isinstance(p.get("text"), str):
        raise ValueError(f"corpus passage {i} must be a mapping with a string 'text'")
    title = p.get("title")
    return {"id": str(p.get("id", i)), "title": "" if title is None else str(title), "text": p["text"]}


def _read_records(path: Path) -> list[Any]:
    if path.suffix == ".parquet":
        from turnrl.data.sources import read_parquet
        return read_parquet(path)
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as fh:
        text = fh.read()
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def load_corpus(source: Iterable[Mapping[str, Any]] | str | os.PathLike[str] | None = None,
                **load_kwargs: Any) -> list[dict[str, str]]:
    """The corpus as a list of ``{id, title, text}``.

    ``source``: a list of passages (``title`` optional, ``id`` defaults to the position);
    ``None`` (the NQ-open gold passages, via ``$TURNRL_DATA_DIR`` or ``data_dir=``); a
    registered data set name (``"nq_open"``); or a file (``.jsonl``, ``.jsonl.gz``, ``.json``,
    ``.parquet``) holding either passages or NQ-shaped rows (with ``ctxs`` / ``passages``, whose
    gold passages make the corpus, see :func:`turnrl.data.sources.load_search_corpus`).
    """
    from turnrl.data.sources import DATASETS, load_search_corpus

    if source is None:
        return load_search_corpus("nq_open", **load_kwargs)
    if isinstance(source, (str, os.PathLike)):
        key = os.fspath(source)
        if key in DATASETS:
            return load_search_corpus(key, **load_kwargs)
        path = Path(key).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such corpus file (nor a registered data set name)")
        records = _read_records(path)
        if records and isinstance(records[0], Mapping) and ("ctxs" in records[0] or "passages" in records[0]):
            return load_search_corpus(path, **load_kwargs)
        return [_passage(i, r) for i, r in enumerate(records)]
    return [_passage(i, p) for i, p in enumerate(source)]


def _corpus_digest(corpus: Sequence[Mapping[str, str]]) -> str:
    h = hashlib.sha1()
    for p in corpus:
        for part in (p["id"], p["title"], p["text"]):
            h.update(part.encode("utf-8", "surrogatepass"))
            h.update(b"\0")
        h.update(b"\1")
    return h.hexdigest()


# --------------------------------------------------------------------------- index
class SearchIndex:
    """A ``bm25s.BM25`` index and the passages it was built from.

    ``search(query, k)`` -> up to ``k`` passages ``{id, title, text, score}``, best first,
    leaving out passages with BM25 score 0 (no query term in them).
    """

    def __init__(self, corpus: Sequence[Mapping[str, Any]], *, k1: float = 1.5, b: float = 0.75,
                 method: str = "lucene"):
        self.corpus = [_passage(i, p) for i, p in enumerate(corpus)]
        if not self.corpus:
            raise ValueError("cannot build a search index over an empty corpus")
        self.digest = _corpus_digest(self.corpus)
        start = time.perf_counter()
        docs = [f"{p['title']}\n{p['text']}" if p["title"] else p["text"] for p in self.corpus]
        tokens = bm25s.tokenize(docs, stopwords=STOPWORDS, show_progress=False)
        self.retriever = bm25s.BM25(k1=k1, b=b, method=method)
        self.retriever.index(tokens, show_progress=False)
        self.build_seconds = time.perf_counter() - start
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.corpus)

    def search(self, query: str, k: int) -> list[dict[str, Any]]:
        k = min(int(k), len(self.corpus))
        if k <= 0 or not query or not query.strip():
            return []
        query_tokens = bm25s.tokenize([query], stopwords=STOPWORDS, return_ids=False, show_progress=False)
        if not query_tokens or not query_tokens[0]:
            return []
        with self._lock:
            docs, scores = self.retriever.retrieve(query_tokens, k=k, show_progress=False, n_threads=0)
        out = []
        for doc, score in zip(docs[0].tolist(), scores[0].tolist()):
            if score > 0:
                out.append({**self.corpus[int(doc)], "score": float(score)})
        return out


class RemoteIndex:
    """The index of a search service (`turnrl serve-search`) at `endpoint`, with
    `SearchIndex.search`'s interface. Transport errors (refused, reset, HTTP 502/503/504) are
    retried `retries` times with a short backoff; then, or on any other failure, it raises (the
    trajectory ends with env_error, counted against env.max_error_fraction). Thread-safe: one
    connection pool shared by the environment threads."""

    def __init__(self, endpoint: str, *, timeout_s: float = 10.0, retries: int = 2):
        import httpx
        base = endpoint.rstrip("/")
        self.endpoint = base
        self.url = base if base.endswith("/search") else base + "/search"
        self.retries = retries
        self.client = httpx.Client(timeout=timeout_s)

    def search(self, query: str, k: int) -> list[dict[str, Any]]:
        import httpx
        if k <= 0 or not query or not query.strip():
            return []
        for attempt in range(self.retries + 1):
            try:
                response = self.client.post(self.url, json={"query": query, "k": int(k)})
                if response.status_code not in (502, 503, 504):
                    break
                problem: str = f"HTTP {response.status_code}"
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
                problem = f"{type(exc).__name__}: {exc}"
            if attempt == self.retries:
                raise ConnectionError(f"search service {self.url}: {problem} (after {attempt + 1} attempts)")
            time.sleep(0.05 * 2 ** attempt)
        if response.status_code != 200:
            raise RuntimeError(f"search service {self.url}: HTTP {response.status_code}: {response.text[:300]}")
        return list(response.json()["passages"])

    def health(self) -> dict:
        return self.client.get(self.endpoint.removesuffix("/search") + "/health").json()


_REMOTE: dict[tuple, RemoteIndex] = {}


def remote_index(endpoint: str, timeout_s: float = 10.0, retries: int = 2) -> RemoteIndex:
    """One RemoteIndex (one connection pool) per endpoint and settings in a process."""
    key = (endpoint, timeout_s, retries)
    with _CACHE_LOCK:
        if key not in _REMOTE:
            _REMOTE[key] = RemoteIndex(endpoint, timeout_s=timeout_s, retries=retries)
        return _REMOTE[key]


_CACHE: OrderedDict[tuple, SearchIndex] = OrderedDict()
_CACHE_SIZE = 4
_CACHE_LOCK = threading.Lock()


def _source_key(source: Any, load_kwargs: Mapping[str, Any]) -> tuple | None:
    """A cache key for a corpus given by name or file (so a cache hit skips loading), or None."""
    from turnrl.data.sources import DATASETS, resolve_local_path

    if source is not None and not isinstance(source, (str, os.PathLike)):
        return None
    key = "nq_open" if source is None else os.fspath(source)
    if key in DATASETS:
        if set(load_kwargs) - {"data_dir"}:
            return None
        path = resolve_local_path(key, load_kwargs.get("data_dir"))
    else:
        path = Path(key).expanduser()
        if load_kwargs:
            return None
    if path is None or not path.is_file():
        return None
    stat = path.stat()
    return ("file", key, str(path.resolve()), stat.st_mtime_ns, stat.st_size)


def _cached(key: tuple) -> SearchIndex | None:
    index = _CACHE.get(key)
    if index is not None:
        _CACHE.move_to_end(key)
    return index


def _store(key: tuple, index: SearchIndex) -> None:
    _CACHE[key] = index
    _CACHE.move_to_end(key)
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)


def build_index(corpus: Iterable[Mapping[str, Any]] | str | os.PathLike[str] | None = None, *,
                k1: float = 1.5, b: float = 0.75, method: str = "lucene", **load_kwargs: Any) -> SearchIndex:
    """The BM25 index over ``corpus`` (anything :func:`load_corpus` takes), built once per
    process: indexes are cached by corpus content (and by file for names and paths), so calls
    with the same corpus return the same :class:`SearchIndex` object."""
    params = (k1, b, method)
    with _CACHE_LOCK:
        skey = _source_key(corpus, load_kwargs)
        if skey is not None and (hit := _cached(skey + params)) is not None:
            return hit
        passages = load_corpus(corpus, **load_kwargs)
        ckey = ("content", _corpus_digest(passages)) + params
        index = _cached(ckey)
        if index is None:
            index = SearchIndex(passages, k1=k1, b=b, method=method)
            _store(ckey, index)
        if skey is not None:
            _store(skey + params, index)
        return index


def clear_index_cache() -> None:
    """Forget every cached index (tests; or to free memory)."""
    with _CACHE_LOCK:
        _CACHE.clear()


# --------------------------------------------------------------------------- formatting
def _truncate(text: str, limit: int) -> str:
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    if limit <= 3:
        return text[:limit]
    cut = text[: limit - 3]
    space = cut.rfind(" ")
    if space >= (limit - 3) // 2:    # end on a word boundary when one is near
        cut = cut[:space]
    return cut.rstrip() + "..."


def shown_passages(passages: Sequence[Mapping[str, Any]], max_passage_chars: int) -> list[str]:
    """Each passage as the policy sees it: ``title: text`` on one line, cut to the budget."""
    bodies = (f"{p['title']}: {p['text']}" if p.get("title") else str(p["text"]) for p in passages)
    return [_truncate(body, max_passage_chars) for body in bodies]


def format_results(passages: Sequence[Mapping[str, Any]], max_passage_chars: int) -> str:
    """``<result>\\n[1] title: text\\n[2] ...\\n</result>``, each entry cut to the budget."""
    lines = [f"[{rank}] {body}" for rank, body in enumerate(shown_passages(passages, max_passage_chars), start=1)]
    return "<result>\n" + "\n".join(lines) + "\n</result>"


def _message(text: str) -> str:
    return f"<result>\n{text}\n</result>"


# --------------------------------------------------------------------------- environment
class SearchEnv:
    observation_role = "tool"
    stop = ("</search>", "</answer>")

    def __init__(self, corpus: Iterable[Mapping[str, Any]] | str | os.PathLike[str] | None = None,
                 index: SearchIndex | RemoteIndex | None = None, top_k: int = 3, max_passage_chars: int = 300,
                 max_searches: int = 4, system_prompt: str = SYSTEM_PROMPT, tool_reward: float = 0.5,
                 retrieval_reward: float = 0.5):
        if top_k < 1 or max_passage_chars < 1 or max_searches < 0:
            raise ValueError("top_k and max_passage_chars must be >= 1, max_searches >= 0")
        self.index = index if index is not None else build_index(corpus)
        self.top_k = top_k
        self.max_passage_chars = max_passage_chars
        self.max_searches = max_searches
        self.system_prompt = system_prompt
        self.tool_reward = tool_reward
        self.retrieval_reward = retrieval_reward
        self.example: dict = {}
        self.golds: list[str] = []
        self.turns: list[str] = []
        self.searches = 0
        self.answer_retrieved = 0.0

    def reset(self, example: dict) -> str:
        self.example = example
        answers = example.get("answers")
        if isinstance(answers, str):
            answers = [answers]
        if not answers and example.get("answer") is not None:
            answers = [example["answer"]]
        self.golds = [str(a) for a in (answers or [])]
        self.turns = []
        self.searches = 0
        self.answer_retrieved = 0.0
        return example["prompt"]

    def _policy_text(self) -> str:
        return "".join(self.turns)

    def _end(self, reason: str, prediction: str | None) -> StepResult:
        text = self._policy_text()
        em = exact_match(prediction, self.golds)
        info = {"outcome": em, "reason": reason, "prediction": prediction, "exact_match": em,
                "f1": f1(prediction, self.golds), "format": format_reward(text),
                "xml_wellformed": xml_wellformed(text), "searches": self.searches,
                "answer_retrieved": self.answer_retrieved}
        return StepResult(None, 0.0, True, info)

    def _search_result(self, observation: str, query: str, tool_ok: bool, in_results: float,
                       num_results: int, error: str | None = None) -> StepResult:
        reward = self.tool_reward * float(tool_ok) + self.retrieval_reward * in_results
        info = {"action": "search", "query": query, "tool_ok": tool_ok, "answer_in_results": in_results,
                "num_results": num_results, "searches": self.searches, "turn_reward": reward}
        if error:
            info["error"] = error
        return StepResult(observation, reward, False, info)

    def step(self, text: str) -> StepResult:
        self.turns.append(text)
        kind, content = parse_action(text)
        if kind == "answer":
            return self._end("answer", content)
        if kind == "none":
            return self._end("no_action", None)
        query = content or ""
        if not query:
            return self._search_result(
                _message("Error: empty query. Write a search query between <search> and </search>."),
                query, False, 0.0, 0, "empty_query")
        if self.searches >= self.max_searches:
            return self._search_result(
                _message(f"Error: search limit reached ({self.max_searches} searches). "
                         "Give your final answer as <answer>...</answer>."),
                query, False, 0.0, 0, "max_searches")
        self.searches += 1
        passages = self.index.search(query, self.top_k)
        if not passages:
            return self._search_result(_message("No results."), query, False, 0.0, 0, "no_results")
        observation = format_results(passages, self.max_passage_chars)
        # passage by passage, without the "[rank]" labels (a gold answer "2" must not match "[2]")
        shown = shown_passages(passages, self.max_passage_chars)
        in_results = max((contains_answer(body, self.golds) for body in shown), default=0.0)
        self.answer_retrieved = max(self.answer_retrieved, in_results)
        return self._search_result(observation, query, True, in_results, len(passages))


# --------------------------------------------------------------------------- as a plugin
CORPUS_FILE = "corpus.parquet"   # written into the preprocessed data folder by `prepare_corpus`


class SearchOptions(BaseModel):
    """`env.options` of `search`."""
    model_config = ConfigDict(extra="forbid")
    corpus: str = Field("", description=(
        "empty: the data's own corpus (synthetic entities, or the gold passages of nq_open); else a registered "
        "data set or a passages file"))
    top_k: int = Field(1, ge=1, description="passages per search (the synthetic task needs one)")
    max_passage_chars: int = Field(120, gt=0)
    max_searches: int = Field(2, ge=0)
    system_prompt: str = SYSTEM_PROMPT
    endpoint: str = Field("", description=(
        "a search service (turnrl serve-search), e.g. http://10.0.0.5:8000: searches go there instead of a local "
        "index, so rollout workers on many nodes share one; empty: a local index"))
    endpoint_timeout_s: float = Field(10.0, gt=0, description="seconds per request to the endpoint")


def prepare_corpus(rows: list[dict], out_dir: Path, *, corpus: str = "", endpoint: str = "", **_: Any) -> dict:
    """Write the passages the index is built over to `out_dir/corpus.parquet`: `corpus` if
    given, else the synthetic entities' passages or the data's gold passages (nq_open). With an
    `endpoint` and no passages in the data, nothing: the service holds the corpus."""
    from turnrl.data.sources import DataSourceError, load_search_corpus, write_parquet
    has_passages = rows and (all("entity" in r for r in rows) or all(r.get("passages") for r in rows))
    if endpoint and not corpus and not has_passages:
        return {"corpus": {"endpoint": endpoint}}
    if corpus:
        passages = load_corpus(corpus)
    elif rows and all("entity" in r for r in rows):
        passages = synthetic.lookup_corpus(rows)
    elif rows and all(r.get("passages") for r in rows):
        passages = load_search_corpus(rows)
    else:
        raise DataSourceError("env.name = search: the data has no passages to search (only synthetic rows and "
                              "nq_open-shaped rows do); set env.options.corpus to a passages file or data set")
    write_parquet(passages, Path(out_dir) / CORPUS_FILE)
    return {"corpus": {"n": len(passages)}}


def make_search_env(*, context: EnvContext, corpus: str = "", top_k: int = 1, max_passage_chars: int = 120,
                    max_searches: int = 2, system_prompt: str = SYSTEM_PROMPT, endpoint: str = "",
                    endpoint_timeout_s: float = 10.0) -> SearchEnv:
    """A search environment over the corpus `prepare_corpus` wrote into the data folder (the
    index is built once per process and shared), or over the search service at `endpoint`."""
    if endpoint:
        return SearchEnv(index=remote_index(endpoint, endpoint_timeout_s), top_k=top_k,
                         max_passage_chars=max_passage_chars, max_searches=max_searches, system_prompt=system_prompt)
    if context.data_dir is None:   # outside the pipeline (turnrl env without data/processed)
        if corpus:
            return SearchEnv(corpus=corpus, top_k=top_k, max_passage_chars=max_passage_chars,
                             max_searches=max_searches, system_prompt=system_prompt)
        raise FileNotFoundError("the search environment needs the preprocessed data folder (its corpus.parquet): "
                                "run `dvc repro preprocess` with env.name = search, or give it a corpus "
                                "(env.options.corpus: a passages file or data set) or a search service "
                                "(env.options.endpoint, `turnrl serve-search`)")
    corpus_file = Path(context.data_dir) / CORPUS_FILE
    if not corpus_file.exists():
        raise FileNotFoundError(f"{corpus_file} is missing; run `dvc repro preprocess` with env.name = search")
    return SearchEnv(corpus=str(corpus_file), top_k=top_k, max_passage_chars=max_passage_chars,
                     max_searches=max_searches, system_prompt=system_prompt)


ENV = EnvSpec(factory=make_search_env, options=SearchOptions, task=synthetic.TASKS["search"],
              prepare_data=prepare_corpus, name="search")
