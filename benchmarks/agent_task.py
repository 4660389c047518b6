"""The benchmark's built-in twin of examples/agents/calculator_agent.py: the `tools` environment
with the agent's own two functions, warm-started on the agent's own demonstration hook. The prompt
(system message, user message, the two tools' schemas), the tool results, the stop rule (a reply
without a tool call is the answer) and the warm start's sequences are then the gateway's token for
token, so the two rows start from the same model and differ only in how episodes run.

    dvc exp run -S env.name=benchmarks.agent_task:ENV \\
        -S '++env.options.functions=[examples.agents.calculator_agent:calculator,examples.agents.calculator_agent:count_digits]'
"""
from __future__ import annotations

from examples.agents.calculator_agent import demonstrate
from turnrl.data import synthetic
from turnrl.envs.base import EnvSpec
from turnrl.envs.tools import ToolsOptions, make_tools_env

ENV = EnvSpec(factory=make_tools_env, options=ToolsOptions, name="tools_agent_twin",
              # no `key`: rows split by prompt as the agent environment's task splits them, so both rows
              # draw the same training rows and warm-start on the same sequences
              task=synthetic.SyntheticTask("tools_agent_twin", synthetic.product_rows, demonstration=demonstrate))
