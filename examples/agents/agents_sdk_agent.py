"""The calculator agent of `calculator_agent` written with the OpenAI Agents SDK (openai-agents,
the `agents` extra): an `Agent` with two `@function_tool`s, run by `Runner.run` on a Chat
Completions model (`run`) or on the Responses API, the SDK's default (`run_responses`). Nothing
here knows turnrl; turnrl trains it unmodified through its gateway (docs/agents.md):

    dvc exp run -S env.name=agent -S '++env.options.program=examples.agents.agents_sdk_agent:run' \
                -S '++env.options.demonstration=examples.agents.calculator_agent:demonstrate' \
                -S '++env.options.rows=turnrl.data.synthetic:product_rows'

(`rows`: the task rows of `data.train_set: synthetic`, the default; leave it out when
data.train_set and data.heldout_set name files of your own.)

Deployed, the same function runs against any OpenAI-compatible server; only `base_url` and
`api_key` say where the model is:

    asyncio.run(run({"prompt": "Compute 347 * 8215.", "answer": "2850605"},
                    base_url="http://localhost:8000/v1", api_key="..."))

The task: multiply two 3-digit numbers (turnrl's synthetic products); reward 1.0 for
<answer>N</answer> with the right product. The demonstration hook is calculator_agent's: the
tools and the answer format are the same, so the same assistant turns drive this program.
"""
from __future__ import annotations

from agents import (Agent, MaxTurnsExceeded, ModelBehaviorError, OpenAIChatCompletionsModel, OpenAIResponsesModel,
                    Runner, function_tool, set_tracing_disabled)
from openai import AsyncOpenAI

from examples.agents import calculator_agent

__all__ = ["run", "run_responses"]

MAX_TURNS = 3           # model calls per episode, as in calculator_agent
set_tracing_disabled(True)   # the SDK would otherwise export traces to OpenAI's servers


def tool_error(context, error: Exception) -> str:
    """A failing tool answers the model with the error, as calculator_agent's tools do (the
    SDK's default message does not say what was wrong)."""
    return f"Error: {type(error).__name__}: {error}"


# the agent's own functions, their schemas from their docstrings
calculator = function_tool(calculator_agent.calculator, failure_error_function=tool_error)
count_digits = function_tool(calculator_agent.count_digits, failure_error_function=tool_error)


async def run(task: dict, base_url: str, api_key: str) -> float:
    """One episode: the SDK's loop calls the model, runs the tools it asks for and stops at a
    reply with no tool call (the final output) or after MAX_TURNS calls. Returns the reward:
    1.0 for the right product, 0.0 otherwise. What the model gets wrong is a reward of 0, not
    an exception: an exception would end the episode as an environment error."""
    return await _episode(task, base_url, api_key, OpenAIChatCompletionsModel)


async def run_responses(task: dict, base_url: str, api_key: str) -> float:
    """The same episode on the Responses API (`OpenAIResponsesModel`, the SDK's default model):
    `env.options.program=examples.agents.agents_sdk_agent:run_responses`."""
    return await _episode(task, base_url, api_key, OpenAIResponsesModel)


async def _episode(task: dict, base_url: str, api_key: str, model_class) -> float:
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        agent = Agent(name="calculator", instructions=calculator_agent.SYSTEM, tools=[calculator, count_digits],
                      model=model_class(model="policy", openai_client=client))
        try:
            result = await Runner.run(agent, task["prompt"], max_turns=MAX_TURNS)
        except (MaxTurnsExceeded, ModelBehaviorError):
            return 0.0   # still calling tools at the limit, or a call of a tool it does not have: no answer
        return calculator_agent.grade(str(result.final_output or ""), task["answer"])
