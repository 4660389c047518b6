"""Games of several players: `env.name: game`, self-play and fixed opponents.

A game is a small stateful object, one per table (an episode):

    game.roles                    ("first", "second"): who plays, in seating order
    game.reset(seed)              a fresh game (the row's `game_seed`)
    game.to_move() -> role|None   whose turn it is; None when the game is over
    game.observe(role) -> str     what `role` is shown when it is to move (the state, the rules' reminder)
    game.legal_moves() -> [str]   the mover's legal moves, each as a text it could play
    game.play(text) -> Move       the mover's turn as it wrote it (no end-of-turn token): Move(legal, why, rewards)
    game.rewards() -> {role: r}   each role's reward, once the game is over

Optional: `reward_sum` (what the roles' final rewards sum to, e.g. 0.0 for a zero-sum game;
checked at every game's end, a game that breaks it ends as an environment error),
`system_prompt(role)`, and `lists_legal_moves = False` for a game whose `legal_moves` cannot
list them (scripted players cannot play it: refused when the options are read). A `play` that
returns an illegal move and leaves no one to move ended the game by its own rule. A `Move`'s
`rewards` are per-turn rewards where the game gives them.

Who plays a role is a `Player` (the policy's roles excepted): anything with
`act(observation, legal_moves, rng) -> str`. The built-ins: `random` (a random legal move),
`first` (the first legal move), `endpoint:<base_url>[#model]` (any OpenAI-compatible server); a
user's player by import path `module:factory` (the factory called with no arguments). A frozen
model, `checkpoint:<folder>` (e.g. the warm start models/initial), plays a seat of its own on its
own engine, as the policy's seats do, never trained; so does a past self, `past:<N>` (the policy
as of its last weight push at a multiple of N updates) or `past:<N>:<K>` (a league of its last K
such snapshots, each table drawing one: `turnrl.games.league`). `self` names the policy: both roles sample
from the same engines and each role's turns are a trajectory of its own (`turnrl.games.tables`
rolls the tables out).

Rows: one per (game seed, trained role), so each group of rollout.n trajectories shares a game
and a role, and group normalisation is within role; the held-out split has a row per (seed,
role, evaluation opponent), its `subject` "<role> vs <opponent>", so the evaluation's
`by_subject` reports each role against each opponent. `info` at the end: win, draw, loss,
illegal_moves, illegal_move_rate (of the seat's moves), first_mover, game_moves and the game's
transcript; numbers are logged as env_<key>_mean in training, and win, draw, loss and
illegal_move_rate are the task block's `eval_metrics` (overall, greedy and per subject).
"""
from __future__ import annotations

from turnrl.envs.base import EnvSpec
from turnrl.games.base import SELF, Game, Move, Player, make_player
from turnrl.games.table import GameOptions, GameTable, make_game, task


def _runner():
    from turnrl.games.tables import GameRunner
    return GameRunner


ENV = EnvSpec(factory=GameTable, options=GameOptions, name="game", runner=_runner, task_from_options=task,
              eval_metrics=("win", "draw", "loss", "illegal_move_rate"))

__all__ = ["ENV", "SELF", "Game", "GameOptions", "GameTable", "Move", "Player", "make_game", "make_player"]
