"""The agent gateway (turnrl.gateway) with real components: the real `openai` client against the real
HTTP server, in front of the real vLLM engine for what the engine answers (ids, logprobs, usage,
streaming), and the gateway's own `ScriptedEngine` where the test is of the code around the engine
(replayed demonstrations, bad requests, programs that fail).

The vLLM tests (marked slow, last in the file) run in a pytest process of their own (`on_engine`),
started at the module's first test so it runs while the others do: an in-process vLLM engine tears
down torch.distributed when it goes, which breaks DeepSpeed engines built later in the same process
(see test_rollout.ran_in_a_fresh_interpreter). That process builds ONE engine for all of them and
reuses this process's tiny model; each test here reports its outcome there.

Agent programs written here are passed by import path as pytest imported this module (`HERE`:
"test_gateway" when tests/ is on sys.path, as under pytest's default import mode).
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))   # examples.agents

HERE = __name__
APART = os.environ.get("TURNRL_TEST_ISOLATED") == "1"
MODEL_ENV = "TURNRL_GATEWAY_TEST_MODEL"
NODE_AGENT = ROOT / "examples" / "agents" / "node_agent.mjs"
ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Compute 12 * 34."}]


# --------------------------------------------------------------------------- agent programs
def _client(base_url: str, api_key: str):
    from openai import OpenAI
    return OpenAI(base_url=base_url, api_key=api_key, max_retries=0)


def answers_once(task: dict, base_url: str, api_key: str) -> float:
    _client(base_url, api_key).chat.completions.create(model="policy", messages=[
        {"role": "user", "content": task["prompt"]}])
    return 0.5


def raises_on_row_0(task: dict, base_url: str, api_key: str) -> float:
    if task["id"].endswith("-0"):
        raise ValueError(f"no tool for {task['prompt']}")
    return answers_once(task, base_url, api_key)


def gives_no_reward(task: dict, base_url: str, api_key: str) -> None:
    answers_once(task, base_url, api_key)
    return None


def posts_its_reward(task: dict, base_url: str, api_key: str) -> None:
    import httpx
    reply = _client(base_url, api_key).chat.completions.create(model="policy", messages=[
        {"role": "user", "content": task["prompt"]}])
    httpx.post(base_url + "/turnrl/reward", headers={"Authorization": f"Bearer {api_key}"},
               json={"reward": 0.25, "components": {"format": 1.0}, "call_rewards": {reply.id: 1.0}}).raise_for_status()
    return None


def returns_late(task: dict, base_url: str, api_key: str) -> float:
    """Returns 1.0 after task["sleep_s"] seconds (a sync program cannot be stopped; it may come back
    inside the wait's grace)."""
    time.sleep(task["sleep_s"])
    return 1.0


def sleeps(task: dict, base_url: str, api_key: str) -> float:
    """Never returns in time; once released (the file task["release"] appears), calls the model
    again with its (ended) episode's key and writes what it got to task["late"]. Programs run in a
    process of their own (the program host): files, not memory, carry what the test reads."""
    import json
    import openai
    release = Path(task["release"])
    for _ in range(600):
        if release.exists():
            break
        time.sleep(0.1)
    try:
        answers_once(task, base_url, api_key)
        late = {"status": None}
    except openai.APIStatusError as exc:
        late = {"status": exc.status_code, "message": str(exc)}
    Path(task["late"]).write_text(json.dumps(late))
    return 1.0


def exits_its_interpreter(task: dict, base_url: str, api_key: str) -> float:
    if task["id"].endswith("-0"):
        os._exit(7)
    time.sleep(5)   # outlives the host: it goes with it
    return 1.0


def autologged(task: dict, base_url: str, api_key: str) -> float:
    """An agent traced with MLflow's own tools: a root span of its own and OpenAI autologging (which
    sends each call's trace context to the gateway as a `traceparent` header)."""
    import mlflow
    mlflow.openai.autolog()

    @mlflow.trace(name="my agent", span_type="AGENT")
    def solve() -> float:
        client = _client(base_url, api_key)
        messages = [{"role": "user", "content": task["prompt"]}]
        for _ in range(2):
            reply = client.chat.completions.create(model="policy", messages=messages)
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
        return 1.0
    return solve()


def says_where_it_runs(task: dict, base_url: str, api_key: str) -> dict:
    answers_once(task, base_url, api_key)
    return {"reward": 1.0, "components": {"pid": os.getpid()}}


def returns_what_the_task_says(task: dict, base_url: str, api_key: str):
    answers_once(task, base_url, api_key)
    return task["returns"]


async def sleeps_async(task: dict, base_url: str, api_key: str) -> float:
    await asyncio.sleep(60)
    return 1.0


# a command in any language: here Python, with the standard library only
CALLS_AND_PRINTS = r"""
import json, os, sys, urllib.request
task = json.loads(os.environ["TURNRL_TASK"])
assert json.loads(sys.stdin.read()) == task, "the task on stdin is TURNRL_TASK"
body = json.dumps({"model": "policy", "messages": [{"role": "user", "content": task["prompt"]}]}).encode()
request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=body, headers={
    "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
reply = json.load(urllib.request.urlopen(request))
print("some log line")
print(json.dumps({"reward": 0.75, "components": {"called": len(reply["choices"])}}))
"""


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def model_dir(request) -> Path:
    """This process's tiny model (the separate vLLM process gets the parent's: no second build)."""
    if os.environ.get(MODEL_ENV):
        return Path(os.environ[MODEL_ENV])
    return request.getfixturevalue("tiny_model_dir")


@pytest.fixture(scope="module")
def fmt(model_dir):
    from transformers import AutoTokenizer
    from turnrl.rollout.chat import ChatFormat
    return ChatFormat(AutoTokenizer.from_pretrained(model_dir))


@pytest.fixture(scope="module")
def rows():
    from turnrl.data.synthetic import product_rows
    return product_rows(2, seed=0, split="train", exclude=set())


def _runner_and_gateway(engine, fmt):
    from turnrl.gateway.program import make_program
    from turnrl.gateway.runner import AgentRunner
    runner = AgentRunner()
    _, gateway = runner.gateway(engine, fmt, make_program(program=f"{HERE}:answers_once"))
    return runner, gateway


@pytest.fixture(scope="module")
def scripted(fmt):
    """A gateway in front of the ScriptedEngine (each answer: the end-of-turn token alone)."""
    from turnrl.gateway.runner import ScriptedEngine
    engine = ScriptedEngine(fmt)
    runner, gateway = _runner_and_gateway(engine, fmt)
    yield SimpleNamespace(runner=runner, engine=engine, gateway=gateway)
    runner.close()


@pytest.fixture(scope="module")
def real(fmt, model_dir):
    """The real vLLM engine (one for the module) and a gateway in front of it."""
    assert APART, "the vLLM tests run in a process of their own (on_engine)"
    from turnrl.rollout.engines import VLLMEngine
    engine = VLLMEngine(str(model_dir), max_model_len=1024)
    runner, gateway = _runner_and_gateway(engine, fmt)
    yield SimpleNamespace(runner=runner, engine=engine, gateway=gateway)
    runner.close()


def _selected_slow(request) -> list[str]:
    """The names of this module's slow tests in this session (those not deselected)."""
    return [item.name for item in request.session.items
            if getattr(item, "module", None) is request.module and item.get_closest_marker("slow")]


@pytest.fixture(scope="module")
def apart_process(request, model_dir, tmp_path_factory):
    """This module's selected slow (vLLM) tests in a pytest process of their own, started:
    (process, its JUnit report, its output)."""
    folder = tmp_path_factory.mktemp("gateway-apart")
    report, output = folder / "report.xml", folder / "output.txt"
    tests = [f"{Path(__file__).resolve()}::{name}" for name in _selected_slow(request)]
    with open(output, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                                 "-m", "slow", *tests, f"--junitxml={report}"],
                                env={**os.environ, "TURNRL_TEST_ISOLATED": "1", MODEL_ENV: str(model_dir)},
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True)
    yield proc, report, output
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module", autouse=True)
def _start_apart_early(request):
    """Start the vLLM process at this module's first test (where its slow tests are selected), so it
    runs while the other tests do."""
    if not APART and _selected_slow(request):
        request.getfixturevalue("apart_process")


@pytest.fixture(scope="module")
def apart(apart_process) -> dict[str, tuple[str, str]]:
    """The vLLM process's outcomes: {test name: (passed | failed | skipped, what was reported)}."""
    proc, report, output = apart_process
    proc.wait(timeout=600)
    assert report.exists(), output.read_text()[-6000:]
    results: dict[str, tuple[str, str]] = {}
    for case in ET.parse(report).iter("testcase"):
        outcome, text = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, text = "failed", f"{child.get('message', '')}\n{child.text or ''}"
            elif child.tag == "skipped" and outcome == "passed":
                outcome, text = "skipped", child.get("message", "")
        results[case.get("name")] = outcome, text
    return results


def on_engine(request):
    """In the vLLM process: the `real` fixture, and the test runs. Here: the test's outcome in the vLLM
    process, reported as this test's (None: nothing more to do)."""
    if APART:
        return request.getfixturevalue("real")
    results = request.getfixturevalue("apart")
    assert request.node.name in results, f"{request.node.name} did not run in the vLLM process: {sorted(results)}"
    outcome, text = results[request.node.name]
    if outcome == "skipped":
        pytest.skip(text)
    assert outcome == "passed", text
    return None


def _episode(gateway, **limits):
    from turnrl.gateway.server import Limits
    ep = gateway.open({"prompt": "Compute 12 * 34."}, Limits(**limits))
    return ep, _client(gateway.base_url, ep.key)


def _budgets(**kw):
    from turnrl.rollout.multi_turn import Budgets
    return Budgets(**{"max_turns": 4, "max_tokens_per_turn": 16, "max_tokens_total": 256, "max_context": 1024, **kw})


def _program(**options):
    from turnrl.gateway.program import make_program
    return lambda: make_program(**options)


# --------------------------------------------------------------------------- calls merged into samples
@pytest.fixture(scope="module")
def recording():
    """An AgentRunner that keeps each episode's Call records (`.calls`) for the test to compare."""
    from turnrl.gateway.runner import AgentRunner

    class Recording(AgentRunner):
        def _trajectory(self, ep, result, fmt, started):
            self.calls = list(ep.calls)
            return super()._trajectory(ep, result, fmt, started)
    runner = Recording()
    yield runner
    runner.close()


def _replay(runner, fmt, row, agent: str):
    from examples.agents.calculator_agent import demonstrate
    return runner.replay(_program(program=f"examples.agents.{agent}:run"), fmt, row,
                         demonstrate(row, random.Random(0), True))


def test_a_conversation_the_program_extends_is_one_sample_masked_on_the_sampled_tokens(recording, fmt, rows):
    from examples.agents.calculator_agent import SYSTEM, TOOLS
    for row in rows:
        t = _replay(recording, fmt, row, "calculator_agent")
        c0, c1 = recording.calls
        assert t.finish == "answer" and t.outcome == 1.0
        assert t.info["calls"] == 2 and t.info["samples"] == 1 and t.info["merged_frac"] == 1.0
        (s,) = t.samples
        between = c1.prompt_ids[len(c0.prompt_ids) + len(c0.completion_ids):]
        assert c1.prompt_ids[:len(c0.sequence)] == c0.sequence and between
        assert s.prompt_ids == c0.prompt_ids
        assert s.response_ids == c0.completion_ids + between + c1.completion_ids
        assert s.loss_mask == [1] * len(c0.completion_ids) + [0] * len(between) + [1] * len(c1.completion_ids)
        assert [tok for tok, m in zip(s.response_ids, s.loss_mask) if m] == c0.completion_ids + c1.completion_ids
        assert s.turn_ids == [0] * (len(c0.completion_ids) + len(between)) + [1] * len(c1.completion_ids)
        # and independently of the records: the rollouts' own prompt, sampled ids and tool-result frame
        product = str(row["a"] * row["b"])
        assert c0.prompt_ids == fmt.prompt_ids(SYSTEM, row["prompt"], TOOLS)
        assert c0.completion_ids[-1] == fmt.end_of_turn_id
        assert between == fmt.observation_ids(product, "tool", after_eos=True)
        assert product in fmt.tokenizer.decode(between)
        assert t.samples[0].engine_logprobs == [0.0] * len(s.response_ids)   # the scripted engine's


def test_an_edited_context_starts_a_new_sample(recording, fmt, rows):
    row = rows[0]
    t = _replay(recording, fmt, row, "compacting_agent")
    c0, c1 = recording.calls
    assert t.finish == "answer" and t.outcome == 1.0
    assert t.info["calls"] == 2 and t.info["samples"] == 2 and t.info["merged_frac"] == 0.0
    for k, (s, c) in enumerate(zip(t.samples, (c0, c1))):
        assert s.prompt_ids == c.prompt_ids
        assert s.response_ids == c.completion_ids and s.loss_mask == [1] * len(c.completion_ids)
        assert s.turn_ids == [k] * len(c.completion_ids)
    second = fmt.tokenizer.decode(c1.prompt_ids)
    assert f"The tools said: {row['a'] * row['b']}" in second
    assert fmt.tokenizer.decode(c0.completion_ids, skip_special_tokens=True) not in second   # the call: dropped
    assert c1.prompt_ids[:len(c0.sequence)] != c0.sequence


def test_the_node_agent_replays_a_demonstration_into_one_merged_sample(recording, fmt, rows):
    if shutil.which("node") is None:
        pytest.skip("node is not installed (examples/agents/node_agent.mjs needs Node 18+)")
    from examples.agents.calculator_agent import demonstrate
    row = rows[1]
    t = recording.replay(_program(command=["node", str(NODE_AGENT)], timeout_s=60), fmt, row,
                         demonstrate(row, random.Random(0), True))
    assert t.finish == "answer" and t.outcome == 1.0, t.info    # it ran the calculator and printed 1
    assert t.info["calls"] == 2 and t.info["samples"] == 1 and t.info["merged_frac"] == 1.0


# --------------------------------------------------------------------------- bad requests
def _raises(kind, fn, *args, **kwargs):
    with pytest.raises(kind) as caught:
        fn(*args, **kwargs)
    return caught.value


def test_an_unknown_key_is_401(scripted):
    import httpx
    import openai
    client = _client(scripted.gateway.base_url, "turnrl-not-a-key")
    exc = _raises(openai.AuthenticationError, client.chat.completions.create, model="policy", messages=ASK)
    assert exc.status_code == 401 and "unknown key" in str(exc)
    posted = httpx.post(scripted.gateway.base_url + "/turnrl/reward", json={"reward": 1.0},
                        headers={"Authorization": "Bearer turnrl-not-a-key"})
    assert posted.status_code == 401 and "unknown key" in posted.json()["error"]["message"]


def test_a_call_after_the_episode_ended_is_410(scripted):
    import httpx
    import openai
    ep, client = _episode(scripted.gateway)
    client.chat.completions.create(model="policy", messages=ASK)
    scripted.gateway.close(ep, "the program returned")
    exc = _raises(openai.APIStatusError, client.chat.completions.create, model="policy", messages=ASK)
    assert exc.status_code == 410 and "ended" in str(exc) and "the program returned" in str(exc)
    posted = httpx.post(scripted.gateway.base_url + "/turnrl/reward", json={"reward": 1.0},
                        headers={"Authorization": f"Bearer {ep.key}"})
    assert posted.status_code == 410 and ep.reward is None
    assert len(ep.calls) == 1


MALFORMED = [
    pytest.param({"messages": "Compute 12 * 34."}, "`messages` must be a non-empty list", id="messages-not-a-list"),
    pytest.param({"messages": []}, "`messages` must be a non-empty list", id="no-messages"),
    pytest.param({"messages": [{"role": "robot", "content": "beep"}]}, "messages[0]: must be an object whose role is",
                 id="role-robot"),
    pytest.param({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
                 "is not text", id="image-part"),
    pytest.param({"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}]},
        "arguments are not valid JSON", id="tool-arguments-not-json"),
    pytest.param({"n": 0}, "n = 0", id="n-0"),
    pytest.param({"n": 17}, "n = 17", id="n-17"),
    pytest.param({"n": "2"}, "n = '2'", id="n-string"),
    pytest.param({"max_tokens": -1}, "max_tokens = -1: must be a positive integer", id="max-tokens-negative"),
    pytest.param({"max_tokens": 0}, "max_tokens = 0: must be a positive integer", id="max-tokens-0"),
    pytest.param({"tools": "calculator"}, "`tools` must be a list", id="tools-not-a-list"),
    pytest.param({"stop": 5}, "stop must be a string or a list", id="stop-not-strings"),
    # sampling values out of range are refused whether the episode uses them or not (sampling: policy)
    pytest.param({"top_p": 1.5}, "top_p = 1.5: must be above 0 and at most 1", id="top-p-above-1"),
    pytest.param({"top_p": 0}, "top_p = 0: must be above 0", id="top-p-0"),
    pytest.param({"temperature": -1}, "temperature = -1: must be 0 or more", id="temperature-negative"),
    pytest.param({"temperature": "hot"}, "temperature must be a finite number", id="temperature-string"),
    pytest.param({"functions": [{"name": "f", "parameters": {}}]}, "give `tools`", id="legacy-functions"),
    pytest.param({"messages": [*ASK, {"role": "assistant", "content": None,
                                      "function_call": {"name": "f", "arguments": "{}"}}]},
                 "messages[2]: `function_call`", id="legacy-function-call-message"),
    pytest.param({"tools": [{"type": "function", "name": "calculator", "parameters": {}}]},
                 "tools[0] must be {type: function, function: {name", id="tool-flat-as-in-responses"),
    pytest.param({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0] must be",
                 id="tool-without-name"),
    pytest.param({"messages": [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "", "arguments": "{}"}}]}]},
        "messages[2]: a tool call's function needs a name", id="tool-call-without-name"),
]


@pytest.mark.parametrize("body, problem", MALFORMED)
def test_a_malformed_request_is_400_naming_the_problem(scripted, body, problem):
    import openai
    ep, client = _episode(scripted.gateway)
    exc = _raises(openai.BadRequestError, client.chat.completions.create, model="policy", messages=ASK,
                  extra_body=body)
    assert exc.status_code == 400 and problem in str(exc)
    assert ep.calls == [] and ep.started_calls == 0   # a refused request spends no budget


def test_a_request_past_the_context_is_400_saying_so(scripted, fmt):
    import openai
    prompt = len(fmt.prompt_ids("Be brief.", "Compute 12 * 34."))
    ep, client = _episode(scripted.gateway, context=prompt + 10)
    exc = _raises(openai.BadRequestError, client.chat.completions.create, model="policy", messages=ASK, max_tokens=11)
    assert exc.status_code == 400 and "context holds" in str(exc) and "at most 10 more" in str(exc)
    # OpenAI's error shape: what a context-trimming agent tests
    assert exc.code == "context_length_exceeded" and exc.type == "invalid_request_error"
    client.chat.completions.create(model="policy", messages=ASK, max_tokens=10)   # exactly what fits
    assert len(ep.calls) == 1
    # a prompt the context cannot hold at all
    ep, client = _episode(scripted.gateway, context=prompt)
    exc = _raises(openai.BadRequestError, client.chat.completions.create, model="policy", messages=ASK)
    assert exc.status_code == 400 and f"the prompt has {prompt} tokens" in str(exc) and "context" in str(exc)
    assert ep.calls == []


def test_a_spent_budget_is_400(scripted):
    import openai
    ep, client = _episode(scripted.gateway, max_calls=2)
    client.chat.completions.create(model="policy", messages=ASK)
    exc = _raises(openai.BadRequestError, client.chat.completions.create, model="policy", messages=ASK, n=2)
    assert "n = 2 asks for more completions than this episode has left (1 of 2" in str(exc)   # 2 do not fit, 1 does
    assert exc.code == "budget_exceeded" and ep.started_calls == 1
    client.chat.completions.create(model="policy", messages=ASK)
    exc = _raises(openai.BadRequestError, client.chat.completions.create, model="policy", messages=ASK)
    assert exc.status_code == 400 and "call budget is spent (2 completions" in str(exc)
    assert len(ep.calls) == 2
    ep, client = _episode(scripted.gateway, max_tokens_total=1)   # each scripted answer: one token
    client.chat.completions.create(model="policy", messages=ASK)
    exc = _raises(openai.BadRequestError, client.chat.completions.create, model="policy", messages=ASK)
    assert "token budget is spent (1 sampled tokens" in str(exc)


# --------------------------------------------------------------------------- the Responses API
def test_a_responses_request_is_the_chat_request_of_its_items():
    """Responses items to chat messages: instructions the system message, a turn's text and its
    function calls one assistant message (as the gateway answered them), outputs tool results,
    reasoning dropped; function tools in the chat shape."""
    from turnrl.gateway.responses import chat_request
    chat = chat_request({
        "instructions": "Be brief.", "max_output_tokens": 20, "temperature": 0.5, "tool_choice": "required",
        "tools": [{"type": "function", "name": "calculator", "description": "Evaluate.",
                   "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}],
        "input": [
            {"role": "developer", "content": "Use the tool."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Compute 12 * 34."}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me."}]},
            {"type": "function_call", "call_id": "call_a", "name": "calculator", "arguments": '{"expression": "12*34"}'},
            {"type": "function_call", "call_id": "call_b", "name": "calculator", "arguments": '{"expression": "1"}'},
            {"type": "function_call_output", "call_id": "call_a", "output": "408"},
            {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "1"}]},
            {"type": "function_call", "call_id": "call_c", "name": "calculator", "arguments": "{}"}]})
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Use the tool."},
        {"role": "user", "content": "Compute 12 * 34."},
        {"role": "assistant", "content": "Let me.", "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "12*34"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1"}'}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "408"},
        {"role": "tool", "tool_call_id": "call_b", "content": "1"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_c", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}]}]
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "calculator", "description": "Evaluate.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]
    assert (chat["max_tokens"], chat["temperature"], chat["tool_choice"]) == (20, 0.5, "auto")
    assert chat_request({"input": "hi", "tool_choice": "none"})["messages"] == [{"role": "user", "content": "hi"}]
    assert chat_request({"input": "hi", "tool_choice": "none"})["tool_choice"] == "none"


def test_a_response_answers_with_the_recorded_call(scripted, fmt):
    """Through the openai client: the prompt is the chat path's for the same messages, the
    Response's id is the recorded call's, its text what was sampled; streamed, the same."""
    ep, client = _episode(scripted.gateway)
    reply = client.responses.create(model="policy", instructions="Be brief.", input="Compute 12 * 34.")
    (call,) = ep.calls
    assert call.prompt_ids == fmt.prompt_ids("Be brief.", "Compute 12 * 34.")
    assert reply.id == call.completion_id and reply.id.startswith("resp_") and reply.status == "completed"
    assert reply.output_text == fmt.tokenizer.decode(call.completion_ids, skip_special_tokens=True)
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (len(call.prompt_ids), len(call.completion_ids))
    events = list(client.responses.create(model="policy", input=[{"role": "user", "content": "Compute 1 + 1."}],
                                          stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.id == ep.calls[1].completion_id
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        fmt.tokenizer.decode(ep.calls[1].completion_ids, skip_special_tokens=True)


RESPONSES_MALFORMED = [
    pytest.param({"model": "policy"}, "missing `input`", id="no-input"),
    pytest.param({"input": "hi", "previous_response_id": "resp_1"}, "stores no responses", id="previous-response"),
    pytest.param({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]: 'web_search' is not served",
                 id="hosted-tool"),
    pytest.param({"input": ["hi", {"type": "item_reference", "id": "msg_1"}]}, "input[0]: an item must be an object",
                 id="item-not-an-object"),
    pytest.param({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]: items of type 'item_reference'",
                 id="item-reference"),
    pytest.param({"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "name": "f"}]},
                 "input[1]: a function_call item needs 'call_id'", id="call-without-id"),
    pytest.param({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                 "input[0]: content part", id="image-part"),
    pytest.param({"input": "hi", "tools": [{"type": "function", "parameters": {}}]},
                 "tools[0]: a function tool needs `name`", id="tool-without-name"),
    pytest.param({"input": "hi", "max_output_tokens": 0}, "max_output_tokens = 0: must be a positive integer",
                 id="max-output-tokens-0"),
]


@pytest.mark.parametrize("body, problem", RESPONSES_MALFORMED)
def test_a_malformed_responses_request_is_400_naming_the_problem(scripted, body, problem):
    import httpx
    ep, _ = _episode(scripted.gateway)
    answer = httpx.post(scripted.gateway.base_url + "/responses", json=body,
                        headers={"Authorization": f"Bearer {ep.key}"})
    assert answer.status_code == 400 and problem in answer.json()["error"]["message"], answer.text
    assert ep.calls == [] and ep.started_calls == 0


def test_a_bad_reward_post_is_400_and_changes_nothing(scripted):
    import httpx
    ep, client = _episode(scripted.gateway)
    reply = client.chat.completions.create(model="policy", messages=ASK)

    def post(body, url=scripted.gateway.base_url + "/turnrl/reward"):   # .../v1/turnrl/reward
        kw = {"content": body} if isinstance(body, str) else {"json": body}
        return httpx.post(url, headers={"Authorization": f"Bearer {ep.key}"}, **kw)
    for body, problem in [({"reward": "high"}, "reward must be a finite number, got 'high'"),
                          ({"reward": True}, "reward must be a finite number"),
                          ('{"reward": NaN}', "reward must be a finite number, got nan"),
                          ({"reward": 1.0, "components": {"format": "ok"}}, "components['format'] must be a finite"),
                          ({"reward": 1.0, "call_rewards": {"chatcmpl-nope": 1.0}},
                           "call_rewards names ['chatcmpl-nope']"),
                          ({"reward": 1.0, "bonus": 2}, "unknown field(s) ['bonus']"),
                          ("reward=1", "the body is not JSON"),
                          ([1.0], "the body must be a JSON object")]:
        answer = post(body)
        assert answer.status_code == 400, body
        assert problem in answer.json()["error"]["message"], body
    assert ep.reward is None and ep.components == {} and ep.call_rewards == {}
    root = scripted.gateway.base_url.removesuffix("/v1")   # the other route: /turnrl/reward
    answer = post({"reward": 0.5, "components": {"format": 1}, "call_rewards": {reply.id: 2.0}},
                  root + "/turnrl/reward")
    assert answer.status_code == 200 and answer.json() == {"ok": True}
    assert ep.reward == 0.5 and ep.components == {"format": 1.0} and ep.call_rewards == {reply.id: 2.0}


@pytest.mark.parametrize("field", ["components", "call_rewards"])
def test_a_reward_post_whose_components_are_not_an_object_is_400(scripted, field):
    import httpx
    ep, _ = _episode(scripted.gateway)
    answer = httpx.post(scripted.gateway.base_url + "/turnrl/reward", headers={"Authorization": f"Bearer {ep.key}"},
                        json={"reward": 1.0, field: [1.0]})
    assert answer.status_code == 400 and field in answer.json()["error"]["message"]


def test_stream_options_not_an_object_is_400_and_records_nothing(scripted):
    import httpx
    ep, _ = _episode(scripted.gateway)
    answer = httpx.post(scripted.gateway.base_url + "/chat/completions", headers={"Authorization": f"Bearer {ep.key}"},
                        json={"messages": ASK, "stream": True, "stream_options": "yes"})
    assert answer.status_code == 400 and "stream_options" in answer.json()["error"]["message"]
    assert ep.calls == []


# --------------------------------------------------------------------------- programs that fail
def test_a_program_that_raises_fails_its_own_episodes_only(scripted, fmt, rows):
    groups, ended = [], []
    trajs = scripted.runner.run(scripted.engine, rows, _program(program=f"{HERE}:raises_on_row_0"), fmt, _budgets(),
                                n=2, on_group_done=groups.append, on_trajectory_done=ended.append)
    assert len(trajs) == 4 and [t.example["id"] for t in trajs] == [rows[0]["id"]] * 2 + [rows[1]["id"]] * 2
    # each example's episodes reported once, whole, as they ended (a failed episode ends its group too)
    position = {id(t): k for k, t in enumerate(trajs)}
    assert sorted([position[id(t)] for t in g] for g in groups) == [[0, 1], [2, 3]]
    assert sorted(position[id(t)] for t in ended) == [0, 1, 2, 3]   # and each episode as it ended
    for t in trajs[:2]:
        assert t.finish == "env_error" and t.outcome == 0.0
        assert t.info["env_error"] == f"ValueError: no tool for {rows[0]['prompt']}"
        assert t.info["calls"] == 0 and t.samples == []
    for t in trajs[2:]:
        assert t.finish == "answer" and t.outcome == 0.5 and "env_error" not in t.info
        assert t.info["calls"] == 1 and len(t.samples) == 1 and t.samples[0].loss_mask == [1]


def test_a_program_that_gives_no_reward_is_an_env_error(scripted, fmt, rows):
    (t,) = scripted.runner.run(scripted.engine, rows[:1], _program(program=f"{HERE}:gives_no_reward"), fmt, _budgets())
    assert t.finish == "env_error" and t.outcome == 0.0
    assert "gave no reward" in t.info["env_error"] and t.info["calls"] == 1


def test_a_posted_reward_is_the_outcome(scripted, fmt, rows):
    (t,) = scripted.runner.run(scripted.engine, rows[:1], _program(program=f"{HERE}:posts_its_reward"), fmt, _budgets())
    assert t.finish == "answer" and "env_error" not in t.info
    assert t.outcome == 0.25 and t.info["format"] == 1.0
    assert t.turn_rewards == [1.0] and t.samples[0].turn_rewards == [1.0]


def test_what_a_program_returns_is_checked(scripted, fmt, rows):
    returns = [{"reward": 0.5, "components": {"format": 1.0}}, {"reward": 1.0, "bonus": 1},
               {"reward": 1.0, "call_rewards": {"chatcmpl-nope": 1.0}}, "0.5",
               {"reward": 1.0, "components": {"f": "x"}}]
    tasks = [dict(rows[0], returns=value) for value in returns]
    trajs = scripted.runner.run(scripted.engine, tasks, _program(program=f"{HERE}:returns_what_the_task_says"), fmt,
                                _budgets())
    assert trajs[0].finish == "answer" and trajs[0].outcome == 0.5 and trajs[0].info["format"] == 1.0
    assert all(t.finish == "env_error" and t.outcome == 0.0 for t in trajs[1:])
    assert "unknown key(s) ['bonus']" in trajs[1].info["env_error"]
    assert "call_rewards names 'chatcmpl-nope'" in trajs[2].info["env_error"]
    assert "'0.5', not a finite number" in trajs[3].info["env_error"]
    assert "components['f'] is 'x', not a finite number" in trajs[4].info["env_error"]


def test_a_returned_dict_with_components_not_an_object_fails_its_episode_only(scripted, fmt, rows):
    tasks = [dict(rows[0], returns={"reward": 1.0, "components": [1.0]}), dict(rows[1], returns=1.0)]
    trajs = scripted.runner.run(scripted.engine, tasks, _program(program=f"{HERE}:returns_what_the_task_says"), fmt,
                                _budgets())
    assert trajs[0].finish == "env_error" and "components" in trajs[0].info["env_error"]
    assert trajs[1].finish == "answer" and trajs[1].outcome == 1.0


@pytest.fixture(scope="module")
def timed_out(scripted, fmt, rows, tmp_path_factory):
    """A program that never returns (timeout_s = 2), and what its call after the timeout got."""
    import json
    folder = tmp_path_factory.mktemp("timed_out")
    task = dict(rows[0], release=str(folder / "release"), late=str(folder / "late.json"))
    start = time.perf_counter()
    (t,) = scripted.runner.run(scripted.engine, [task], _program(program=f"{HERE}:sleeps", timeout_s=2), fmt,
                               _budgets())
    took = time.perf_counter() - start
    (folder / "release").touch()
    for _ in range(200):
        if (folder / "late.json").exists():
            break
        time.sleep(0.1)
    return SimpleNamespace(trajectory=t, took=took, late=json.loads((folder / "late.json").read_text()))


def test_a_program_past_its_timeout_is_an_env_error(timed_out):
    t = timed_out.trajectory
    assert t.finish == "env_error" and t.outcome == 0.0 and t.info["calls"] == 0
    assert "timeout_s = 2" in t.info["env_error"], t.info["env_error"]
    assert timed_out.took < 15


def test_a_call_after_a_timeout_is_told_the_episode_ended(timed_out):
    assert timed_out.late["status"] == 410 and "ended" in timed_out.late["message"], timed_out.late


def test_programs_run_in_a_process_of_their_own(scripted, fmt, rows):
    trajs = scripted.runner.run(scripted.engine, rows, _program(program=f"{HERE}:says_where_it_runs"), fmt,
                                _budgets(), n=2)
    pids = {t.info["pid"] for t in trajs}
    assert all(t.finish == "answer" and t.outcome == 1.0 for t in trajs)
    assert len(pids) == 1 and pids != {os.getpid()}   # one host process, not the engine's


def test_a_programs_own_mlflow_spans_are_joined_into_its_episodes_trace(scripted, fmt, rows, tmp_path, monkeypatch):
    """Through a stage run as the train stage makes one: the program host logs the program's trace to
    the run's store and experiment, and the rollout trace takes its spans in."""
    import mlflow
    from turnrl.config import Config
    from turnrl.tracking import runs, traces
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    monkeypatch.setenv("TURNRL_PIPELINE_KEY", "unit:agent-traces")
    for name in ("MLFLOW_TRACKING_URI", "TURNRL_MLFLOW_EXPERIMENT_ID"):   # restored after the test
        monkeypatch.setenv(name, os.environ.get(name, ""))
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = Config.model_validate({"tracking": {"uri": store, "experiment": "agent-traces", "system_metrics": False}})
    with runs.stage_run("train", cfg) as run:
        (t,) = scripted.runner.run(scripted.engine, rows[:1], _program(program=f"{HERE}:autologged"), fmt, _budgets())
        plan = traces.plan(t, name="rollout · step 1 · group 0", tags={"kind": "rollout"})
        traces.log_traces(run, [plan])
    assert t.finish == "answer" and t.info["calls"] == 2
    assert all(call.get("traceparent") for call in t.info["gateway_calls"])   # sent by the autologged client
    assert len(plan.program_traces) == 1 and plan.program_traces[0].startswith("tr-")

    client = mlflow.MlflowClient(tracking_uri=store)
    program_trace = client.get_trace(plan.program_traces[0])
    assert program_trace.info.experiment_id == run.experiment_id            # the program logged beside the run
    trace_id = program_trace.info.tags["turnrl.joined_into"]
    spans = client.get_trace(trace_id).data.spans
    by_id = {s.span_id: s for s in spans}
    name_of_parent = {s.name: by_id[s.parent_id].name if s.parent_id else None for s in spans}
    assert name_of_parent["my agent"] == "rollout · step 1 · group 0"          # the program's root, in ours
    completions = sorted((s for s in spans if s.parent_id and by_id[s.parent_id].name == "my agent"),
                         key=lambda s: s.start_time_ns)
    assert [s.name for s in completions] == ["Completions", "Completions"]     # its autologged calls
    turns = sorted((s for s in spans if s.name.startswith("turn ")), key=lambda s: s.name)
    assert [s.parent_id for s in turns] == [c.span_id for c in completions]   # each call's record under the call
    llm = [s for s in spans if s.parent_id in {turn.span_id for turn in turns}]
    assert len(llm) == 2 and all(s.attributes["policy_version"] == 0 and s.attributes["tokens"] >= 1 for s in llm)
    assert name_of_parent["reward"] == "rollout · step 1 · group 0"


def test_a_program_that_ends_its_interpreter_fails_the_episodes_it_held_and_the_next_run_goes_on(scripted, fmt,
                                                                                                   rows):
    program = _program(program=f"{HERE}:exits_its_interpreter", timeout_s=30)
    start = time.perf_counter()
    trajs = scripted.runner.run(scripted.engine, rows, program, fmt, _budgets())
    assert time.perf_counter() - start < 20   # the host's end fails its episodes at once, not at their timeout
    assert [t.finish for t in trajs] == ["env_error", "env_error"]
    assert "host process exited (code 7)" in trajs[0].info["env_error"], trajs[0].info["env_error"]
    (t,) = scripted.runner.run(scripted.engine, rows[:1], _program(program=f"{HERE}:answers_once"), fmt, _budgets())
    assert t.finish == "answer" and t.outcome == 0.5


def test_a_sync_program_that_returns_after_its_timeout_is_an_env_error_not_its_reward(scripted, fmt, rows):
    """Past timeout_s the episode is a timeout, whether the program is still running when the wait
    gives up or comes back a moment later (inside the wait's grace)."""
    tasks = [dict(rows[0], sleep_s=2.5), dict(rows[1], sleep_s=0.0)]
    late, prompt = scripted.runner.run(scripted.engine, tasks, _program(program=f"{HERE}:returns_late", timeout_s=1.5),
                                       fmt, _budgets())
    assert late.finish == "env_error" and late.outcome == 0.0
    assert "returned after 2.5 s, past env.options.timeout_s = 1.5 s" in late.info["env_error"], late.info["env_error"]
    assert prompt.finish != "env_error" and prompt.outcome == 1.0   # in time: its reward


def test_an_async_program_past_its_timeout_says_so(scripted, fmt, rows):
    start = time.perf_counter()
    (t,) = scripted.runner.run(scripted.engine, rows[:1], _program(program=f"{HERE}:sleeps_async", timeout_s=1), fmt,
                               _budgets())
    assert time.perf_counter() - start < 10
    assert t.finish == "env_error"
    assert "timeout_s" in t.info["env_error"], t.info["env_error"]


def test_a_command_that_exits_non_zero_is_an_env_error(scripted, fmt, rows):
    command = [sys.executable, "-c", "import sys; sys.stderr.write('no model here\\n'); sys.exit(3)"]
    (t,) = scripted.runner.run(scripted.engine, rows[:1], _program(command=command), fmt, _budgets())
    assert t.finish == "env_error" and t.outcome == 0.0
    assert "exited with code 3: no model here" in t.info["env_error"]


def test_a_command_that_prints_its_reward_has_it_as_outcome(scripted, fmt, rows):
    (t,) = scripted.runner.run(scripted.engine, rows[:1], _program(command=[sys.executable, "-c", CALLS_AND_PRINTS]),
                               fmt, _budgets())
    assert t.finish == "answer" and "env_error" not in t.info, t.info
    assert t.outcome == 0.75 and t.info["called"] == 1.0 and t.info["calls"] == 1


def test_a_command_past_its_timeout_or_printing_no_reward_is_an_env_error(scripted, fmt, rows):
    start = time.perf_counter()
    (t,) = scripted.runner.run(scripted.engine, rows[:1],
                               _program(command=[sys.executable, "-c", "import time; time.sleep(60)"], timeout_s=1),
                               fmt, _budgets())
    assert time.perf_counter() - start < 10
    assert t.finish == "env_error" and "timeout_s = 1" in t.info["env_error"]
    (t,) = scripted.runner.run(scripted.engine, rows[:1], _program(command=[sys.executable, "-c", "print('done!')"]),
                               fmt, _budgets())
    assert t.finish == "env_error" and "is not a reward" in t.info["env_error"]


def test_a_command_that_leaves_a_child_running_ends_when_it_exits(scripted, fmt, rows, tmp_path):
    """A command that starts a helper holding its stdout and exits: the episode ends with the
    command (the helper is killed with its process group), not at timeout_s."""
    marker = tmp_path / "child_alive"
    (tmp_path / "child.py").write_text(f"import pathlib, time\ntime.sleep(5)\n"
                                       f"pathlib.Path({str(marker)!r}).write_text('yes')\n")
    (tmp_path / "agent.py").write_text(f"import subprocess, sys\n"
                                       f"subprocess.Popen([sys.executable, {str(tmp_path / 'child.py')!r}])\n"
                                       "print(0.5)\n")
    start = time.perf_counter()
    (t,) = scripted.runner.run(scripted.engine, rows[:1], _program(command=[sys.executable, str(tmp_path / "agent.py")],
                                                                     timeout_s=20), fmt, _budgets())
    assert time.perf_counter() - start < 4
    assert "env_error" not in t.info and t.outcome == 0.5
    time.sleep(6)
    assert not marker.exists()   # the helper went with the command's process group


def test_a_row_too_large_for_the_environment_reaches_the_command_on_stdin(scripted, fmt, rows):
    """TURNRL_TASK is left out for a row over 100 KB (a process's environment cannot hold it): the
    command still starts, and reads the row from stdin."""
    big = {**rows[0], "context": "x" * 300_000}
    reads_stdin = ("import json, os, sys; row = json.load(sys.stdin); "
                   "print(1.0 if len(row['context']) == 300000 and 'TURNRL_TASK' not in os.environ else 0.0)")
    (t,) = scripted.runner.run(scripted.engine, [big], _program(command=[sys.executable, "-c", reads_stdin]), fmt,
                               _budgets())
    assert "env_error" not in t.info, t.info.get("env_error")
    assert t.outcome == 1.0


def returns_a_tensor(task: dict, base_url: str, api_key: str):
    import torch
    return torch.tensor(0.5)


class _AsyncCall:
    async def __call__(self, task: dict, base_url: str, api_key: str) -> float:
        return 0.25


returns_when_awaited = _AsyncCall()


def test_a_function_s_tensor_or_awaitable_is_its_reward_and_the_host_goes_on(scripted, fmt, rows):
    """A 0-d torch tensor (it used to jam the program host: every later episode of it timed out), an
    object with `async def __call__`: their values are the rewards; the next episode runs."""
    for program, reward in (("returns_a_tensor", 0.5), ("returns_when_awaited", 0.25), ("answers_once", None)):
        (t,) = scripted.runner.run(scripted.engine, rows[:1], _program(program=f"{HERE}:{program}", timeout_s=20),
                                   fmt, _budgets())
        assert "env_error" not in t.info, (program, t.info.get("env_error"))
        assert reward is None or t.outcome == reward


def test_a_demonstration_shorter_than_the_program_s_calls_says_so(recording, fmt, rows):
    with pytest.raises(Exception) as caught:
        recording.replay(_program(program="examples.agents.calculator_agent:run"), fmt, rows[0],
                         ["<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"2 * 3\"}}\n"
                          "</tool_call>"])
    assert "the demonstration has no assistant message left for this call (it gave 1" in str(caught.value)
    assert "call budget" not in str(caught.value)   # (the budget's message named the wrong setting)


# --------------------------------------------------------------------------- the engine's output, recorded (vLLM)
# Last in the file: their process (started at the module's first test) runs while the tests above do.
@pytest.mark.slow
def test_a_call_records_the_prompt_ids_sampled_ids_and_logprobs_it_answered(request, fmt):
    real = on_engine(request)
    if real is None:
        return
    from turnrl.gateway.render import normalize_messages
    ep, client = _episode(real.gateway, max_tokens_per_call=64, context=1024)
    reply = client.chat.completions.create(model="anything", messages=ASK, logprobs=True, max_tokens=12)
    (call,) = ep.calls
    # the prompt: the Renderer's ids for these messages, and the built-in rollouts' prompt for them
    assert call.prompt_ids == real.gateway.renderer.prompt_ids(normalize_messages(ASK), [])
    assert call.prompt_ids == fmt.prompt_ids("Be brief.", "Compute 12 * 34.")
    # what was answered is what was sampled
    assert 1 <= len(call.completion_ids) <= 12
    choice = reply.choices[0]
    assert choice.message.content == fmt.tokenizer.decode(call.completion_ids, skip_special_tokens=True)
    assert call.text == fmt.tokenizer.decode(call.completion_ids, skip_special_tokens=False)
    content = choice.logprobs.content
    assert len(content) == len(call.completion_ids) == len(call.logprobs)
    assert [t.logprob for t in content] == call.logprobs
    assert [t.model_extra["token_id"] for t in content] == call.completion_ids
    # the engine's logprobs of those tokens (scored again by vLLM: the policy's, not made up)
    assert all(lp <= 0 for lp in call.logprobs) and min(call.logprobs) < -0.01
    scored = real.engine.prompt_logprobs([call.prompt_ids + call.completion_ids])[0][len(call.prompt_ids):]
    assert call.logprobs == pytest.approx(scored, abs=1e-3)
    assert reply.usage.prompt_tokens == len(call.prompt_ids)
    assert reply.usage.completion_tokens == len(call.completion_ids)
    assert reply.usage.total_tokens == len(call.prompt_ids) + len(call.completion_ids)
    assert call.finish == "stop" if len(call.completion_ids) < 12 else call.finish in ("length", "stop")
    assert choice.finish_reason == call.finish
    assert reply.id == call.completion_id and call.version == 0 and reply.system_fingerprint == "turnrl-v0"
    assert ep.sampled_tokens == len(call.completion_ids)


@pytest.mark.slow
def test_n_2_samples_two_calls_of_one_prompt_within_the_per_call_cap(request, fmt):
    real = on_engine(request)
    if real is None:
        return
    ep, client = _episode(real.gateway, max_tokens_per_call=6, context=1024)
    reply = client.chat.completions.create(model="policy", messages=ASK, n=2)   # no max_tokens: the cap
    assert len(reply.choices) == 2 and len(ep.calls) == 2
    assert [c.completion_id for c in ep.calls] == [reply.id, f"{reply.id}-1"]   # choice 0 keeps the response id
    assert ep.calls[0].prompt_ids == ep.calls[1].prompt_ids == fmt.prompt_ids("Be brief.", "Compute 12 * 34.")
    for choice, call in zip(reply.choices, ep.calls):
        assert 1 <= len(call.completion_ids) <= 6
        assert choice.message.content == fmt.tokenizer.decode(call.completion_ids, skip_special_tokens=True)
        assert choice.finish_reason == call.finish
    assert reply.usage.completion_tokens == sum(len(c.completion_ids) for c in ep.calls)
    assert ep.started_calls == 2


@pytest.mark.slow
def test_models_lists_the_policy(request):
    real = on_engine(request)
    if real is None:
        return
    _, client = _episode(real.gateway)
    assert [m.id for m in client.models.list().data] == ["turnrl-policy"]


@pytest.mark.slow
def test_a_streamed_answer_reassembles_to_the_recorded_call(request, fmt):
    real = on_engine(request)
    if real is None:
        return
    ep, client = _episode(real.gateway, max_tokens_per_call=10, context=1024)
    chunks = list(client.chat.completions.create(model="policy", messages=ASK, stream=True, logprobs=True,
                                                 stream_options={"include_usage": True}))
    (call,) = ep.calls
    with_choices = [c for c in chunks if c.choices]
    assert {c.id for c in chunks} == {call.completion_id}
    assert with_choices[0].choices[0].delta.role == "assistant"
    joined = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert joined == fmt.tokenizer.decode(call.completion_ids, skip_special_tokens=True)
    assert [c.choices[0].finish_reason for c in with_choices if c.choices[0].finish_reason] == [call.finish]
    assert with_choices[-1].choices[0].finish_reason == call.finish
    streamed = [t.logprob for c in with_choices if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert streamed == (call.logprobs if joined else [])   # they come with the content chunk
    assert chunks[-1].usage.completion_tokens == len(call.completion_ids)
    assert chunks[-1].usage.prompt_tokens == len(call.prompt_ids)


@pytest.mark.slow
def test_a_streamed_response_reassembles_to_the_recorded_call(request, fmt):
    """The Responses API's events on the engine's own answer: the text deltas join to what was
    sampled, the final Response is the recorded call's, its usage the call's token counts."""
    real = on_engine(request)
    if real is None:
        return
    ep, client = _episode(real.gateway, max_tokens_per_call=10, context=1024)
    events = list(client.responses.create(model="policy", instructions="Be brief.", input="Compute 12 * 34.",
                                          stream=True, max_output_tokens=10))
    (call,) = ep.calls
    sampled = fmt.tokenizer.decode(call.completion_ids, skip_special_tokens=True)
    assert call.prompt_ids == fmt.prompt_ids("Be brief.", "Compute 12 * 34.")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == sampled
    final = events[-1].response
    assert final.id == call.completion_id and final.output_text == sampled
    assert events[-1].type == ("response.incomplete" if call.finish == "length" else "response.completed")
    assert (final.usage.input_tokens, final.usage.output_tokens) == (len(call.prompt_ids), len(call.completion_ids))


@pytest.mark.slow
def test_the_node_agent_runs_against_the_engine(request, fmt, rows):
    real = on_engine(request)
    if real is None:
        return
    if shutil.which("node") is None:
        pytest.skip("node is not installed (examples/agents/node_agent.mjs needs Node 18+)")
    (t,) = real.runner.run(real.engine, rows[:1], _program(command=["node", str(NODE_AGENT)], timeout_s=60), fmt,
                           _budgets(max_turns=3, max_tokens_per_turn=16))
    assert t.finish != "env_error", t.info.get("env_error")
    assert t.info["calls"] >= 1 and len(t.samples) >= 1
    assert t.outcome in (0.0, 1.0)
    assert t.turn_texts[0] and len(t.samples[0].response_ids) >= 1


def test_a_request_the_engine_refuses_fails_alone(fmt):
    """One request whose sampling options the engine rejects gets its own error; the engine loop
    goes on serving every other request (it used to stop, failing every episode)."""
    from turnrl.gateway.runner import ScriptedEngine
    from turnrl.gateway.server import EngineLoop

    class Picky(ScriptedEngine):
        def stepper(self, **_):
            inner = super().stepper()

            class Stepper:
                def add(self, key, prompt, max_tokens, seed, options=None):
                    if (options or {}).get("top_p") == -1:
                        raise ValueError("top_p has to be a float > 0 and <= 1")
                    inner.add(key, prompt, max_tokens, seed, options)

                def __getattr__(self, name):
                    return getattr(inner, name)
            return Stepper()

    loop = EngineLoop(Picky(fmt))
    try:
        bad = loop.submit([1, 2], 4, {"top_p": -1, "script": "x"})
        with pytest.raises(RuntimeError, match="refused this request: ValueError"):
            bad.result(timeout=30)
        sample, version = loop.submit([1, 2], 4, {"script": "42"}).result(timeout=30)
        assert fmt.tokenizer.decode(sample.token_ids).startswith("42") and loop.error is None
    finally:
        loop.stop()


def test_a_streamed_turn_of_tool_calls_only_keeps_its_logprobs():
    """Chat Completions chunks: the sampled tokens' logprobs ride on the content chunk, or on the
    first chunk when the turn is tool calls alone (they were dropped)."""
    from turnrl.gateway.server import _chunks
    logprobs = {"content": [{"token": "<", "logprob": -0.5, "bytes": [60], "top_logprobs": [], "token_id": 9}]}
    call = {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}
    for message in ({"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "assistant", "content": "Let me compute.", "tool_calls": [call]}):
        response = {"id": "chatcmpl-1", "created": 0, "model": "policy", "system_fingerprint": "turnrl-v0",
                    "usage": {}, "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls",
                                              "logprobs": logprobs}]}
        chunks = [json.loads(e[len("data: "):]) for e in _chunks(response, False) if e != "data: [DONE]\n\n"]
        carried = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0].get("logprobs")]
        assert carried == [logprobs], message   # once, whether or not the turn has text


def test_a_model_is_described_by_its_id(scripted):
    import httpx
    base = scripted.gateway.base_url
    listed = httpx.get(base + "/models").json()["data"][0]["id"]
    assert httpx.get(f"{base}/models/{listed}").json()["id"] == listed
    missing = httpx.get(f"{base}/models/gpt-4o")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_half_an_emoji_is_400_naming_the_message(scripted):
    """A lone surrogate (a JavaScript client that cut an emoji in two; Python's openai client cannot
    send one) is a 400 naming the message, not a 500 from the tokenizer."""
    import httpx
    ep, _ = _episode(scripted.gateway)
    body = b'{"model": "policy", "messages": [{"role": "user", "content": "half an emoji \\ud83d"}]}'
    answer = httpx.post(scripted.gateway.base_url + "/chat/completions", content=body,
                        headers={"Authorization": f"Bearer {ep.key}", "Content-Type": "application/json"})
    assert answer.status_code == 400
    assert "messages[0]: content is not valid Unicode" in answer.json()["error"]["message"]
    assert ep.started_calls == 0


def test_logprob_bytes_join_back_into_the_text_in_both_tokenizer_kinds(fmt):
    """`logprobs[].bytes`: a token that is part of a character (é, an emoji) carries its own
    bytes, so a client joining them gets the text back; decoding such a token alone gives the
    replacement character, whose bytes were sent before."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from turnrl.gateway.render import token_bytes
    from turnrl.rollout.chat import is_byte_level
    text = "Résumé 🎉 naïve 12"
    # SentencePiece's kind: ▁ for a space, bytes the vocabulary lacks as <0xC3> tokens (Llama 2, Mistral v0.1)
    sentencepiece = Tokenizer(models.BPE(byte_fallback=True))
    sentencepiece.pre_tokenizer = pre_tokenizers.Metaspace()
    sentencepiece.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                               decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    sentencepiece.train_from_iterator(["Resume naive plain text 12"] * 10, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]))
    byte_fallback = PreTrainedTokenizerFast(tokenizer_object=sentencepiece, eos_token="</s>")
    for tokenizer, expected in ((fmt.tokenizer, text), (byte_fallback, " " + text)):   # (Metaspace's leading ▁)
        ids = tokenizer.encode(text, add_special_tokens=False)
        byte_level = is_byte_level(tokenizer)
        assert byte_level == (tokenizer is fmt.tokenizer)
        assert b"".join(bytes(token_bytes(tokenizer, i, byte_level)) for i in ids) == expected.encode("utf-8")
        alone = [tokenizer.decode([i]) for i in ids]
        assert "\ufffd" in alone   # what the bytes were taken from before
