"""How an environment's episodes are rolled out: the extension point behind `EnvSpec.runner`.

Every caller that rolls out (the rollout actor, synchronous and asynchronous; the evaluation;
the warm start's replays) asks the environment's runner, never a loop directly:

    runner = runner_for(spec, model_dir)                       # StepRunner unless the spec names one
    trajs  = runner.run(engine, examples, make_env, fmt, budgets, n=..., temperature=..., ...)
    stream = runner.stream(engine, make_env, fmt, budgets, n=..., max_groups=..., ...)   # async training
    t      = runner.replay(make_env, fmt, example, turns)       # a scripted episode (warm start)

`run` returns n trajectories per example, trajectory i of example i // n, as `run_rollouts`
does; the options `on_trajectory_done(t)` and `on_group_done(group)`, where given, are called as
each trajectory ends and as each example's n have ended (the training actor scores each
trajectory then, or each group where a scorer needs whole groups, while the rest of the batch
generates; a runner that ignores them has its trajectories scored when `run` returns; one whose
`run` has no `on_trajectory_done` parameter nor **options is scored group by group). A trajectory may carry `samples` (an agent program's episode of several samples): the
trainer trains those (`turnrl.gateway.samples.training_rows`), everything else reads the episode.

New weights reach a runner (or its stream) between rollouts through `load_weights(version,
apply, weights)`: `apply()` loads them into the policy's engine, `weights()` gives them again as
a fresh iterable of (name, tensor) for a runner that keeps a copy (the games' past selves,
`turnrl.games.league`). Call it through `hand_weights`, which leaves `weights` out for a runner
whose `load_weights` takes only (version, apply). A runner with a `bind(model_dir)` method is
told the policy's model folder (the weights its engine started from) by `runner_for`.

`StepRunner` is the built-in: environments with `reset`/`step` in the multi-turn loop
(`turnrl.rollout.multi_turn`, and `turnrl.rollout.stream` for asynchronous training). The agent
gateway (`env.name: agent`, `turnrl.gateway.runner.AgentRunner`) is the other.
"""
from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol, Sequence

from turnrl.rollout.chat import ChatFormat
from turnrl.rollout.multi_turn import Budgets, Trajectory, replay, run_rollouts

if TYPE_CHECKING:
    import torch

#: the pushed weights again, for a runner that keeps them: a fresh iterable of (name, tensor) per call
Weights = Callable[[], Iterable[tuple[str, "torch.Tensor"]]]


class EpisodeRunner(Protocol):
    def run(self, engine: Any, examples: Sequence[dict], make_env: Callable[[], Any], fmt: ChatFormat,
            budgets: Budgets, **options: Any) -> list[Trajectory]: ...

    def stream(self, engine: Any, make_env: Callable[[], Any], fmt: ChatFormat, budgets: Budgets, **options: Any): ...

    def replay(self, make_env: Callable[[], Any], fmt: ChatFormat, example: dict, turns: Sequence[Any]) -> Trajectory: ...

    def load_weights(self, version: int, apply: Callable[[], None], weights: Weights | None = None) -> None:
        """Run `apply` (load new weights into the engine) where no request is running.
        `version`: the weight pushes so far; `weights`: the same weights again, where the caller
        has them (the rollout actor does; None elsewhere). Optional: a runner written for
        (version, apply) alone still works, called without it (`hand_weights`)."""

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

    def load_weights(self, version: int, apply: Callable[[], None], weights: Weights | None = None) -> None:
        apply()   # between two rollouts: nothing else drives the engine

    def close(self) -> None:
        pass


def runner_for(spec: Any, model_dir: str | None = None) -> EpisodeRunner:
    """A fresh runner for an EnvSpec: its own (`spec.runner()` returns the class), else
    StepRunner; told `model_dir`, the policy's model folder, where given and it has `bind`."""
    make = getattr(spec, "runner", None)
    runner = make()() if make is not None else StepRunner()
    bind = getattr(runner, "bind", None)
    if model_dir is not None and callable(bind):
        bind(str(model_dir))
    return runner


def hand_weights(target: Any, version: int, apply: Callable[[], None], weights: Weights | None = None) -> None:
    """`target.load_weights` (a runner's, or its stream's) with `weights` where it takes them
    (a parameter named weights, or **kwargs), else as (version, apply) alone."""
    method = target.load_weights
    if weights is not None and _takes(method, "weights"):
        method(version, apply, weights=weights)
    else:
        method(version, apply)


def scoring_unit(runner: Any, by_group: bool) -> str:
    """How a synchronous batch of `runner`'s is scored as it ends (turnrl.rollout.scored): by
    "group" where a scorer needs whole groups (`by_group`) or the runner reports no single
    trajectory, else by "trajectory"."""
    return "trajectory" if not by_group and _takes(runner.run, "on_trajectory_done") else "group"


def _takes(method: Callable, name: str) -> bool:
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):   # no signature to read (a builtin): the older call
        return False
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in params)
