"""`env.name: game`: its options, the `GameTable` a rollout's `make_env()` gives, the rows
(one per game seed and trained role; held out: per seed, role and evaluation opponent) and the
warm start's demonstrations. `turnrl.games.tables` rolls the tables out."""
from __future__ import annotations

import random
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from turnrl.data.synthetic import Demonstration, SyntheticTask, split_numbers
from turnrl.envs.base import EnvContext, StepResult
from turnrl.games.base import (BUILTIN_PLAYERS, SELF, SYSTEM_PROMPT_DEFAULT, Checkpoint, Game, Past, Player,
                               illegal_move_rewards, make_player)
from turnrl.games.builtin import BUILTIN_GAMES
from turnrl.plugins import PluginError, is_import_path, load_object


def make_game(name: str, kwargs: dict[str, Any] | None = None, key: str = "env.options.game") -> Game:
    """A fresh game: a built-in name, `textarena:<env id>` (its two-player games) or `module:factory`."""
    kwargs = dict(kwargs or {})
    if name in BUILTIN_GAMES:
        return BUILTIN_GAMES[name](**kwargs)
    if name.startswith("textarena:"):
        from turnrl.games.textarena import textarena_game
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
        "first, checkpoint:<model folder> (a frozen model), past:<N> (a past self: the policy as of its last "
        "weight push at a multiple of N updates, the starting weights before the first; its own engine, never "
        "trained), past:<N>:<K> (a league: its last K such snapshots, each game drawing one; K copies of the "
        "weights in host memory), endpoint:<OpenAI-compatible base URL>[#model], or module:factory of a player"))
    eval_opponents: list[str] = Field(default_factory=lambda: list(EVAL_OPPONENTS), min_length=1, description=(
        "the opponents the evaluation plays each trained role against (a held-out row per seed, role and "
        "opponent): random, first, checkpoint:<model folder> (checkpoint:models/initial: the warm start, "
        "the starting checkpoint), past:<N>[:<K>] (in training's evaluations the past selves as they are then; "
        "in the evaluation stages, which push no weights, models/initial), module:factory, or self (the policy "
        "against itself)"))
    illegal: IllegalRule = Field("end", description=(
        "an illegal move: end (the game ends; the mover gets illegal_reward, the other roles share what balances "
        "it in a zero-sum game (+1 each of two at -1, +0.5 each of three), else 0) or retry (the mover is told why "
        "and moves again, up to max_retries, then as end)"))
    illegal_reward: float = Field(-1.0, description="the reward of a role whose illegal move ended the game")
    max_retries: int = Field(1, ge=0, description="illegal: retry: moves again at most this many times per turn")
    player_timeout_s: float = Field(60.0, gt=0, description=(
        "a scripted, checkpoint or endpoint player that gives no move within this ends its game as an "
        "environment error (the other games go on)"))
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
                 demonstration_opponent: str = "random", player_timeout_s: float = 60.0,
                 context: EnvContext | None = None):
        self.game_name, self.kwargs = game, dict(kwargs or {})
        self.opponent, self.illegal, self.illegal_reward = opponent, illegal, illegal_reward
        self.max_retries, self.system_prompt = max_retries, system_prompt
        self.demonstration_opponent, self.player_timeout_s = demonstration_opponent, player_timeout_s
        scripted_player(demonstration_opponent, "env.options.demonstration_opponent", "a demonstration")
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

    def system_for(self, game: Game, role: str) -> str:
        own = getattr(game, "system_prompt", None)
        return own(role) if callable(own) else self.system_prompt

    # By hand (`turnrl env game --step 3 ...`): the row's role is whoever types; the scripted
    # opponents move by themselves, and with opponent `self` every role is typed. Training and
    # evaluation never step a GameTable: turnrl.games.tables seats the policy at real tables.
    def reset(self, example: dict) -> str:
        self._game = self.new_game()
        self._game.reset(int(example["game_seed"]))
        name = str(example.get("opponent") or self.opponent)
        self._players = {r: scripted_player(name, "the opponent", "playing by hand (turnrl env game)")
                         for r in self.roles if r != example.get("role") and name != SELF}
        self._rng = opponent_rng(int(example["game_seed"]), 0)
        return self._scripted_moves("")

    def _scripted_moves(self, said: str) -> str:
        while (mover := self._game.to_move()) in self._players:
            move = self._players[mover].act(self._game.observe(mover), self._game.legal_moves(), self._rng)
            legal = self._game.play(move).legal
            said += f"[{mover} plays {move}{'' if legal else ' (illegal)'}] "
            if not legal:
                break
        mover = self._game.to_move()
        return said + (f"({mover}) {self._game.observe(mover)}" if mover is not None else "")

    def step(self, text: str) -> StepResult:
        mover = self._game.to_move()
        move = self._game.play(text)
        if not move.legal and self.illegal == "end" or self._game.to_move() is None:
            rewards = (illegal_move_rewards(self.roles, mover, self.illegal_reward,
                                            zero_sum=getattr(self._game, "reward_sum", None) == 0.0)
                       if not move.legal else self._game.rewards())
            return StepResult(None, 0.0, True, {"outcome": rewards.get(mover, 0.0), "rewards": rewards,
                                                "reason": "game_over" if move.legal else "illegal_move"})
        said = "" if move.legal else f"Illegal move: {move.why}. "
        observation = self._scripted_moves(said)
        if self._game.to_move() is None:
            rewards = self._game.rewards()
            return StepResult(observation, 0.0, True, {"outcome": rewards.get(mover, 0.0), "rewards": rewards,
                                                       "reason": "game_over"})
        return StepResult(observation, 0.0, False, {})


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


def first_position_problem(table: GameTable) -> str | None:
    """What goes wrong with the game's first position (reset, the first mover, what it is shown,
    its legal moves), in one line, or None: the checks `turnrl config` runs before any work."""
    from turnrl.errors import one_line
    what = "reset(0)"
    try:
        game = table.new_game()
        game.reset(0)
        what = "to_move()"
        mover = game.to_move()
        if mover not in table.roles:
            return (f"env.options.game = {table.game_name!r}: after reset(0), to_move() gave {mover!r}, not one of its "
                    f"roles ({', '.join(table.roles)})")
        what = f"observe({mover!r})"
        shown = game.observe(mover)
        if not isinstance(shown, str):
            return (f"env.options.game = {table.game_name!r}: observe({mover!r}) returned {type(shown).__name__}; it "
                    "must return the text the role is shown")
        if getattr(game, "lists_legal_moves", True):
            what = "legal_moves()"
            legal = game.legal_moves()
            if not isinstance(legal, list) or not legal or not all(isinstance(m, str) for m in legal):
                return (f"env.options.game = {table.game_name!r}: legal_moves() at the first position gave "
                        f"{legal!r:.80}; it must be a non-empty list of move texts (or set lists_legal_moves = False)")
    except Exception as exc:   # noqa: BLE001 - a game of one's own
        return f"env.options.game = {table.game_name!r}: {what} at the first position raised {one_line(exc)}"
    return None


def demonstration_turns(table: GameTable, row: dict, rng: random.Random) -> list[str]:
    """The row's role's moves in a game of random legal moves against the demonstration opponent,
    seeded as `turnrl.games.tables` seeds a replay's opponent, so the replay meets the same game."""
    game = table.new_game()
    game.reset(int(row["game_seed"]))
    opponent = scripted_player(table.demonstration_opponent, "env.options.demonstration_opponent", "a demonstration")
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


def scripted_player(name: str, key: str, what: str) -> Player:
    """The player `name` stands for, where only a program can play (no model seat is open):
    a frozen or past model is a PluginError naming `key` and what to use instead."""
    player = make_player(name, key)
    if isinstance(player, (Checkpoint, Past)) or player is None:
        raise PluginError(f"{key} = {name!r}: a model plays a seat only at the pipeline's tables (training and "
                          f"evaluation); {what} needs a scripted player: random, first, endpoint:<base URL> or "
                          "module:factory")
    return player


def opponent_rng(game_seed: int, index: int) -> random.Random:
    """The scripted opponents' generator of table `index` of a row (its k-th game)."""
    return random.Random(f"opponent-{game_seed}-{index}")


def task(options: dict) -> SyntheticTask:
    rows, table = _rows(options)
    return SyntheticTask(name="game", rows=rows, key=lambda r: r["game_seed"],
                         demonstration=lambda row, rng, good: Demonstration(demonstration_turns(table, row, rng)))
