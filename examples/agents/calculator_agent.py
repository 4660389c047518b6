"""An agent written with the `openai` SDK only: a tool-calling loop with two tools in the OpenAI
`tools` format, which it runs itself, and its own stop rule. Nothing here knows turnrl; turnrl
trains it unmodified through its gateway (docs/agents.md):

    dvc exp run $(python -m turnrl.presets agent)     # configs/agent.yaml: program, demonstration, rows

Deployed, the same function runs against any OpenAI-compatible server:

    run({"prompt": "Compute 347 * 8215.", "answer": "2850605"}, base_url="http://localhost:8000/v1", api_key="...")

The task: multiply two 3-digit numbers (turnrl's synthetic products). A 1M-parameter model
cannot multiply; calling `calculator` and copying its result can.
"""
from __future__ import annotations

import json
import random
import re

from openai import OpenAI

SYSTEM = ("Solve the problem. You can call the tools; their results come back as tool messages. "
          "Give the final answer as <answer>...</answer>.")

def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses.

    Args:
        expression: The expression, e.g. 347 * 8215.
    """
    if not re.fullmatch(r"[0-9+\-*/(). ]{1,100}", expression):
        raise ValueError("only numbers, + - * / and parentheses")
    value = eval(expression, {"__builtins__": {}})   # the characters are checked above
    return str(int(value)) if float(value).is_integer() else f"{value:.10g}"


def count_digits(number: str) -> str:
    """How many digits a whole number has.

    Args:
        number: The number, e.g. 2850605.
    """
    return str(len(re.sub(r"\D", "", number)))


# The two tools in the OpenAI format (what the functions' docstrings say, so the same functions
# given to turnrl's built-in `tools` environment render the same prompt: benchmarks/agent.py)
TOOLS = [
    {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {"type": "object", "properties": {
            "expression": {"type": "string", "description": "The expression, e.g. 347 * 8215."}},
            "required": ["expression"]}}},
    {"type": "function", "function": {
        "name": "count_digits", "description": "How many digits a whole number has.",
        "parameters": {"type": "object", "properties": {
            "number": {"type": "string", "description": "The number, e.g. 2850605."}}, "required": ["number"]}}},
]

MAX_TURNS = 3


def run_tool(name: str, arguments: str) -> str:
    try:
        args = json.loads(arguments or "{}")
        tool = {"calculator": calculator, "count_digits": count_digits}[name]
        return tool(**args)
    except Exception as exc:   # a bad call is an error message for the model, as any agent would do
        return f"Error: {type(exc).__name__}: {exc}"


def grade(text: str | None, answer: str) -> float:
    found = re.findall(r"<answer>\s*(.*?)\s*</answer>", text or "", re.DOTALL)
    return 1.0 if found and found[-1].replace(",", "") == str(answer) else 0.0


_CLIENT: OpenAI | None = None


def client_for(base_url: str, api_key: str) -> OpenAI:
    """A client for this episode's URL and key on the process's one HTTP connection pool. Building
    an OpenAI client builds a TLS context (about 30 ms of CPU): one per episode, at 128 episodes a
    step, costs seconds; `with_options` derives a client from the first in well under 1 ms."""
    global _CLIENT
    if _CLIENT is None:
        _CLIENT = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    return _CLIENT.with_options(base_url=base_url, api_key=api_key)


def run(task: dict, base_url: str, api_key: str) -> float:
    """One episode: call the model, run the tools it asks for, stop at an answer (a reply with
    no tool call) or after MAX_TURNS replies. Returns the reward: 1.0 for the right product."""
    client = client_for(base_url, api_key)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["prompt"]}]
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return grade(message.content, task["answer"])
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": run_tool(call.function.name, call.function.arguments)})
    return 0.0


def demonstrate(task: dict, rng: random.Random, good: bool) -> list[str]:
    """For the embedded tiny model's warm start: the replies a good agent sends (call the
    calculator, then answer with its result), or a poor one (guess at once), in the model's own
    tool-call format (Hermes <tool_call>, as the tiny model's template renders it)."""
    if good:
        a, b = task["prompt"].removeprefix("Compute ").removesuffix(".").split(" * ")
        call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a} * {b}"}})
        return [f"<tool_call>\n{call}\n</tool_call>", f"<answer>{task['answer']}</answer>"]
    digits = len(str(task["answer"]))
    return [f"<answer>{rng.randint(10 ** (digits - 1), 10 ** digits - 1)}</answer>"]
