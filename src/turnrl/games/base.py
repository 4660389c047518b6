"""The pieces of a game of several players: the `Game` protocol, a `Move`, and the players.

See `turnrl.games` for the protocol in full. A `Player` is anything with
`act(observation, legal_moves, rng) -> str`: the built-ins `random` and `first`, any
OpenAI-compatible endpoint `endpoint:<base_url>[#model]`, or a player of one's own by import
path `module:factory`. A frozen model `checkpoint:<folder>` is a `Checkpoint` and a past self
`past:<N>[:<K>]` a `Past` (seats the tables runner gives an engine of their own); `self` names
the policy.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Callable, Protocol

from turnrl.plugins import PluginError, is_import_path, load_object

#: The player that is the policy being trained (self-play where it plays every role).
SELF = "self"
SYSTEM_PROMPT_DEFAULT = "You are playing a game. Reply with your move only."


@dataclass
class Move:
    """What a game says of a turn: legal (applied) or not (`why`; the state unchanged)."""
    legal: bool = True
    why: str = ""
    rewards: dict[str, float] = field(default_factory=dict)   # per-turn rewards, by role


def illegal_move_rewards(roles: tuple[str, ...], offender: str, illegal_reward: float,
                         zero_sum: bool) -> dict[str, float]:
    """Every role's reward when `offender`'s illegal move ended the game: the offender gets
    `illegal_reward`; in a zero-sum game the others share what balances it (+1 each of two, +0.5
    each of three at -1), else they get nothing."""
    others = len(roles) - 1
    share = -illegal_reward / others if zero_sum and others else 0.0
    return {r: illegal_reward if r == offender else share for r in roles}


class Game(Protocol):
    roles: tuple[str, ...]

    def reset(self, seed: int) -> None: ...

    def to_move(self) -> str | None: ...

    def observe(self, role: str) -> str: ...

    def legal_moves(self) -> list[str]: ...

    def play(self, text: str) -> Move: ...

    def rewards(self) -> dict[str, float]: ...


class Player(Protocol):
    def act(self, observation: str, legal_moves: list[str], rng: random.Random) -> str: ...


class RandomPlayer:
    """A random legal move: the evaluation's baseline opponent and the warm start's demonstrator."""

    def act(self, observation: str, legal_moves: list[str], rng: random.Random) -> str:
        return rng.choice(legal_moves)


class FirstLegalPlayer:
    """The first legal move: a deterministic scripted opponent."""

    def act(self, observation: str, legal_moves: list[str], rng: random.Random) -> str:
        return legal_moves[0]


@dataclass(frozen=True)
class Checkpoint:
    """`checkpoint:<folder>` (e.g. checkpoint:models/initial, the warm start): a frozen model
    plays the role as a seat of its own, with its own conversation as the policy's seats have,
    on an engine of its own (transformers on the CPU), sampled as the policy's turns are and never
    trained. Not a `Player`: `turnrl.games.tables` seats it."""
    folder: str


@dataclass(frozen=True)
class Past:
    """`past:<N>` (a past self): the policy as of its last weight push at a multiple of N
    (before the first, its starting weights), and `past:<N>:<K>` (a league of past selves): the
    last K such snapshots, each table drawing one with its own generator. Seated as a
    `Checkpoint` is, on an engine of its own that is never trained; `turnrl.games.league` keeps
    the snapshots."""
    every: int
    keep: int = 1

    @property
    def name(self) -> str:
        return f"past:{self.every}" + (f":{self.keep}" if self.keep > 1 else "")


def parse_past(name: str, key: str = "env.options.opponent") -> Past:
    """`past:<N>` or `past:<N>:<K>`, N and K positive whole numbers, as a `Past`."""
    parts = name.split(":")[1:]
    if len(parts) in (1, 2) and all(p.isascii() and p.isdigit() and int(p) > 0 for p in parts):
        return Past(*(int(p) for p in parts))
    raise PluginError(f"{key} = {name!r}: use past:<N> (the policy as of its last push at a multiple of N "
                      "updates) or past:<N>:<K> (its last K such snapshots), N and K positive whole numbers")


class EndpointPlayer:
    """Any OpenAI-compatible chat endpoint (`endpoint:<base_url>`, e.g.
    endpoint:http://host:8000/v1, or `endpoint:<base_url>#<model>`): each move is one
    /chat/completions request (the system prompt and what the game shows it now; temperature 1,
    seeded by the table's generator), with the judges' retry rules (turnrl.rewards.endpoint): a
    server that stays down ends its table as an environment error."""

    def __init__(self, spec: str, system_prompt: str = SYSTEM_PROMPT_DEFAULT, max_tokens: int = 16,
                 timeout_s: float = 60.0, retries: int = 2):
        self.base_url, _, self.model = spec.partition("#")
        self.base_url = self.base_url.rstrip("/")
        self.system_prompt, self.max_tokens, self.timeout_s, self.retries = system_prompt, max_tokens, timeout_s, retries

    def act(self, observation: str, legal_moves: list[str], rng: random.Random) -> str:
        import asyncio

        import httpx

        from turnrl.rewards.endpoint import post, run
        body = {"model": self.model or "default", "max_tokens": self.max_tokens, "temperature": 1.0,
                "seed": rng.randrange(1 << 31), "messages": [{"role": "system", "content": self.system_prompt},
                                                             {"role": "user", "content": observation}]}

        async def ask():
            async with httpx.AsyncClient(timeout=self.timeout_s) as client:
                return await post(client, asyncio.Semaphore(1), f"{self.base_url}/chat/completions", body,
                                  retries=self.retries, timeout_s=self.timeout_s)
        reply = run(ask())
        if reply.body is None:
            raise RuntimeError(f"endpoint:{self.base_url}: {reply.error} (after {reply.tries} tries)")
        try:
            return str(reply.body["choices"][0]["message"]["content"] or "")
        except (KeyError, IndexError, TypeError):
            raise RuntimeError(f"endpoint:{self.base_url}: not a chat completion: {reply.text[:200]}") from None


BUILTIN_PLAYERS: dict[str, Callable[[], Player]] = {"random": RandomPlayer, "first": FirstLegalPlayer}


def make_player(name: str, key: str = "env.options.opponent") -> Player | Checkpoint | Past | None:
    """The player `name` stands for; a `Checkpoint` for a frozen model, a `Past` for a past self;
    None for `self` (the policy)."""
    if name == SELF:
        return None
    if name in BUILTIN_PLAYERS:
        return BUILTIN_PLAYERS[name]()
    if name.startswith("checkpoint:"):
        return Checkpoint(name.split(":", 1)[1])
    if name.startswith("past:"):
        return parse_past(name, key)
    if name.startswith("endpoint:"):
        return EndpointPlayer(name.split(":", 1)[1])
    if not is_import_path(name):
        raise PluginError(f"{key} = {name!r}: use {SELF} (the policy), {', '.join(BUILTIN_PLAYERS)}, "
                          "checkpoint:<model folder>, past:<N>[:<K>], endpoint:<OpenAI-compatible base URL>[#model] "
                          "or an import "
                          "path module:factory of a player")
    player = load_object(name, key)()
    if not callable(getattr(player, "act", None)):
        raise PluginError(f"{key} = {name!r}: {type(player).__name__} has no act(observation, legal_moves, rng) method")
    return player


# --------------------------------------------------------------------------- the built-in games
_DIGITS = re.compile(r"\d+")


def last_number(text: str) -> str | None:
    """The last whole number written in `text` (how the built-in games read a move), or None."""
    found = _DIGITS.findall(text)
    return found[-1] if found else None
