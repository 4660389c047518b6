"""How an environment's episodes are rolled out: the extension point behind `EnvSpec.runner`.

Every caller that rolls out (the rollout actor, synchronous and asynchronous; the evaluation;
the warm start's replays) asks the environment's runner, never a loop directly:

    runner = runner_for(spec)                                  # StepRunner unless the spec names one
    trajs  = runner.run(engine, examples, make_env, fmt, budgets, n=..., temperature=..., ...)
    stream = runner.stream(engine, make_env, fmt, budgets, n=..., max_groups=..., ...)   # async training
    t      = runner.replay(make_env, fmt, example, turns)       # a scripted episode (warm start)

`run` returns n trajectories per example, trajectory i of example i // n, as `run_rollouts`
does; the option `on_group_done(group)`, where given, is called as each example's n have ended
(the training actor scores a group then, while the rest of the batch generates; a runner that
ignores it has its groups scored when `run` returns). A trajectory may carry `samples` (an agent program's episode of several samples): the
trainer trains those (`turnrl.gateway.samples.training_rows`), everything else reads the episode.

`StepRunner` is the built-in: environments with `reset`/`step` in the multi-turn loop
(`turnrl.rollout.multi_turn`, and `turnrl.rollout.stream` for asynchronous training). The agent
gateway (`env.name: agent`, `turnrl.gateway.runner.AgentRunner`) is the other.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

from turnrl.rollout.chat import ChatFormat
from turnrl.rollout.multi_turn import Budgets, Trajectory, replay, run_rollouts


class EpisodeRunner(Protocol):
    def run(self, engine: Any, examples: Sequence[dict], make_env: Callable[[], Any], fmt: ChatFormat,
            budgets: Budgets, **options: Any) -> list[Trajectory]: ...

    def stream(self, engine: Any, make_env: Callable[[], Any], fmt: ChatFormat, budgets: Budgets, **options: Any): ...

    def replay(self, make_env: Callable[[], Any], fmt: ChatFormat, example: dict, turns: Sequence[Any]) -> Trajectory: ...

    def load_weights(self, version: int, apply: Callable[[], None]) -> None:
        """Run `apply` (load new weights into the engine) where no request is running."""

    def close(self) -> None: ...


class StepRunner:
    """The built-in runner: `reset`/`step` environments in the multi-turn loop."""

    def run(self, engine, examples, make_env, fmt, budgets, **options) -> list[Trajectory]:
        return run_rollouts(engine, examples, make_env, fmt, budgets, **options)

    def stream(self, engine, make_env, fmt, budgets, **options):
        from turnrl.rollout.stream import Stream
        return Stream(engine, make_env, fmt, budgets, **options)

    def replay(self, make_env, fmt, example, turns) -> Trajectory:
        return replay(make_env(), fmt, example, list(turns))

    def load_weights(self, version: int, apply: Callable[[], None]) -> None:
        apply()   # between two rollouts: nothing else drives the engine

    def close(self) -> None:
        pass


def runner_for(spec: Any) -> EpisodeRunner:
    """A fresh runner for an EnvSpec: its own (`spec.runner()` returns the class), else StepRunner."""
    make = getattr(spec, "runner", None)
    return make()() if make is not None else StepRunner()
