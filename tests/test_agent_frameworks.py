"""Agents written with frameworks, trained unmodified through the agent gateway (docs/agents.md):
the calculator agent with the OpenAI Agents SDK (examples/agents/agents_sdk_agent.py), on Chat
Completions and on the Responses API, and with LangGraph (examples/agents/langgraph_agent.py), on
both too.

    replay: the warm start's path. calculator_agent's good demonstration (call the calculator,
            then answer with its result) answers the framework's own calls, on the tiny model's
            tokenizer: the episode's reward, its calls, and how they merged into samples.
    engine: one real (untrained) vLLM engine for the module; an episode of each framework end to
            end through AgentRunner.run, as the rollout actor runs it.

Both frameworks send back the assistant message they were answered (the gateway's tool-call ids,
the content) and append the tool's result, so the gateway splices the sampled ids in and the
second call's prompt extends the first call's prompt + completion: one sample per episode.

The frameworks come with the `agents` extra (setup.sh installs it). Without it the tests skip,
except in CI (CI=true), where a missing framework is a failure.
"""
from __future__ import annotations

import importlib
import os
import random
import re
import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT))   # examples.agents, as turnrl imports env.options.program from the project root

FRAMEWORKS = {
    "agents_sdk": ("examples.agents.agents_sdk_agent:run", ("agents",)),
    "agents_sdk_responses": ("examples.agents.agents_sdk_agent:run_responses", ("agents",)),
    "langgraph": ("examples.agents.langgraph_agent:run", ("langgraph", "langchain_openai", "langchain_core")),
    "langgraph_responses": ("examples.agents.langgraph_agent:run_responses",
                            ("langgraph", "langchain_openai", "langchain_core")),
}


@pytest.fixture(params=sorted(FRAMEWORKS))
def program(request) -> str:
    """The framework's example (`module:function`); skipped where its packages are missing,
    outside CI."""
    path, modules = FRAMEWORKS[request.param]
    for module in modules:
        if os.environ.get("CI") == "true":
            importlib.import_module(module)   # in CI setup.sh installed the extra: its absence fails
        else:
            pytest.importorskip(module, reason="the agents extra: pip install -e '.[agents]'")
    return path


@pytest.fixture(scope="module")
def fmt(tiny_model_dir):
    from transformers import AutoTokenizer
    from turnrl.rollout.chat import ChatFormat
    return ChatFormat(AutoTokenizer.from_pretrained(tiny_model_dir))


@pytest.fixture(scope="module")
def row() -> dict:
    from turnrl.data.synthetic import product_rows
    return product_rows(1, seed=0, split="train", exclude=set())[0]


@pytest.fixture
def recorded(monkeypatch) -> list:
    """The gateway's episodes as they open (the runner forgets them when they end): their
    recorded calls, messages included."""
    from turnrl.gateway.server import Gateway
    episodes, opened = [], Gateway.open

    def record(self, *args, **kwargs):
        episode = opened(self, *args, **kwargs)
        episodes.append(episode)
        return episode
    monkeypatch.setattr(Gateway, "open", record)
    return episodes


def test_a_demonstration_replayed_through_the_framework_earns_the_reward_in_one_sample(program, fmt, row, recorded):
    from examples.agents.calculator_agent import demonstrate
    from turnrl.gateway.program import make_program
    from turnrl.gateway.runner import AgentRunner

    runner = AgentRunner()
    try:
        t = runner.replay(lambda: make_program(program=program), fmt, row, demonstrate(row, random.Random(0), True))
    finally:
        runner.close()
    assert t.outcome == 1.0 and t.finish == "answer", t.info
    assert t.info["calls"] == 2 and t.num_turns == 2

    first, second = recorded[-1].calls
    # each through its API: a Response's id is its completion's (call_rewards names it)
    assert first.completion_id.startswith("resp_" if program.endswith(":run_responses") else "chatcmpl-")
    # The framework sent back the assistant message it was answered (the gateway's tool-call id)
    # and the calculator's result, in the message list of its second call ...
    assert first.message["tool_calls"][0]["function"]["name"] == "calculator"
    call_id = first.message["tool_calls"][0]["id"]
    sent = second.messages[len(first.messages):]
    assert [m["role"] for m in sent] == ["assistant", "tool"]
    assert [c["id"] for c in sent[0]["tool_calls"]] == [call_id]
    assert sent[1]["tool_call_id"] == call_id and sent[1]["content"] == row["answer"]
    assert second.messages[:len(first.messages)] == first.messages   # nothing before it rewritten
    # ... so the sampled ids were spliced in: the second prompt extends the first call's prompt
    # + completion token for token, and the two calls are one sample.
    assert second.prompt_ids[:len(first.sequence)] == first.sequence
    assert len(t.samples) == 1 and t.info["samples"] == 1 and t.info["merged_frac"] == 1.0
    sample = t.samples[0]
    assert sample.prompt_ids == first.prompt_ids
    assert sample.prompt_ids + sample.response_ids == second.sequence
    assert sum(sample.loss_mask) == len(first.completion_ids) + len(second.completion_ids)
    assert sample.turn_ids[0] == 0 and sample.turn_ids[-1] == 1
    trained = [i for i, m in zip(sample.response_ids, sample.loss_mask) if m]
    assert trained == first.completion_ids + second.completion_ids
    assert fmt.tokenizer.decode(second.completion_ids, skip_special_tokens=True) == f"<answer>{row['answer']}</answer>"


# ----------------------------------------------------------------------------- the real engine
def _engine_tests_in_a_fresh_interpreter() -> None:
    """This module's engine tests in their own pytest process, as tests/test_rollout.py runs its
    vLLM tests: an in-process vLLM engine sets up torch.distributed and tears it down again, which
    breaks a DeepSpeed engine built later in the same test worker."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-m", "slow",
                           f"{__file__}::test_an_untrained_policy_runs_the_framework_end_to_end"],
                          env={**os.environ, "TURNRL_TEST_ISOLATED": "1"}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and re.search(r"\b\d+ passed", proc.stdout), proc.stdout[-4000:] + proc.stderr[-2000:]
    print(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """One vLLM engine on the untrained tiny model for the module (in the fresh interpreter;
    here None, once the tests have passed there)."""
    if not os.environ.get("TURNRL_TEST_ISOLATED"):
        _engine_tests_in_a_fresh_interpreter()
        yield None
        return
    from turnrl.rollout.engines import VLLMEngine
    yield VLLMEngine(str(tiny_model_dir), max_model_len=1024)


@pytest.mark.slow
def test_an_untrained_policy_runs_the_framework_end_to_end(engine, program, fmt, row, recorded):
    """Two episodes of the framework's program on the real engine: each ends (answer, or cut at
    the token limit), never as an environment error, and is recorded token for token: the
    engine's ids and a logprob for each, the policy version, the calls merged into samples."""
    if engine is None:   # ran in the fresh interpreter
        return
    from turnrl.gateway.program import make_program
    from turnrl.gateway.runner import AgentRunner
    from turnrl.rollout.multi_turn import ENV_ERROR, Budgets

    runner = AgentRunner()
    try:
        trajs = runner.run(engine, [row], lambda: make_program(program=program, timeout_s=300), fmt,
                           Budgets(max_turns=3, max_tokens_per_turn=32, max_tokens_total=96,
                                   max_context=engine.max_model_len), n=2, temperature=1.0, top_p=1.0)
    finally:
        runner.close()
    assert len(trajs) == 2
    episodes = recorded[-2:]
    for t in trajs:
        assert t.finish != ENV_ERROR, t.info.get("env_error")
        assert t.finish in ("answer", "truncated") and t.outcome in (0.0, 1.0)
        assert 1 <= t.info["calls"] <= 3 and t.turn_versions == [0] * t.num_turns
        assert 1 <= len(t.samples) <= t.info["calls"]
        for s in t.samples:
            assert len(s.engine_logprobs) == len(s.response_ids) == len(s.loss_mask) == len(s.turn_ids)
            assert all(lp <= 0.0 for lp, m in zip(s.engine_logprobs, s.loss_mask) if m)
            assert sum(s.loss_mask) <= 32 * t.info["calls"]
    for episode in episodes:
        for call in episode.calls:
            assert len(call.logprobs) == len(call.completion_ids) <= 32 and call.version == 0
            assert len(call.prompt_ids) + len(call.completion_ids) <= engine.max_model_len
            assert call.tools and call.messages[0]["role"] == "system"
    calls = [c for episode in episodes for c in episode.calls]
    print(f"\n{program}: {len(calls)} calls in 2 episodes, "
          f"{sum(len(t.samples) for t in trajs)} samples, finishes {[t.finish for t in trajs]}, "
          f"completion lengths {[len(c.completion_ids) for c in calls]}")
