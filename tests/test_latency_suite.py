"""benchmarks/latency.py's pure parts: the cases it plans, the summary and targets it computes,
and the tool server's injected latency (the suite itself runs in benchmarks/run.py)."""
import json
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import latency  # noqa: E402
from benchmarks.run import parse_args, plan  # noqa: E402


def test_the_quick_suite_plans_turnrl_at_both_latencies_and_trl_at_the_slow_one():
    cases = plan(parse_args(["--suites", "latency", "--quick"]))
    assert [(c["name"], c["kind"], c["latency"]) for c in cases] == [
        ("latency/turnrl-0", "latency-turnrl", 0.0), ("latency/turnrl-0.5", "latency-turnrl", 0.5),
        ("latency/turnrl-0.5-lag", "latency-turnrl", 0.5), ("latency/trl-0.5-async", "latency-trl", 0.5)]
    assert all(c["prompts"] * c["group"] == 64 and c["turns"] == 3 for c in cases)
    assert [c.get("rejoin") for c in cases[:3]] == ["ready", "ready", "lag"]
    full = plan(parse_args(["--suites", "latency"]))
    assert {c["name"] for c in full} - {c["name"] for c in cases} == {"latency/trl-0.5-sync", "latency/trl-0-async"}


def test_the_summary_takes_trls_best_and_checks_both_targets():
    medians = {"latency/turnrl-0": {"step_s": 6.0}, "latency/turnrl-0.5": {"step_s": 7.2, "tool_turns_mean": 2.0,
                                                                            "tool_turns_max": 2.0},
               "latency/turnrl-0.5-lag": {"step_s": 8.0}, "latency/trl-0.5-async": {"step_s": 30.0},
               "latency/trl-0.5-sync": {"step_s": 20.0}}
    out = latency.summary(medians)
    assert out["tool_latency_s"] == 0.5 and out["trl_step_s"] == 20.0 and out["trl_tool"] == "sync"
    assert out["turnrl_step_s"] == 7.2 and out["turnrl_step_s_no_latency"] == 6.0 and out["tool_turns"] == 2.0
    assert out["speedup"] == round(20 / 7.2, 2) and out["speedup_met"] is False     # 2.78x: under 3x
    assert out["growth_s"] == 1.2 and out["growth_limit_s"] == 1.5 and out["growth_met"] is True
    json.dumps(out)                                                           # the one-line JSON
    assert "not met" in latency.markdown(out) and "| tool latency per call | 0.5 s |" in latency.markdown(out)


def test_the_tool_server_adds_its_latency_to_every_call_and_serves_them_at_once():
    server = latency.ToolServer(0, 0.3)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/multiply"
    try:
        start = time.perf_counter()
        with httpx.Client() as client:
            assert client.post(url, json={"a": 347, "b": 8215}).json() == {"result": 2850605}
        assert time.perf_counter() - start >= 0.3

        async def eight():
            import asyncio
            async with httpx.AsyncClient() as client:
                return await asyncio.gather(*(client.post(url, json={"a": k, "b": 2}) for k in range(8)))
        import asyncio
        start = time.perf_counter()
        replies = asyncio.run(eight())
        assert [r.json()["result"] for r in replies] == [2 * k for k in range(8)]
        assert time.perf_counter() - start < 0.3 * 8 / 2                       # concurrently, not in turn
        assert server.calls == 9
    finally:
        server.shutdown()
        server.server_close()


def test_the_benchmark_script_calls_the_tool_twice_then_answers():
    row = latency.rows(4)[0]
    turns = latency.scripted_turns(row)
    calls = [json.loads(t.split("\n")[1]) for t in turns[:2]]
    assert calls == [{"name": "multiply", "arguments": {"a": row["a"], "b": row["b"]}},
                     {"name": "multiply", "arguments": {"a": row["b"], "b": row["a"]}}]
    assert turns[2] == f"<answer>{row['answer']}</answer>"
    assert latency.tool_schema() == {"name": "multiply", "description": "Multiply two integers.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "description": "The first factor."},
                                         "b": {"type": "integer", "description": "The second factor."}},
        "required": ["a", "b"]}}
