"""`skyrl_gym`: an environment of the skyrl-gym library (SkyRL's), run unchanged as a turnrl environment.

    env:
      name: skyrl_gym
      options: {id: gsm8k}          # a skyrl_gym registry id, or module:Class of a BaseTextEnv
    data:
      train_set: gsm8k              # rows with a prompt and an answer, or SkyRL-format rows

skyrl-gym's protocol: `skyrl_gym.make(id, env_config=, extras=)` builds one environment per
trajectory; `init(prompt_messages) -> (messages, metadata)`; `step(text) -> {observations: chat
messages, reward, done, metadata}`; `close()`. The adapter builds the environment as SkyRL's own
generator does:

- `env_config` is `options.kwargs` (SkyRL's `skyrl_gym.<id>` config: `db_path` for text2sql,
  `search_url` for search), as an omegaconf DictConfig (the environments read attributes).
- `extras` is the row's own fields beyond turnrl's schema (a SkyRL row's `reward_spec`,
  `extra_info`, `db_id`, ...), over `options.extras`, with the row's `extras` dict (if it has
  one) on top; where the row carries no `reward_spec` / `reward_model` (aime's name for it) they
  are `{ground_truth: row.answer}`. `max_turns` is rollout.max_turns, as SkyRL's generator sets
  it from generator.max_turns.
- The first user message is the row's prompt; the system message `options.system_prompt` (none
  by default, as in SkyRL's gsm8k data). `init` may rewrite both.

Each step's reward is the library's reward for the turn; `done` is the library's (or
rollout.max_turns reached: `reason: truncated`); `info["outcome"]` is the episode's return, the
sum of the turn rewards (what SkyRL trains on: its per-turn rewards are placed on the tokens of
their turn and summed). Observations keep their role (user or tool); several become several
messages. Numeric metadata (and, at the end, `get_metrics()`) goes into info.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from turnrl.data.files import SCHEMA_FIELDS
from turnrl.envs.base import EnvContext, EnvSpec, StepResult
from turnrl.envs.ecosystem.glue import import_library, numeric_info
from turnrl.plugins import PluginError, is_import_path

#: ids whose tools need something outside this process (a retrieval server, database files)
NEEDS_SERVICE = {"search": "a retrieval server at options.kwargs.search_url",
                 "searchcode": "a retrieval server at http://127.0.0.1:8000/retrieve",
                 "text2sql": "the SQLite databases under options.kwargs.db_path"}
_ROLES = ("user", "tool")


def library():
    """The skyrl_gym module; PluginError naming the extra when it is not installed."""
    return import_library("skyrl_gym", where="env.name = skyrl_gym", what="skyrl-gym")


def known_ids() -> list[str]:
    return sorted(library().registry)


def check_id(env_id: str) -> str:
    """`env_id` if skyrl_gym can make it: a registry id or a module:Class import path."""
    if is_import_path(env_id) or env_id in library().registry:
        return env_id
    raise ValueError(f"not a skyrl_gym environment id; known ids: {', '.join(known_ids())} "
                     "(or module:Class of a skyrl_gym BaseTextEnv)")


class SkyRLGymOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1, description=(
        "a skyrl_gym registry id (gsm8k, gsm8k_multi_turn, aime, lcb, text2sql, search, searchcode) or "
        "module:Class of a skyrl_gym BaseTextEnv of one's own"))
    kwargs: dict[str, Any] = Field(default_factory=dict, description=(
        "the environment's env_config (SkyRL's skyrl_gym.<id> config, e.g. {db_path: ...} for text2sql)"))
    extras: dict[str, Any] = Field(default_factory=dict, description=(
        "extras every row gets unless it carries its own (e.g. {data: spider} for text2sql)"))
    system_prompt: str = Field("", description="the system message (none by default)")

    @field_validator("id")
    @classmethod
    def _known(cls, value: str) -> str:
        try:
            return check_id(value)
        except PluginError as exc:   # the library missing: the message names the extra
            raise ValueError(str(exc).split(": ", 1)[1]) from None


def make_library_env(env_id: str, env_config: dict[str, Any], extras: dict[str, Any]):
    """A fresh skyrl_gym environment, built as SkyRL's generator builds one."""
    skyrl_gym = library()
    try:
        from omegaconf import OmegaConf
        config = OmegaConf.create(dict(env_config))
    except ImportError:            # omegaconf comes with skyrl-gym; a plain dict where it is absent
        config = dict(env_config)
    if is_import_path(env_id):
        from skyrl_gym.envs.registration import EnvSpec as LibrarySpec
        return skyrl_gym.make(LibrarySpec(id=env_id, entry_point=env_id), env_config=config, extras=extras)
    check_id(env_id)
    return skyrl_gym.make(env_id, env_config=config, extras=extras)


def row_extras(row: dict, defaults: dict[str, Any], max_turns: int) -> dict[str, Any]:
    """The library's `extras` for a row (see the module docstring)."""
    extras = dict(defaults)
    extras.update({k: v for k, v in row.items() if k not in SCHEMA_FIELDS and k != "extras"})
    if isinstance(row.get("extras"), dict):
        extras.update(row["extras"])
    answer = str(row.get("answer") or "")
    extras.setdefault("reward_spec", {"method": "rule", "ground_truth": answer})
    extras.setdefault("reward_model", {"style": "rule", "ground_truth": answer})
    extras.setdefault("extra_info", {})
    extras["max_turns"] = max_turns
    return extras


class SkyRLGymEnv:
    stop: tuple[str, ...] = ()

    def __init__(self, id: str, kwargs: dict[str, Any] | None = None, extras: dict[str, Any] | None = None,
                 system_prompt: str = "", context: EnvContext | None = None):
        check_id(id)
        self.id, self.kwargs, self.extras = id, dict(kwargs or {}), dict(extras or {})
        self.system_prompt = system_prompt
        self.max_turns = (context or EnvContext()).max_turns
        self.observation_role = "user"
        self.env: Any = None
        self.turns, self.total = 0, 0.0

    def reset(self, example: dict) -> str:
        self.env = make_library_env(self.id, self.kwargs, row_extras(example, self.extras, self.max_turns))
        self.turns, self.total = 0, 0.0
        prompt = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + \
            [{"role": "user", "content": str(example["prompt"])}]
        messages, _metadata = self.env.init(prompt)
        roles = {m.get("role") for m in messages}
        if not roles <= {"system", "user"} or not any(m.get("role") == "user" for m in messages):
            raise ValueError(f"skyrl_gym {self.id!r}: init() returned messages in roles {sorted(map(str, roles))}; "
                             "turnrl's prompt is a system and a user message")
        self.system_prompt = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
        return "\n\n".join(m["content"] for m in messages if m["role"] == "user")

    def step(self, text: str) -> StepResult:
        out = self.env.step(text)
        self.turns += 1
        reward = float(out["reward"])
        self.total += reward
        info = numeric_info(out.get("metadata"), bools=True)   # the library's flags are metrics too
        done = bool(out["done"])
        if done or self.turns >= self.max_turns:
            info.update(numeric_info(self.env.get_metrics(), bools=True))
            self.env.close()
            return StepResult(None, reward, True, {**info, "outcome": self.total,
                                                   "reason": "done" if done else "truncated"})
        return StepResult(self._observation(out["observations"]), reward, False, info)

    def _observation(self, messages: list[dict]) -> str | list[str]:
        roles = {m.get("role") for m in messages}
        if len(roles) > 1 or not roles <= set(_ROLES):
            raise ValueError(f"skyrl_gym {self.id!r}: step() returned observations in roles "
                             f"{sorted(map(str, roles))}; turnrl renders one role per turn, user or tool")
        if roles:
            self.observation_role = roles.pop()
        contents = [str(m.get("content", "")) for m in messages]
        return contents[0] if len(contents) == 1 else contents if contents else ""


ENV = EnvSpec(factory=SkyRLGymEnv, options=SkyRLGymOptions, name="skyrl_gym")
