"""`code_tool` with a slow tool: every `<code>` call first waits a seeded, long-tailed delay
(lognormal, median `latency_median_s`, sigma `latency_sigma`: with the defaults 0.3 s median and
p99 = 0.3 x e^(2.326 x 1.25) = 5.5 s), as a remote tool, a sandbox on a busy node or an API does.
The environment's `step` is a coroutine, so every trajectory's pending call waits at once
(the rollout runs them on its event loop), and the delay of a call is a function of
(latency_seed, the problem, the call's number, its text): the same call waits the same time
in every mode that makes it. A row with `"tool_delay": false` runs its calls without the wait:
benchmarks/async_rl.py --scoring-without-delay gives its held-out rows that, so that scoring
(a measurement, the same for every mode) does not pay the slowest of its few hundred delays.

    env.name: examples.slow_tools.env:ENV      # what benchmarks/async_rl.py trains on

Its synthetic task and demonstrations are code_tool's, so it shares code_tool's warm start.
"""
from __future__ import annotations

import asyncio
import math
import random

from pydantic import Field

from turnrl.data import synthetic
from turnrl.envs.base import EnvSpec, StepResult
from turnrl.envs.code_tool import CodeToolEnv, CodeToolOptions, parse_action


class SlowCodeToolEnv(CodeToolEnv):
    def __init__(self, latency_median_s: float = 0.3, latency_sigma: float = 1.25, latency_seed: int = 0,
                 **code_tool_options):
        super().__init__(**code_tool_options)
        self.median, self.sigma, self.seed = latency_median_s, latency_sigma, latency_seed

    def delay_s(self, text: str) -> float:
        if not self.example.get("tool_delay", True):
            return 0.0
        rng = random.Random(f"{self.seed}:{self.example.get('id', self.example.get('prompt'))}:{self.tool_calls}:{text}")
        return rng.lognormvariate(math.log(self.median), self.sigma)

    async def step(self, text: str) -> StepResult:
        if parse_action(text)[0] == "code":
            await asyncio.sleep(self.delay_s(text))
        return await asyncio.to_thread(CodeToolEnv.step, self, text)   # the sandbox run, off the event loop


class SlowCodeToolOptions(CodeToolOptions):
    latency_median_s: float = Field(0.3, gt=0, description="median seconds a tool call waits before it runs")
    latency_sigma: float = Field(1.25, ge=0, description="sigma of the lognormal delay (its long tail)")
    latency_seed: int = Field(0, description="the delays' seed")


ENV = EnvSpec(factory=SlowCodeToolEnv, options=SlowCodeToolOptions, task=synthetic.TASKS["code_tool"],
              name="slow_code_tool")
