"""GEM (gem-llm) behind OpenEnv's server protocol: one GEM env id served by openenv-core's own
`create_app`, for turnrl's `env.name: openenv` (docs/ecosystem-text-games.md).

gem-llm 0.1.0 cannot be installed beside turnrl: it requires `math-verify[antlr4_13_2]`
(antlr4-python3-runtime 4.13.2) while hydra-core/omegaconf (dvc's `exp run -S`) require
antlr4-python3-runtime 4.9.*. So it lives in its own virtualenv (`.venv-gem`, made by setup.sh)
and this script runs under that environment's python, by file path. It imports gem,
openenv-core (and uvicorn, which openenv-core brings) and the standard library: nothing of turnrl.

    .venv-gem/bin/python src/turnrl/envs/ecosystem/gem_server.py --env game:GuessTheNumber-v0-easy --port 8123
    # options: --kwargs '{"max_turns": 6}' (gem.make's keyword arguments), --raw, --host, --max-sessions

The mapping keeps GEM's semantics:
- `reset(seed=...)` is GEM's `reset(seed=...)` (turnrl's adapter sends the row's `game_seed`).
- the observation's `text` is what GEM's own observation wrapper (`gem.wrappers`, "concat") shows
  of the latest turn: `info["prefix"]`, GEM's observation (ending in a newline), `info["suffix"]`
  (a game's board or "Enter your next guess."), without the wrapper's replay of earlier turns,
  which turnrl's conversation already holds. `--raw`: GEM's observation alone.
- the Action has one string field, `action`, which is GEM's `step(action)` argument as given.
- each step's observation: `text`, `reward` (GEM's reward for that step),
  `done` (terminated or truncated), `terminated` and `truncated` as 0/1 numbers, `info` (GEM's
  info dict, made JSON-safe) and each numeric value of GEM's info as a field of its own. Flags
  and numbers are fields, not `metadata`: openenv-core's wire protocol drops `metadata`, and
  turnrl's adapter logs numeric fields as the step's info (so `truncated` is env_truncated_mean).

Reproducibility: GEM's games draw from the process-wide `random` and `numpy.random` (GEM's
`reset(seed)` seeds both), and the server runs sessions on threads. Each session therefore
keeps its own copy of both generators' states, swapped in under one lock around every reset
and step: an episode depends on its seed and its actions only, not on other sessions.

An env id GEM does not know (or kwargs it rejects) stops the script before it serves, with one
line on stderr and exit code 2.
"""
import argparse
import json
import math
import os
import random
import sys
import threading
from typing import Any, Optional

# Run by file path, Python puts this file's folder first on sys.path: turnrl.envs.ecosystem, whose
# openenv.py would shadow the openenv-core package. Drop it before importing the libraries.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

_LOCK = threading.Lock()   # GEM's games share the process's random generators


def _json_safe(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


# turnrl.envs.ecosystem.glue.is_number, copied: this script runs in .venv-gem, where turnrl is not
# installed (and cannot be: gem-llm's antlr4 pin clashes with turnrl's hydra-core), so it imports no turnrl
def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def build(env_id: str, kwargs: dict[str, Any], raw: bool = False):
    """The openenv Environment, Action and Observation classes serving GEM's `env_id`."""
    import gem
    import numpy as np
    from gem.wrappers.observation_wrapper import maybe_add_new_line
    from openenv.core.env_server import Action, Environment, Observation, State
    from pydantic import ConfigDict, Field

    class GemAction(Action):
        action: str = Field(description="the policy's text, GEM's step(action) argument as given")

    class GemObservation(Observation):
        model_config = ConfigDict(extra="allow")   # GEM's numeric info values, one field each
        text: str = Field("", description="info's prefix, GEM's observation, info's suffix (--raw: the observation)")
        terminated: int = Field(0, description="1 when GEM's step returned terminated")
        truncated: int = Field(0, description="1 when GEM's step returned truncated")
        info: dict[str, Any] = Field(default_factory=dict, description="GEM's info dict (JSON-safe)")

    declared = set(GemObservation.model_fields)

    def observation(text: Any, info: dict | None, **fields: Any) -> GemObservation:
        info = info or {}
        text = str(text)
        if not raw:
            text = str(info.get("prefix", "")) + maybe_add_new_line(text) + str(info.get("suffix", ""))
        info = _json_safe(info)
        numbers = {k: v for k, v in info.items() if _number(v) and k not in declared}
        return GemObservation(text=text, info=info, **numbers, **fields)

    class GemEnvironment(Environment[GemAction, GemObservation, State]):
        SUPPORTS_CONCURRENT_SESSIONS = True   # an instance per session; the shared RNGs are swapped per call

        def __init__(self):
            super().__init__()
            with _LOCK:
                self.env = gem.make(env_id, **kwargs)
                self.rng = (random.getstate(), np.random.get_state())
            self._state = State()

        def _call(self, fn, *args, **kw):
            """`fn` with this session's generator states in place, saved again after."""
            with _LOCK:
                random.setstate(self.rng[0])
                np.random.set_state(self.rng[1])
                try:
                    return fn(*args, **kw)
                finally:
                    self.rng = (random.getstate(), np.random.get_state())

        def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None,
                  **extra: Any) -> GemObservation:
            if extra:
                raise ValueError(f"GEM's reset takes only seed; got {sorted(extra)}")
            text, info = self._call(self.env.reset, seed=seed)
            self._state = State(episode_id=episode_id, step_count=0)
            return observation(text, info, reward=None, done=False)

        def step(self, action: GemAction, timeout_s: Optional[float] = None, **extra: Any) -> GemObservation:
            text, reward, terminated, truncated, info = self._call(self.env.step, action.action)
            self._state.step_count += 1
            return observation(text, info, reward=float(reward), done=bool(terminated or truncated),
                               terminated=int(bool(terminated)), truncated=int(bool(truncated)))

        @property
        def state(self) -> State:
            return self._state

    return GemEnvironment, GemAction, GemObservation


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Serve one GEM env id over OpenEnv's server protocol.")
    parser.add_argument("--env", required=True, help="a GEM env id, e.g. game:GuessTheNumber-v0-easy")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--kwargs", default="{}", help="gem.make's keyword arguments, a JSON object")
    parser.add_argument("--raw", action="store_true",
                        help="the observation's text is GEM's observation alone (no info prefix/suffix)")
    parser.add_argument("--max-sessions", type=int, default=256,
                        help="concurrent sessions (one per trajectory a rollout worker runs at once)")
    args = parser.parse_args(argv)

    try:
        kwargs = json.loads(args.kwargs)
        if not isinstance(kwargs, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        print(f"gem_server: --kwargs {args.kwargs!r} is not a JSON object ({exc})", file=sys.stderr)
        return 2
    try:
        import gem
        import uvicorn
        from openenv.core.env_server import create_app
    except ImportError as exc:
        print(f"gem_server: gem-llm and openenv-core are not importable by {sys.executable} ({exc}); "
              "build .venv-gem with setup.sh", file=sys.stderr)
        return 2
    try:
        gem.make(args.env, **kwargs)   # fail here, in one line, not in the first session
    except Exception as exc:   # noqa: BLE001 - whatever GEM raises for an id or kwargs it rejects
        message = " ".join(str(exc).split())[:300]
        print(f"gem_server: GEM cannot make {args.env!r} with kwargs {kwargs}: {type(exc).__name__}: {message}",
              file=sys.stderr)
        return 2

    env_cls, action_cls, observation_cls = build(args.env, kwargs, args.raw)
    app = create_app(env_cls, action_cls, observation_cls, env_name=f"gem {args.env}",
                     max_concurrent_envs=args.max_sessions)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
