"""A small verifiers 0.4.0 environment for turnrl's `env.name: verifiers` (and its tests).

Two tasksets in one module, each a `vf.Taskset` exported through `__all__` as the library's
loader (`vf.load_taskset`) requires, so each lives in its own module: this one is the
single-turn taskset `examples.verifiers_env.arith_vf`; `guess_vf` is the multi-turn one.

Single turn: "Compute a + b." with two weighted rewards, `correct` (weight 1.0: the last
number of the reply is the sum) and `concise` (weight 0.5: the reply has at most 20 words).
The rows are built in memory (no download).
"""
import re

import verifiers.v1 as vf

SYSTEM_PROMPT = "Answer with the number only."


class ArithData(vf.TaskData):
    answer: str = ""


class ArithTaskConfig(vf.TaskConfig):
    pass


class ArithTask(vf.Task[ArithData, vf.State, ArithTaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, task, trace) -> float:
        numbers = re.findall(r"-?\d+", trace.last_reply)
        return 1.0 if numbers and numbers[-1] == task.answer else 0.0

    @vf.reward(weight=0.5)
    async def concise(self, trace) -> float:
        return 1.0 if len(trace.last_reply.split()) <= 20 else 0.0


class ArithTasksetConfig(vf.TasksetConfig):
    size: int = 64
    seed: int = 0


class ArithTaskset(vf.Taskset[ArithTask, ArithTasksetConfig]):
    def load(self):
        import random
        rng = random.Random(self.config.seed)
        for i in range(self.config.size):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            yield ArithTask(ArithData(id=f"add-{i}", prompt=f"Compute {a} + {b}.", system_prompt=SYSTEM_PROMPT,
                                      answer=str(a + b)), self.config.task)


__all__ = ["ArithTaskset"]
