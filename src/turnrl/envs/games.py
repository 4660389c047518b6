"""Games of several players: the protocol, the players, and `env.name: game`.

A game is a small stateful object, one per table (an episode):

    game.roles                    ("first", "second"): who plays, in seating order
    game.reset(seed)              a fresh game (the row's `game_seed`)
    game.to_move() -> role|None   whose turn it is; None when the game is over
    game.observe(role) -> str     what `role` is shown when it is to move (the state, the rules' reminder)
    game.legal_moves() -> [str]   the mover's legal moves, each as a text it could play
    game.play(text) -> Move       the mover's turn as it wrote it: Move(legal, why, rewards)
    game.rewards() -> {role: r}   each role's reward, once the game is over

Optional: `reward_sum` (what the roles' final rewards sum to, e.g. 0.0 for a zero-sum game;
checked at every game's end, a game that breaks it ends as an environment error),
`system_prompt(role)`, and `lists_legal_moves = False` for a game whose `legal_moves` cannot
list them (scripted players cannot play it: refused when the options are read). A `play` that
returns an illegal move and leaves no one to move ended the game by its own rule. A `Move`'s `rewards` are per-turn rewards where the game gives them.

Who plays a role is a `Player` (the policy's roles excepted): anything with
`act(observation, legal_moves, rng) -> str`. The built-ins: `random` (a random legal move),
`first` (the first legal move), `checkpoint:<folder>` (a frozen model, e.g. the warm start
models/initial, sampling its move with transformers); a user's player by import path
`module:factory` (the factory called with no arguments). `self` names the policy: both roles sample from the same engines and
each role's turns are a trajectory of its own (`turnrl.rollout.tables` rolls the tables out).

Rows: one per (game seed, trained role), so each group of rollout.n trajectories shares a game
and a role, and group normalisation is within role; the held-out split has a row per (seed,
role, evaluation opponent), its `subject` "<role> vs <opponent>", so the evaluation's
`by_subject` reports each role against each opponent. `info` at the end: win, draw, loss,
illegal_moves, illegal_move_rate (of the seat's moves), first_mover, game_moves and the game's
transcript; numbers are logged as env_<key>_mean in training, and win, draw, loss and
illegal_move_rate are the task block's `eval_metrics` (overall, greedy and per subject).
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from turnrl.data.synthetic import Demonstration, SyntheticTask, split_numbers
from turnrl.envs.base import EnvContext, EnvSpec
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
    start): it samples its move (temperature 1, seeded by the table's generator) from the system
    prompt and what the game shows it now, one turn, with transformers on the CPU. The built-in
    games show the whole state each turn, so nothing is lost; a game whose observations are only
    what changed is better played by the policy (`self`). The model is loaded once per folder."""
    _loaded: dict[str, tuple] = {}

    def __init__(self, folder: str, system_prompt: str = SYSTEM_PROMPT_DEFAULT, max_tokens: int = 16):
        self.folder, self.system_prompt, self.max_tokens = folder, system_prompt, max_tokens

    def _model(self):
        if self.folder not in self._loaded:
            from pathlib import Path
            if not (Path(self.folder) / "config.json").is_file():
                raise FileNotFoundError(f"checkpoint:{self.folder}: no model folder there (config.json missing); "
                                        "name a saved checkpoint such as models/initial (the warm start)")
            from transformers import AutoModelForCausalLM, AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(self.folder)
            self._loaded[self.folder] = (tokenizer, AutoModelForCausalLM.from_pretrained(self.folder).eval())
        return self._loaded[self.folder]

    def act(self, observation: str, legal_moves: list[str], rng: random.Random) -> str:
        import torch
        tokenizer, model = self._model()
        messages = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": observation}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        torch.manual_seed(rng.randrange(1 << 31))
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.max_tokens,
                                 do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 pad_token_id=tokenizer.pad_token_id or 0)
        return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


BUILTIN_PLAYERS: dict[str, Callable[[], Player]] = {"random": RandomPlayer, "first": FirstLegalPlayer}


def make_player(name: str, key: str = "env.options.opponent") -> Player | None:
    """The player `name` stands for; None for `self` (the policy)."""
    if name == SELF:
        return None
    if name in BUILTIN_PLAYERS:
        return BUILTIN_PLAYERS[name]()
    if name.startswith("checkpoint:"):
        return CheckpointPlayer(name.split(":", 1)[1])
    if not is_import_path(name):
        raise PluginError(f"{key} = {name!r}: use {SELF} (the policy), {', '.join(BUILTIN_PLAYERS)}, "
                          "checkpoint:<model folder> or an import path module:factory of a player")
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


class Nim:
    """One heap; each turn takes 1, 2 or 3; whoever takes the last wins (+1, the other -1).
    The heap starts at 5..15 by the seed. The winning move leaves a multiple of 4."""
    roles = ("first", "second")
    reward_sum = 0.0

    def __init__(self, low: int = 5, high: int = 15):
        self.low, self.high = low, high
        self.heap, self.mover, self.winner = 0, 0, None

    def reset(self, seed: int) -> None:
        self.heap = random.Random(seed).randint(self.low, self.high)
        self.mover, self.winner = 0, None

    def to_move(self) -> str | None:
        return None if self.winner is not None else self.roles[self.mover]

    def observe(self, role: str) -> str:
        return f"Heap {self.heap}. Take 1, 2 or 3."

    def legal_moves(self) -> list[str]:
        return [str(k) for k in (1, 2, 3) if k <= self.heap]

    def play(self, text: str) -> Move:
        move = last_number(text)
        if move not in self.legal_moves():
            return Move(False, f"{move or 'no number'} is not 1, 2 or 3 (at most the heap, {self.heap})")
        self.heap -= int(move)
        if self.heap == 0:
            self.winner = self.mover
        self.mover = 1 - self.mover
        return Move()

    def rewards(self) -> dict[str, float]:
        return {role: 1.0 if k == self.winner else -1.0 for k, role in enumerate(self.roles)}


class TicTacToe:
    """Tic-tac-toe: cells 1-9, row by row; three in a row wins (+1, the other -1), a full board
    draws (0 each). X ("first") moves first; every game starts empty (the seed only varies the
    opponents' moves)."""
    roles = ("first", "second")
    reward_sum = 0.0
    LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))

    def __init__(self):
        self.board = [" "] * 9
        self.mover, self.result = 0, None   # result: the winner's index, -1 a draw

    def reset(self, seed: int) -> None:
        self.board, self.mover, self.result = [" "] * 9, 0, None

    def to_move(self) -> str | None:
        return None if self.result is not None else self.roles[self.mover]

    def observe(self, role: str) -> str:
        rows = ["".join(c if c != " " else str(3 * r + k + 1) for k, c in enumerate(self.board[3 * r:3 * r + 3]))
                for r in range(3)]
        return f"You are {'XO'[self.roles.index(role)]}. Board: {'/'.join(rows)}. Cell?"

    def legal_moves(self) -> list[str]:
        return [str(k + 1) for k, c in enumerate(self.board) if c == " "]

    def play(self, text: str) -> Move:
        move = last_number(text)
        if move not in self.legal_moves():
            return Move(False, f"{move or 'no number'} is not a free cell")
        self.board[int(move) - 1] = "XO"[self.mover]
        if any(self.board[a] == self.board[b] == self.board[c] != " " for a, b, c in self.LINES):
            self.result = self.mover
        elif " " not in self.board:
            self.result = -1
        self.mover = 1 - self.mover
        return Move()

    def rewards(self) -> dict[str, float]:
        return {role: 0.0 if self.result == -1 else (1.0 if k == self.result else -1.0)
                for k, role in enumerate(self.roles)}


BUILTIN_GAMES: dict[str, Callable[[], Game]] = {"nim": Nim, "tictactoe": TicTacToe}


def make_game(name: str, kwargs: dict[str, Any] | None = None, key: str = "env.options.game") -> Game:
    """A fresh game: a built-in name, `textarena:<env id>` (its two-player games) or `module:factory`."""
    kwargs = dict(kwargs or {})
    if name in BUILTIN_GAMES:
        return BUILTIN_GAMES[name](**kwargs)
    if name.startswith("textarena:"):
        from turnrl.envs.textarena_games import textarena_game
        return textarena_game(name.split(":", 1)[1], kwargs, key)
    if not is_import_path(name):
        raise PluginError(f"{key} = {name!r}: use {', '.join(BUILTIN_GAMES)}, textarena:<env id> or an import "
                          "path module:factory of a game")
    return load_object(name, key)(**kwargs)


# --------------------------------------------------------------------------- env.name: game
SYSTEM_PROMPT = SYSTEM_PROMPT_DEFAULT
#: What the evaluation plays each role against by default: a random legal player, and the
#: starting checkpoint (the pipeline's models/initial, which prepare_model writes)
EVAL_OPPONENTS = ("random", "checkpoint:models/initial")
IllegalRule = Literal["end", "retry"]


class GameOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    game: str = Field("nim", min_length=1, description=(
        "the game: nim, tictactoe, textarena:<env id> (a two-player TextArena game) or module:factory"))
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the game's factory")
    trained_roles: list[str] | None = Field(None, description=(
        "the roles the policy plays and is trained on (training rows are made for each); None: every role"))
    opponent: str = Field(SELF, min_length=1, description=(
        "who plays the roles of a training game the row does not train: self (the policy: self-play), random, "
        "first, or module:factory of a player"))
    eval_opponents: list[str] = Field(default_factory=lambda: list(EVAL_OPPONENTS), min_length=1, description=(
        "the opponents the evaluation plays each trained role against (a held-out row per seed, role and "
        "opponent): random, first, checkpoint:<model folder> (checkpoint:models/initial: the warm start, "
        "the starting checkpoint), module:factory, or self (the policy against itself)"))
    illegal: IllegalRule = Field("end", description=(
        "an illegal move: end (the game ends; the mover gets illegal_reward, every other role +1 in a zero-sum "
        "game, else 0) or retry (the mover is told why and moves again, up to max_retries, then as end)"))
    illegal_reward: float = Field(-1.0, description="the reward of a role whose illegal move ended the game")
    max_retries: int = Field(1, ge=0, description="illegal: retry: moves again at most this many times per turn")
    system_prompt: str = SYSTEM_PROMPT
    demonstration_opponent: str = Field("random", description=(
        "the scripted opponent of the warm start's demonstrations (model.path: tiny): random or first"))


class GameTable:
    """What `make_env()` gives for `env.name: game`: the options, and fresh games and players.
    Its `stop`, `system_prompt` and `observation_role` are the policy seats' (as an `Env`'s)."""
    observation_role = "user"
    stop: tuple[str, ...] = ()

    def __init__(self, game: str = "nim", kwargs: dict[str, Any] | None = None,
                 trained_roles: list[str] | None = None, opponent: str = SELF,
                 eval_opponents: list[str] | None = None, illegal: IllegalRule = "end",
                 illegal_reward: float = -1.0, max_retries: int = 1, system_prompt: str = SYSTEM_PROMPT,
                 demonstration_opponent: str = "random", context: EnvContext | None = None):
        self.game_name, self.kwargs = game, dict(kwargs or {})
        self.opponent, self.illegal, self.illegal_reward = opponent, illegal, illegal_reward
        self.max_retries, self.system_prompt = max_retries, system_prompt
        self.demonstration_opponent = demonstration_opponent
        self.eval_opponents = list(eval_opponents or EVAL_OPPONENTS)
        probe = self.new_game()
        self.roles = tuple(probe.roles)
        if not getattr(probe, "lists_legal_moves", True):   # a game a scripted player cannot play
            scripted = [f"{key} {name}" for key, names in (("opponent", [opponent]), ("eval_opponents", self.eval_opponents))
                        for name in names if name in BUILTIN_PLAYERS]
            if scripted:
                raise PluginError(f"env.options.game = {game}: the game lists no legal moves, so "
                                  f"{', '.join(scripted)} cannot play it; use self or a player of your own "
                                  "(module:factory)")
        self.trained_roles = list(trained_roles or self.roles)
        unknown = [r for r in self.trained_roles if r not in self.roles]
        if unknown:
            raise PluginError(f"env.options.trained_roles = {self.trained_roles}: the game {game} has no role "
                              f"{', '.join(map(repr, unknown))}; its roles are {', '.join(self.roles)}")

    def new_game(self) -> Game:
        return make_game(self.game_name, self.kwargs)

    def player(self, name: str) -> Player | None:
        return make_player(name)

    def system_for(self, game: Game, role: str) -> str:
        own = getattr(game, "system_prompt", None)
        return own(role) if callable(own) else self.system_prompt

    # a plain Env's methods: env.name: game is rolled out by turnrl.rollout.tables, never step by step
    def reset(self, example: dict) -> str:
        raise TypeError("env.name: game is rolled out by its own runner (turnrl.rollout.tables.GameRunner)")

    def step(self, text: str):
        raise TypeError("env.name: game is rolled out by its own runner (turnrl.rollout.tables.GameRunner)")


def _rows(options: dict):
    table = GameTable(**options)

    def rows(count: int, *, seed: int, split: str, exclude: set) -> list[dict]:
        """Train: one row per (seed, trained role), the roles in turn. Held-out: one per (seed,
        role, evaluation opponent)."""
        opponents = [None] if split == "train" else table.eval_opponents
        per_seed = len(table.trained_roles) * len(opponents)
        seeds = split_numbers(-(-count // per_seed), split=split, exclude=exclude, start=seed * 10 ** 6)
        out = [{"id": f"{table.game_name}-{split}-{s}-{role}" + (f"-vs-{opp}" if opp else ""),
                "prompt": f"{table.game_name} seed {s} as {role}", "answer": "", "answers": [],
                "subject": f"{role} vs {opp}" if opp else role, "level": None, "source": "game", "game": table.game_name,
                "game_seed": s, "role": role, **({"opponent": opp} if opp else {})}
               for s in seeds for role in table.trained_roles for opp in opponents]
        return out[:count]
    return rows, table


def demonstration_turns(table: GameTable, row: dict, rng: random.Random) -> list[str]:
    """The row's role's moves in a game of random legal moves against the demonstration opponent,
    seeded as `turnrl.rollout.tables` seeds a replay's opponent, so the replay meets the same game."""
    game = table.new_game()
    game.reset(int(row["game_seed"]))
    opponent = make_player(table.demonstration_opponent, "env.options.demonstration_opponent")
    opp_rng = opponent_rng(int(row["game_seed"]), 0)
    turns = []
    while (mover := game.to_move()) is not None:
        legal = game.legal_moves()
        if mover == row["role"]:
            move = rng.choice(legal)
            turns.append(move)
        else:
            move = opponent.act(game.observe(mover), legal, opp_rng)
        game.play(move)
    return turns


def opponent_rng(game_seed: int, index: int) -> random.Random:
    """The scripted opponents' generator of table `index` of a row (its k-th game)."""
    return random.Random(f"opponent-{game_seed}-{index}")


def _task(options: dict) -> SyntheticTask:
    rows, table = _rows(options)
    return SyntheticTask(name="game", rows=rows, key=lambda r: r["game_seed"],
                         demonstration=lambda row, rng, good: Demonstration(demonstration_turns(table, row, rng)))


def _runner():
    from turnrl.rollout.tables import GameRunner
    return GameRunner


ENV = EnvSpec(factory=GameTable, options=GameOptions, name="game", runner=_runner, task_from_options=_task,
              eval_metrics=("win", "draw", "loss", "illegal_move_rate"))
