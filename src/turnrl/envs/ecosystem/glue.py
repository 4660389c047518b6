"""What the ecosystem adapters share: importing their library, and which of its numbers become info.

- `import_library(module, where=, what=)`: the adapter's library, imported on first use, or a
  one-line PluginError `<key>: the <library> library is not importable (...); install the ecosystem
  extra: pip install -e '.[ecosystem]'`. It is `turnrl.plugins.import_library`, re-exported: the
  guard lives in turnrl.plugins because reasoning-gym's (turnrl.rewards.reasoning_gym) uses it
  too, and turnrl.rewards sits below turnrl.envs.
- `numeric_info(*sources)`: the numbers a library reports beside its reward (an info dict,
  metadata, observation fields, metrics) as the step's `info`, logged as `env_<key>_mean`.
- The helper processes (verifiers' bridges, OpenEnv's servers) are kept by
  `turnrl.envs.helpers.Helpers`, which the tool box's MCP sessions share: one live helper per
  configuration key and process, a failed start remembered a while, all closed at exit.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from turnrl.envs.base import RESERVED_INFO_KEYS
from turnrl.plugins import INSTALL_HINT, import_library

#: info keys turnrl writes itself: a library's number of that name is not copied over them
OWN_INFO_KEYS = frozenset({*RESERVED_INFO_KEYS, "outcome", "reason"})


def is_number(value: Any) -> bool:
    """A finite int or float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def numeric_info(*sources: Mapping[str, Any] | None, skip: Iterable[str] = (), bools: bool = False
                 ) -> dict[str, float]:
    """The numeric entries of `sources` as floats (the first source that has a key wins): finite
    ints and floats, and bools as 0/1 when `bools` (a library whose flags are metrics), under
    string keys other than OWN_INFO_KEYS and `skip`."""
    left_out = OWN_INFO_KEYS | set(skip)
    info: dict[str, float] = {}
    for source in sources:
        for key, value in (source or {}).items():
            if isinstance(key, str) and key not in left_out and (is_number(value) or bools and isinstance(value, bool)):
                info.setdefault(key, float(value))
    return info


__all__ = ["INSTALL_HINT", "OWN_INFO_KEYS", "import_library", "is_number", "numeric_info"]
