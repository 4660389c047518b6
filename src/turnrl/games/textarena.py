"""TextArena's two-player games, run unchanged as turnrl's multi-player `Game`.

    env:
      name: game
      options: {game: "textarena:TicTacToe-v0", kwargs: {}}

`textarena_game(env_id, kwargs, key)` (what `turnrl.games.make_game` calls for
`textarena:<env id>`) wraps `textarena.make(env_id, **kwargs)` with the library's own wrappers for
that id (the plain id: the full message log; `-train`: prompt, game messages and current board):

- Roles: "player0" and "player1", TextArena's player ids 0 and 1 (its prompts say "You are Player 0").
  Who moves is the library's `state.current_player_id`: tic-tac-toe, Connect Four, Nim and
  SimpleNegotiation alternate starting with player0; Kuhn poker's player1 opens round 1, the
  opener alternates by round, so a round's last mover may also open the next.
- `reset(seed)`: a fresh `textarena.make(...)` (the library's observation wrappers and Kuhn poker's
  deck keep state across its own resets) and `reset(num_players=2, seed=seed)`.
- `observe(role)`: the part of the role's TextArena observation (`get_observation()`, a growing log
  under the default wrappers) it was not shown when it last moved, as `gym_text` does for one player;
  the whole observation where the wrapper rewrites it (`-train`). Asked twice before a move it says
  the same. Only the mover's observation can be read from the library (`get_observation()` is the
  current player's), so for a role not to move it is what was read but not yet shown (usually "").
- `play(text)`: `env.step(text)`. TextArena judges the move; its rule for an invalid one
  (`TwoPlayerState`, error allowance 1): the first invalid move of a turn is retried (the state is
  unchanged, the mover moves again) -> `Move(legal=False, why=<the library's reason>)` and
  `to_move()` is still the mover; the next invalid move in a row ends the game (the mover -1, the
  other +1, game_info `invalid_move`) -> `Move(legal=False, why=...)` and `to_move()` is None.
  (SimpleNegotiation judges an acceptance and a new offer in one text separately: "[Accept]" with a
  malformed offer trades, then counts the offer as the invalid move.)
- `rewards()`: `close()`'s per-player rewards, by role (0.0 each before the game ends).
  `reward_sum` is 0.0 for the games below (every ending is TextArena's `set_winner` +1/-1,
  `set_draw` 0/0 or an invalid move's -1/+1), None for any other id (not checked).
- `legal_moves()`: TextArena lists no legal moves, so they are read from the game's state, for the
  games below only (any variant id of theirs). Any other two-player id plays with the policy in every
  seat, but `legal_moves()` raises a one-line PluginError naming the game: a scripted player
  (`random`, `first`) cannot play it; `lists_legal_moves` says which beforehand.
- Reproducible: TextArena seeds and draws from the process's `random` (Kuhn poker deals each round
  while the game runs, SimpleNegotiation draws resources at reset); each game keeps its own generator
  state and swaps it in around the library's calls, so a game depends on its seed and moves only,
  however many tables play at once, and the caller's `random` is left as it was.
- An id the library does not know, kwargs its game does not take, or a game that cannot start with
  two players (a one-player id; one needing NLTK data offline, with the download to run): a
  PluginError in one line naming `key`, at construction (`GameTable` makes one game to read roles).

The four games (each runs offline: no NLTK data, no network, no judge model):

- `TicTacToe-v0`: the smallest perfect-information board game, a draw under good play (SPIRAL and
  tinker-cookbook self-play on it); legal moves `[k]`, the free cells 0-8.
- `KuhnPoker-v0` (3 rounds): hidden information and bluffing, a different skill from board games
  (SPIRAL); legal moves the round's action set, `[check]`/`[bet]` or `[call]`/`[fold]`.
- `ConnectFour-v0` (6x7): a longer board game (up to 42 moves, 7 choices) with a winning first
  mover, where the built-in Nim already covers take-away games; legal moves `[col c]`, the columns
  not full. (`Nim-v0` is supported too: `[pile quantity]`.)
- `SimpleNegotiation-v0` (a limit of 10 turns, 11 moves as TextArena counts): free-text talk with trade offers, a general-sum bargaining
  task scored zero-sum by TextArena (the larger gain in inventory value wins) (SPIRAL). Any text is
  a legal move unless an offer or acceptance in it is malformed or unaffordable, so its legal moves
  are a representative menu, not all of them: `[Deny]`, `[Accept]` when the opponent's offer is
  pending and affordable, and `[Offer: 1 A -> 1 B]` for each resource A the mover holds and B != A.
"""
from __future__ import annotations

import random
import re
import threading
from contextlib import contextmanager
from typing import Any, Callable

from turnrl.games.base import Move
from turnrl.envs.ecosystem.gym_text import _download_hint, _textarena
from turnrl.errors import one_line
from turnrl.plugins import PluginError

ROLES = ("player0", "player1")
_RANDOM = threading.RLock()   # the process's `random` is swapped per game: one game at a time


# --------------------------------------------------------------------------- legal moves from state
def _tictactoe(env, state, pid: int) -> list[str]:
    board = state.game_state["board"]
    return [f"[{3 * r + c}]" for r in range(3) for c in range(3) if board[r][c] == ""]


def _kuhn_poker(env, state, pid: int) -> list[str]:
    tree = state.game_state["current_legal_action_tree"]
    return [f"[{action}]" for action in tree] if isinstance(tree, dict) else []


def _connect_four(env, state, pid: int) -> list[str]:
    top = state.game_state["board"][0]
    return [f"[col {c}]" for c in range(len(top)) if top[c] == "."]


def _nim(env, state, pid: int) -> list[str]:
    return [f"[{pile} {take}]" for pile, size in enumerate(state.game_state["piles"]) for take in range(1, size + 1)]


def _simple_negotiation(env, state, pid: int) -> list[str]:
    moves = ["[Deny]"]
    offer = state.game_state.get("current_offer")
    held = state.game_state["player_resources"][pid]
    affordable = offer and all(held.get(r, 0) >= q for r, q in offer["requested_resources"].items())
    if affordable and offer["from_player"] != pid:   # the library would let a player accept its own offer
        moves.append("[Accept]")
    moves += [f"[Offer: 1 {give} -> 1 {want}]" for give in env.resource_names if held.get(give, 0) >= 1
              for want in env.resource_names if want != give]
    return moves


#: The games whose legal moves are read from their state (by the library's class, so every variant
#: id of a game is covered), and whose rewards are zero-sum.
LEGAL_MOVES: dict[str, Callable[[Any, Any, int], list[str]]] = {
    "textarena.envs.TicTacToe.env.TicTacToeEnv": _tictactoe,
    "textarena.envs.KuhnPoker.env.KuhnPokerEnv": _kuhn_poker,
    "textarena.envs.ConnectFour.env.ConnectFourEnv": _connect_four,
    "textarena.envs.Nim.env.NimEnv": _nim,
    "textarena.envs.SimpleNegotiation.env.SimpleNegotiationEnv": _simple_negotiation,
}
ZERO_SUM = frozenset(LEGAL_MOVES)

_RETRY_REASON = re.compile(r"attempted an invalid move\. Reason: (.*?)\s*Please resubmit", re.DOTALL)


def _unwrapped(env):
    from textarena.core import Wrapper
    while isinstance(env, Wrapper):
        env = env.env
    return env


def _class_path(env) -> str:
    cls = type(env)
    return f"{cls.__module__}.{cls.__qualname__}"


class TextArenaGame:
    """One TextArena two-player game as a `Game` (see the module's docstring)."""
    roles = ROLES

    def __init__(self, env_id: str, kwargs: dict[str, Any] | None = None, key: str = "env.options.game"):
        self.env_id, self.kwargs, self.key = env_id, dict(kwargs or {}), key
        self.name = f"textarena:{env_id}"
        self.game_class = _class_path(_unwrapped(self._make()))
        self.lists_legal_moves = self.game_class in LEGAL_MOVES
        self.reward_sum = 0.0 if self.game_class in ZERO_SUM else None
        self._random_state: tuple | None = None
        self.reset(0)   # a game that cannot start with two players fails here, before any work

    # ------------------------------------------------------------------ the library, kept apart
    def _make(self):
        try:
            return _textarena(self.env_id, self.kwargs)
        except PluginError as exc:   # gym_text's message names its own key: name this one's
            raise PluginError(re.sub(r"^env\.options\.make = ", f"{self.key} = ", str(exc), count=1)) from None

    @contextmanager
    def _own_random(self):
        with _RANDOM:
            outer = random.getstate()
            if self._random_state is not None:
                random.setstate(self._random_state)
            try:
                yield
            finally:
                self._random_state = random.getstate()
                random.setstate(outer)

    @property
    def _state(self):
        return self.env.state

    # ------------------------------------------------------------------ the Game protocol
    def reset(self, seed: int) -> None:
        env = self._make()   # fresh: the library's wrappers (and Kuhn poker's deck) outlive its reset
        self._random_state = None   # TextArena seeds `random` itself at reset
        try:
            with self._own_random():
                env.reset(num_players=len(ROLES), seed=int(seed))
        except Exception as exc:   # noqa: BLE001 - a one-player game, a game needing NLTK data, ...
            hint = _download_hint(exc)
            raise PluginError(f"{self.key} = {self.name}: the game cannot start with two players: "
                              f"{one_line(exc).rstrip('.') if hint else one_line(exc)}{hint}") from None
        self.env = env
        self._done = False
        self._rewards: dict[str, float] = {}
        self._game_info: dict = {}
        self._log = {role: "" for role in ROLES}     # the role's observation as last read
        self._shown = {role: "" for role in ROLES}   # ... as it stood when the role last moved

    def to_move(self) -> str | None:
        return None if self._done else ROLES[self._state.current_player_id]

    def observe(self, role: str) -> str:
        if role not in ROLES:
            raise ValueError(f"{self.name} has no role {role!r}; its roles are {', '.join(ROLES)}")
        if role == self.to_move():
            pid, log = self.env.get_observation()
            if ROLES[pid] == role:
                self._log[role] = log if isinstance(log, str) else str(log)
        log, shown = self._log[role], self._shown[role]
        return log[len(shown):] if log.startswith(shown) else log

    def legal_moves(self) -> list[str]:
        if not self.lists_legal_moves:
            raise PluginError(f"{self.key} = {self.name}: turnrl cannot list this game's legal moves (TextArena "
                              f"does not; turnrl reads them for {', '.join(_short(c) for c in LEGAL_MOVES)}), so a "
                              f"scripted player (random, first) cannot play it: let the policy play every role")
        mover = self.to_move()
        if mover is None:
            return []
        return LEGAL_MOVES[self.game_class](_unwrapped(self.env), self._state, ROLES.index(mover))

    def play(self, text: str) -> Move:
        mover = self.to_move()
        if mover is None:
            raise RuntimeError(f"{self.name}: play() after the game ended")
        pid = ROLES.index(mover)
        errors_before = getattr(self._state, "error_count", 0)
        with self._own_random():
            done, _info = self.env.step(text)
        self._shown[mover] = self._log[mover]
        if done:
            self._finish()
            if self._game_info.get(pid, {}).get("invalid_move"):
                reason = str(self._game_info[pid].get("reason") or "an invalid move")
                return Move(False, f"{reason.rstrip('.')}. TextArena ends the game: {_invalid_limit(self._state)}")
            return Move()
        if getattr(self._state, "error_count", 0) > errors_before:
            return Move(False, self._retry_reason(pid))
        return Move()

    def rewards(self) -> dict[str, float]:
        return dict(self._rewards) if self._done else {role: 0.0 for role in ROLES}

    # ------------------------------------------------------------------ helpers
    def _finish(self) -> None:
        with self._own_random():
            rewards, game_info = self.env.close()
        self._done = True
        self._game_info = dict(game_info or {})
        self._rewards = {role: float((rewards or {}).get(pid, 0.0)) for pid, role in enumerate(ROLES)}

    def _retry_reason(self, pid: int) -> str:
        """The library's reason, from the message it queued for the mover (read, not taken)."""
        for _sender, message, _kind in reversed(self._state.observations.get(pid, [])):
            found = _RETRY_REASON.search(str(message))
            if found:
                return found.group(1).strip() or "an invalid move"
        return "an invalid move by TextArena's rules"

    def __repr__(self) -> str:
        return f"TextArenaGame({self.name!r})"


def _invalid_limit(state) -> str:
    allowance = getattr(state, "error_allowance", 1)
    return f"{allowance + 1} invalid moves in a row lose (the mover -1, the other +1)"


def _short(class_path: str) -> str:
    return class_path.rsplit(".", 1)[-1].removesuffix("Env")


def textarena_game(env_id: str, kwargs: dict[str, Any] | None = None, key: str = "env.options.game") -> TextArenaGame:
    """`textarena:<env_id>` as a `Game`: a PluginError in one line naming `key` if the library does
    not know the id, the kwargs do not fit, or the game cannot start with two players."""
    return TextArenaGame(env_id, kwargs, key)
