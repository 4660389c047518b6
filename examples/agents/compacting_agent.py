"""An agent that edits its own context, so one episode gives several training samples.

Like `calculator_agent`, but before answering it compacts its conversation: the tool call and
the tool's result are replaced by one user note with the result ("The calculator says ..."), as
agents that summarise or drop old turns do. The answering call's prompt no longer extends the
first call's prompt + completion, so turnrl records two samples for the episode, each trained on
exactly the tokens the model saw, both with the episode's reward.
"""
from __future__ import annotations

from openai import OpenAI

from examples.agents.calculator_agent import SYSTEM, TOOLS, demonstrate, grade, run_tool

__all__ = ["demonstrate", "run"]


def run(task: dict, base_url: str, api_key: str) -> float:
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    question = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["prompt"]}]
    reply = client.chat.completions.create(model="policy", messages=question, tools=TOOLS).choices[0].message
    if not reply.tool_calls:
        return grade(reply.content, task["answer"])
    results = "; ".join(run_tool(c.function.name, c.function.arguments) for c in reply.tool_calls)
    compacted = question + [{"role": "user", "content": f"The tools said: {results}"}]   # the call itself dropped
    answer = client.chat.completions.create(model="policy", messages=compacted, tools=TOOLS).choices[0].message
    return grade(answer.content, task["answer"])
