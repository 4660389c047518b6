"""The calculator agent (calculator_agent.py) traced with MLflow as a deployed agent often is:
a span of its own around the episode and MLflow's autologging of the OpenAI SDK. Nothing here
knows turnrl. Trained through the gateway, its spans land in turnrl's trace of the episode, with
turnrl's record of each call (exact tokens, policy version, sample) under the autologged call
(docs/agents.md, Tracking):

    dvc exp run $(python -m turnrl.presets agent) -S '++env.options.program=examples.agents.traced_agent:run'
"""
from __future__ import annotations

import mlflow

from examples.agents import calculator_agent

mlflow.openai.autolog()


@mlflow.trace(name="calculator agent", span_type="AGENT")
def run(task: dict, base_url: str, api_key: str) -> float:
    return calculator_agent.run(task, base_url, api_key)
