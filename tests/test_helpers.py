"""turnrl.envs.helpers: the one cache of long-lived helpers (tool boxes, verifiers bridges, OpenEnv
servers) that environments share in a process. The real helpers are exercised by test_tools,
test_tool_faults, test_ecosystem_verifiers and test_ecosystem_openenv; here the cache's rules."""
import time

import pytest

from turnrl.envs import helpers as helpers_module
from turnrl.envs.helpers import Helpers
from turnrl.plugins import PluginError


class Process:
    """Stands in for a helper process: alive until it dies or is closed."""

    def __init__(self, name: str):
        self.name, self.alive, self.closed = name, True, 0

    def close(self) -> None:
        self.closed += 1
        self.alive = False


def test_a_live_helper_is_shared_and_a_dead_one_replaced():
    kind = Helpers(retry_s=10.0, failures=(PluginError,))
    first = kind.get("a", lambda: Process("a1"))
    assert kind.get("a", lambda: Process("a2")) is first          # shared while alive
    assert kind.get("b", lambda: Process("b1")).name == "b1"      # keyed by configuration
    first.alive = False                                           # it died (killed, exited)
    second = kind.get("a", lambda: Process("a2"))
    assert second.name == "a2" and first.closed == 1              # what was left of it closed
    kind.close()
    assert second.closed == 1 and kind.live == {}


def test_a_failed_start_is_raised_again_for_retry_s_then_retried(monkeypatch):
    kind = Helpers(retry_s=10.0, failures=(PluginError,))
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    attempts = []

    def fails():
        attempts.append(1)
        raise PluginError("env.options.url: nothing answers at 127.0.0.1:9")
    with pytest.raises(PluginError, match="nothing answers") as first:
        kind.get("a", fails)
    with pytest.raises(PluginError) as again:
        kind.get("a", lambda: Process("never started"))
    assert again.value is first.value and len(attempts) == 1      # no new start within retry_s
    now[0] += 10.5
    assert kind.get("a", lambda: Process("a")).name == "a"        # tried again after it
    assert kind.failed == {}


def test_other_errors_are_not_remembered():
    kind = Helpers(retry_s=10.0, failures=(PluginError,))

    def bug():
        raise KeyError("a bug, not a failed start")
    with pytest.raises(KeyError):
        kind.get("a", bug)
    assert kind.get("a", lambda: Process("a")).name == "a"


def test_every_kind_closes_at_exit():
    kinds = [Helpers(retry_s=1.0, failures=(PluginError,)) for _ in range(2)]
    made = [kind.get("x", lambda: Process("x")) for kind in kinds]
    helpers_module.close_all()                                     # what atexit runs
    assert [p.closed for p in made] == [1, 1] and all(kind.live == {} for kind in kinds)
