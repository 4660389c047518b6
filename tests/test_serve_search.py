"""`turnrl serve-search`: the BM25 index over HTTP, and the search environment using it through
`env.options.endpoint`. The service is the real command, started and stopped on loopback."""
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from turnrl import envs
from turnrl.envs.search import RemoteIndex, SearchEnv, build_index, clear_index_cache
from turnrl.envs.search_server import SearchService

ROOT = Path(__file__).resolve().parents[1]

CORPUS = [
    {"id": "1", "title": "Wilhelm Röntgen", "text": "Wilhelm Conrad Röntgen was a German physicist who produced and "
                                                  "detected X-rays in 1895, an achievement that earned him the first "
                                                  "Nobel Prize in Physics."},
    {"id": "2", "title": "X-ray", "text": "X-rays were discovered in 1895 by Wilhelm Röntgen, who named them X to "
                                          "signify an unknown type of radiation."},
    {"id": "3", "title": "Marie Curie", "text": "Marie Curie was a physicist and chemist who conducted pioneering "
                                                "research on radioactivity and discovered polonium and radium."},
    {"id": "4", "title": "Agent 48213", "text": "The code of Agent 48213 is 7731."},
    {"id": "5", "title": "Agent 11102", "text": "The code of Agent 11102 is 2045."},
]
QUERIES = ["who discovered x-rays", "Marie Curie radium", "code of Agent 48213", "zzzz qqqq", "X-ray 1895"]
XRAY = {"prompt": "Who discovered X-rays?", "answer": "Wilhelm Röntgen", "answers": ["Wilhelm Röntgen", "Röntgen"]}


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "passages.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in CORPUS) + "\n")
    return path


@pytest.fixture(scope="module")
def service(corpus_file):
    """`turnrl serve-search` in a process of its own, on a free loopback port, with params
    overrides for top_k and the passage length; stopped (SIGTERM, then waited for) afterwards."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "turnrl.cli", "serve-search", "--params", str(ROOT / "params.yaml"), "--port", "0",
         "-S", "env.name=search", "-S", f"env.options.corpus={corpus_file}", "-S", "env.options.top_k=2",
         "-S", "env.options.max_passage_chars=60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(ROOT))
    try:
        line = proc.stdout.readline()
        match = re.search(r"at (http://127\.0\.0\.1:\d+)", line)
        assert match, line + proc.stderr.read() if proc.poll() is not None else line
        yield match.group(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)


def test_the_service_answers_like_the_local_index(service, corpus_file):
    health = httpx.get(f"{service}/health").json()
    local = build_index(str(corpus_file))
    assert health == {"ok": True, "passages": 5, "digest": local.digest, "top_k": 2,
                      "max_passage_chars": 60}       # params' top_k and passage length, the same corpus
    for query in QUERIES:
        got = httpx.post(f"{service}/search", json={"query": query, "k": 3}).json()
        assert got["passages"] == local.search(query, 3), query
    default = httpx.post(f"{service}/search", json={"query": "who discovered x-rays"}).json()
    assert len(default["passages"]) == 2                                            # params' top_k
    assert all(len(line) <= 60 + 4 for line in default["result"].splitlines()[1:-1])  # "[k] " + 60 chars
    bad = httpx.post(f"{service}/search", content=b"not json")
    assert bad.status_code == 400 and "JSON" in bad.json()["error"]
    assert httpx.post(f"{service}/search", json={"query": "x", "k": 0}).status_code == 400


def test_the_search_environment_through_the_endpoint_sees_what_a_local_index_shows(service, corpus_file):
    """Same observations, rewards and info, turn by turn; made from params as a stage makes it
    (no data folder needed: the service holds the corpus)."""
    clear_index_cache()
    remote = envs.make("search", endpoint=service, top_k=2, max_passage_chars=200)
    local = SearchEnv(corpus=str(corpus_file), top_k=2, max_passage_chars=200)
    assert isinstance(remote.index, RemoteIndex)
    turns = ["<search>who discovered x-rays</search>", "<search></search>", "<search>zzzz qqqq</search>",
             "<answer>Wilhelm Röntgen</answer>"]
    for env in (remote, local):
        env.reset(XRAY)
    for turn in turns:
        a, b = remote.step(turn), local.step(turn)
        assert (a.observation, a.reward, a.done, a.info) == (b.observation, b.reward, b.done, b.info), turn
    assert a.info["outcome"] == 1.0 and a.info["answer_retrieved"] == 1.0


def test_many_environment_threads_share_the_service(service, corpus_file):
    """64 searches from 8 threads at once through one connection pool: every answer right."""
    from concurrent.futures import ThreadPoolExecutor
    index = RemoteIndex(service)
    local = build_index(str(corpus_file))
    queries = QUERIES * 13
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda q: index.search(q, 2), queries))
    assert answers == [local.search(q, 2) for q in queries]


def test_a_service_that_is_down_is_an_environment_error_after_retries(tmp_path):
    """Nothing listens: the request is retried, then the step raises (the loop ends that
    trajectory with env_error and counts it against env.max_error_fraction)."""
    service = SearchService(build_index(CORPUS), port=0).start()
    url = service.url
    service.stop()
    env = SearchEnv(index=RemoteIndex(url, timeout_s=2, retries=2), top_k=1)
    env.reset(XRAY)
    start = time.perf_counter()
    with pytest.raises(ConnectionError, match="after 3 attempts"):
        env.step("<search>x-rays</search>")
    assert time.perf_counter() - start < 5


def test_the_service_is_an_http_tool_for_the_tools_environment(corpus_file):
    """Its `result` is the observation the search environment would show, so the tools
    environment can call it as an HTTP tool, in the model's function-calling format."""
    import asyncio
    service = SearchService(build_index(str(corpus_file)), top_k=1, max_passage_chars=80, port=0).start()
    try:
        env = envs.make("tools", functions=[], http=[{
            "name": "search", "url": f"{service.url}/search", "description": "Search the corpus.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}])
        env.reset(XRAY)
        call = '<tool_call>{"name": "search", "arguments": {"query": "who discovered x-rays"}}</tool_call>'
        result = asyncio.run(env.step(call))
        expected = SearchEnv(corpus=str(corpus_file), top_k=1, max_passage_chars=80)
        expected.reset(XRAY)
        assert result.observation == [expected.step("<search>who discovered x-rays</search>").observation]
        assert result.info["tool_ok"] is True and result.reward == 1.0
    finally:
        service.stop()


def test_its_env_options_are_read_as_turnrl_env_reads_them(tmp_path, capsys):
    """`-S env.options.KEY=VALUE` sets the search environment's options whatever params' env.name
    (here code_tool), values read as YAML; a value that is not YAML is one line, exit 2."""
    from turnrl.pipeline import serve_search
    params = str(ROOT / "params.yaml")
    assert serve_search.main(["--params", params, "-S", "env.options.top_k=[", "--port", "0"]) == 2
    assert "-S 'env.options.top_k=[': the value is not YAML" in capsys.readouterr().err
    # a good value passes the params check and the options check; the corpus named is what fails here
    missing = tmp_path / "none.jsonl"
    assert serve_search.main(["--params", params, "-S", "++env.options.top_k=3", "-S",
                              f"env.options.corpus={missing}", "--port", "0"]) == 2
    assert f"the corpus {str(missing)!r}" in capsys.readouterr().err
    assert serve_search.settings(None, tmp_path, {"top_k": 3})["top_k"] == 3
