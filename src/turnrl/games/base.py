"""The pieces of a game of several players: the `Game` protocol, a `Move`, and the players.

See `turnrl.games` for the protocol in full. A `Player` is anything with
`act(observation, legal_moves, rng) -> str`: the built-ins `random` and `first`, a frozen model
`checkpoint:<folder>`, any OpenAI-compatible endpoint `endpoint:<base_url>[#model]`, or a
player of one's own by import path `module:factory`. `self` names
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


class CheckpointPlayer:
    """A frozen model folder (`checkpoint:<folder>`, e.g. checkpoint:models/initial, the warm
    start): it samples its move (temperature 1, seeded by the table's generator, up to the chat
    template's end of turn) from the system prompt and what the game shows it now, one turn,
    with transformers on the CPU. The built-in
    games show the whole state each turn, so nothing is lost; a game whose observations are only
    what changed is better played by the policy (`self`). The model is loaded once per folder."""
    _loaded: dict[str, tuple] = {}

    def __init__(self, folder: str, system_prompt: str = SYSTEM_PROMPT_DEFAULT, max_tokens: int = 16):
        self.folder, self.system_prompt, self.max_tokens = folder, system_prompt, max_tokens

    def _model(self):
        if self.folder not in self._loaded:
            from pathlib import Path

            from transformers import AutoModelForCausalLM, AutoTokenizer

            from turnrl.rollout.chat import ChatFormat
            if not (Path(self.folder) / "config.json").is_file():
                raise FileNotFoundError(f"checkpoint:{self.folder}: no model folder there (config.json missing); "
                                        "name a saved checkpoint such as models/initial (the warm start)")
            fmt = ChatFormat(AutoTokenizer.from_pretrained(self.folder))
            self._loaded[self.folder] = (fmt, AutoModelForCausalLM.from_pretrained(self.folder).eval())
        return self._loaded[self.folder]

    def act(self, observation: str, legal_moves: list[str], rng: random.Random) -> str:
        """Its turn rendered as the policy's first turn is (turnrl's chat format), sampled until
        the template's end of turn: what follows it is not part of the move."""
        import torch
        fmt, model = self._model()
        ids = torch.tensor([fmt.prompt_ids(self.system_prompt, observation)])
        end = fmt.end_of_turn_id
        torch.manual_seed(rng.randrange(1 << 31))
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.max_tokens,
                                 do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 eos_token_id=end if end is not None else model.generation_config.eos_token_id,
                                 pad_token_id=fmt.tokenizer.pad_token_id or 0)
        new = out[0, ids.shape[1]:].tolist()
        if end is not None and end in new:
            new = new[:new.index(end)]
        return fmt.tokenizer.decode(new, skip_special_tokens=True)


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


def make_player(name: str, key: str = "env.options.opponent") -> Player | None:
    """The player `name` stands for; None for `self` (the policy)."""
    if name == SELF:
        return None
    if name in BUILTIN_PLAYERS:
        return BUILTIN_PLAYERS[name]()
    if name.startswith("checkpoint:"):
        return CheckpointPlayer(name.split(":", 1)[1])
    if name.startswith("endpoint:"):
        return EndpointPlayer(name.split(":", 1)[1])
    if not is_import_path(name):
        raise PluginError(f"{key} = {name!r}: use {SELF} (the policy), {', '.join(BUILTIN_PLAYERS)}, "
                          "checkpoint:<model folder>, endpoint:<OpenAI-compatible base URL>[#model] or an import "
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
