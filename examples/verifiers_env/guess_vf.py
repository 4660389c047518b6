"""A multi-turn verifiers 0.4.0 environment: guess a number from 1 to 100 with feedback.

verifiers 0.4.0 writes a multi-turn environment as an `Env` whose `run(task, agents)` holds an
interaction open and answers each reply with the next user turn (`await solver.turn(message)`);
the loader (`vf.load_environment`) picks it because the taskset's module exports it. The
exchange ends when `run` returns (a right guess), when the solver's `max_turns` is reached, or
when the task's `@vf.stop` fires (the reply gives up). Rewards: `solved` (weight 1.0) and
`few_turns` (weight 0.25: 1 / the number of guesses).
"""
import random
import re

import verifiers.v1 as vf

SYSTEM_PROMPT = "Guess the number. Reply with one number per turn."


class GuessData(vf.TaskData):
    answer: str = ""


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def solved(self, task, trace) -> float:
        return 1.0 if _guess(trace.last_reply) == int(task.answer) else 0.0

    @vf.reward(weight=0.25)
    async def few_turns(self, trace) -> float:
        return 1.0 / max(1, trace.num_turns)

    @vf.stop
    async def gave_up(self, trace: vf.Trace) -> bool:
        return "give up" in trace.last_reply.lower()


class GuessTasksetConfig(vf.TasksetConfig):
    size: int = 32
    seed: int = 0


class GuessTaskset(vf.Taskset[GuessTask, GuessTasksetConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        for i in range(self.config.size):
            yield GuessTask(GuessData(id=f"guess-{i}", prompt="I am thinking of a number from 1 to 100. Guess it.",
                                      system_prompt=SYSTEM_PROMPT, answer=str(rng.randint(1, 100))),
                            self.config.task)


class GuessEnvConfig(vf.EnvConfig):
    solver: vf.AgentConfig = vf.AgentConfig(max_turns=4)


def _guess(text: str) -> int | None:
    numbers = re.findall(r"-?\d+", text)
    return int(numbers[-1]) if numbers else None


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        target = int(task.data.answer)
        async with agents.solver.interaction(task) as solver:
            reply = await solver.turn()          # the prompt opens: take the first guess
            while not reply.terminated:
                guess = _guess(reply.last_reply)
                if guess == target:
                    return
                hint = "Not a number." if guess is None else ("Higher." if guess < target else "Lower.")
                reply = await solver.turn(hint)


__all__ = ["GuessEnv", "GuessTaskset"]
