"""The agent environment's warm start and synthetic rows, from the hooks its options name.

    env.options.demonstration: my_agents.solver:demonstrate    # (task, rng, good) -> assistant turns
    env.options.rows: my_agents.solver:rows                    # (count, *, seed, split, exclude) -> rows

A demonstration is the list of assistant messages a good (or, with good False, a poor) agent
would send for the row, as the model writes them (tool calls in its own format, e.g. Hermes'
<tool_call>{...}</tool_call>). The gateway answers the real program's calls with them one by one
(`AgentRunner.replay`), so the warm start trains on the conversations the program really builds.
"""
from __future__ import annotations

from turnrl.data.synthetic import SyntheticTask
from turnrl.plugins import PluginError, load_object


def agent_task(options) -> SyntheticTask | None:
    """A SyntheticTask from `options.demonstration` and `options.rows`, or None if neither is set."""
    if not options.demonstration and not options.rows:
        return None

    def hook(path: str, key: str):
        fn = load_object(path, key)
        if not callable(fn):
            raise PluginError(f"{key} = {path!r}: {fn!r} is not callable")
        return fn
    demonstrate = hook(options.demonstration, "env.options.demonstration") if options.demonstration else None
    rows = hook(options.rows, "env.options.rows") if options.rows else None
    # with rows of its own the demonstration knows them; without, it takes any row with an answer
    return SyntheticTask(name="agent", rows=rows, demonstration=demonstrate, any_row=rows is None)
