"""Agent programs as environments: an OpenAI-compatible gateway in front of the rollout engines.

    program    `env.name: agent`: the user's program and its options (a function or a command)
    render     Chat Completions messages to exact token ids, sampled ids to an assistant message
    server     the HTTP server, its episodes and keys, and the thread that drives the engine
    samples    an episode's recorded calls as training samples (merged by token prefix)
    runner     the agent environment's EpisodeRunner: sync, async, evaluation, warm start
    demonstrations  the warm start's task from the options' hooks

docs/agents.md is the user's guide.
"""
from __future__ import annotations

from turnrl.envs.base import EnvSpec
from turnrl.gateway.program import AgentOptions, AgentProgram, make_program


def _runner():
    from turnrl.gateway.runner import AgentRunner
    return AgentRunner


def _task(options: dict):
    """The warm start's task from the options' hooks (`demonstration`, `rows`), or None."""
    from turnrl.gateway.demonstrations import agent_task
    return agent_task(AgentOptions(**options))


ENV = EnvSpec(factory=make_program, options=AgentOptions, name="agent", runner=_runner, task_from_options=_task)

__all__ = ["ENV", "AgentOptions", "AgentProgram", "make_program"]
