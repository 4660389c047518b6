"""Rolling out games of several players (`env.name: game`, turnrl.games): the
`EpisodeRunner` that seats the policy and its opponents at tables.

    for each row (a game seed and the role it trains) and each of its n games: a table
        the row's role                -> a policy seat: trajectory k of the row's group
        every other role              -> the row's opponent (example["opponent"], else env.options.opponent):
                                         a scripted player, a frozen model on an engine of its own
                                         (checkpoint:<folder>, or past:<N>[:<K>], a past self:
                                         turnrl.games.league), or `self`: another policy seat
    self-play seats rows together: a row training role r and later rows training the game's other
    roles share their k-th tables (the first row's game seed; rows of one seed join first), so one
    game trains every seat (one generation, not one per role); a table whose rows do not fill every
    role plays the rest with policy seats that are sampled and not trained.

Every policy seat is a trajectory of a `BatchRollout`: its prompt is the system prompt and
what the game shows it when it is first to move; each of its turns is a move, and the
observation after it is what the game shows it when it is next to move (the other seats' moves
happen while its answer waits: it rejoins then, as a slow tool's answer would). Only policy
seats have tokens, so the loss mask covers only the roles the policy plays; a row's role is the
only one its trajectories train, and each group is one (game seed, role): group normalisation
is within role.

An illegal move follows env.options.illegal (the game ends, or the mover retries); a seat the
loop ends (its turn cut by the token limit, its budget spent) loses as an illegal move would; at
rollout.max_turns the game ends drawn. A game or player that raises ends its table's seats as
environment errors; the other tables go on.
"""
from __future__ import annotations

import math
import random
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from turnrl.envs.base import StepResult
from turnrl.games.base import SELF, Checkpoint, Game, Past, Player, illegal_move_rewards, make_player
from turnrl.games.league import Leagues, Tensors, model_engine
from turnrl.games.table import GameTable, opponent_rng
from turnrl.rollout.chat import ChatFormat
from turnrl.rollout.multi_turn import ENV_ERROR, BatchRollout, Budgets, Sample, Trajectory, error_result

GAME_OVER = "game_over"
SCRIPTED_MOVES = 10_000   # scripted moves in a row before a game that never hands the turn on is ended


@dataclass
class _Seat:
    """A seat a model plays (the policy, or a frozen checkpoint or past self on `engine`): the
    trajectory at `index` plays `role`."""
    table: "_Table"
    role: str
    index: int
    started: bool = False
    ended: bool = False
    illegal: int = 0                 # its illegal moves in this game
    moves: int = 0                   # its moves, legal or not
    retries: int = 0                 # illegal moves in a row, this turn
    reward_since: float = 0.0        # per-turn rewards since its last move
    answer: Future | None = None     # its last move's answer: set when it is next to move, or the game ends
    engine: Any = None               # a frozen checkpoint's or past self's engine; None: the policy's


@dataclass
class _Table:
    game: Game | None             # None: it could not start (`failed` says why)
    seed: int
    players: dict[str, Player]                      # the scripted roles
    seats: dict[str, _Seat] = field(default_factory=dict)   # the policy's roles
    rng: random.Random = field(default_factory=random.Random)
    over: bool = False
    moves: list[tuple[str, str, str, bool]] = field(default_factory=list)   # (role, player, move, legal)
    names: dict[str, str] = field(default_factory=dict)     # the scripted roles' player names
    failed: BaseException | None = None                     # why the table could not open
    past_version: int | None = None                         # a past self's snapshot: the weight push it holds


_FROZEN: dict[str, Any] = {}   # folder -> its engine, loaded once per process


def frozen_engine(folder: str) -> Any:
    """The engine of a frozen checkpoint opponent (transformers, CPU), loaded on first use."""
    from pathlib import Path
    key = str(Path(folder).resolve())
    if key not in _FROZEN:
        _FROZEN[key] = model_engine(folder, f"checkpoint:{folder}",
                                    "name a saved checkpoint such as models/initial (the warm start)")
    return _FROZEN[key]


def others_moves(moves: Sequence[tuple[str, str, str, bool]], role: str) -> list[dict]:
    """The other roles' moves as `role`'s seat met them: each with `turn`, the seat's own turn it
    came after (-1: before its first), for traces (a span per move, the player named)."""
    turn, out = -1, []
    for mover, player, text, legal in moves:
        if mover == role:
            turn += 1
        else:
            out.append({"turn": turn, "role": mover, "player": player, "move": text, "legal": legal})
    return out


def opponent_of(example: dict, table_env: GameTable) -> str:
    return str(example.get("opponent") or table_env.opponent)


def table_rows(examples: Sequence[dict], table_env: GameTable) -> list[tuple[int, ...]]:
    """The rows of each table, in order: a self-play row joins an earlier table still missing its
    role (one of its own game seed first), so that a game of N players trains up to N seats; a row
    against an opponent sits alone."""
    tables: list[list[int]] = []
    open_tables: list[int] = []      # indices into tables of self-play tables with a role still free
    for e, example in enumerate(examples):
        if opponent_of(example, table_env) != SELF:
            tables.append([e])
            continue
        free = [t for t in open_tables if example["role"] not in {examples[i]["role"] for i in tables[t]}]
        same_seed = [t for t in free if examples[tables[t][0]].get("game_seed") == example.get("game_seed")]
        match = (same_seed or free or [None])[0]
        if match is None:
            open_tables.append(len(tables))
            tables.append([e])
            continue
        tables[match].append(e)
        if len(tables[match]) == len(table_env.roles):
            open_tables.remove(match)
    return [tuple(rows) for rows in tables]


class _Tables(BatchRollout):
    """One `GameRunner.run`: the batch's tables, rolled out together (a `BatchRollout` whose
    batch opens with the seats that move first, and whose env steps are the games' moves)."""

    def __init__(self, engine: Any, examples: Sequence[dict], table_env: GameTable, fmt: ChatFormat,
                 budgets: Budgets, *, n: int, temperature: float, top_p: float, seed: int | None,
                 progress: bool = False, desc: str = "rollout",
                 on_group_done: Callable[[list[Trajectory]], None] | None = None,
                 on_trajectory_done: Callable[[Trajectory], None] | None = None, opponent: str | None = None,
                 leagues: Leagues | None = None):
        for e, example in enumerate(examples):
            if example.get("role") not in table_env.roles:
                raise ValueError(f"row {example.get('id', e)!r}: role {example.get('role')!r} is not a role of the "
                                 f"game {table_env.game_name} ({', '.join(table_env.roles)}); remake the data "
                                 "(dvc repro preprocess) after changing env.options.game")
        batch = [Trajectory(example=ex, prompt_ids=[]) for ex in examples for _ in range(n)]
        super().__init__(engine, [table_env] * len(batch), batch, fmt, budgets, temperature=temperature, top_p=top_p,
                         seed=seed, observation_lag=0, rejoin="ready", progress=progress, desc=desc, group_size=n,
                         on_group_done=on_group_done, on_trajectory_done=on_trajectory_done)
        self.env, self.n = table_env, n
        self.leagues = leagues if leagues is not None else Leagues()   # the past selves' engines
        self.seat_of: dict[int, _Seat] = {}
        self.extra = len(self.batch)        # the next index of a seat of its own (untrained)
        self.tables = [self._open(examples, rows, k, opponent) for rows in table_rows(examples, table_env)
                       for k in range(n)]

    # ------------------------------------------------------------------ seating
    def _open(self, examples: Sequence[dict], rows: tuple[int, ...], k: int, opponent: str | None) -> _Table:
        first = examples[rows[0]]
        seed = int(first["game_seed"])
        table = _Table(game=None, seed=seed, players={}, rng=opponent_rng(seed, k))
        try:   # a game that cannot start, or a row's opponent that cannot be made, fails its own table
            table.game = self.env.new_game()
            table.game.reset(seed)
        except Exception as exc:   # noqa: BLE001
            table.failed = exc
        by_role = {examples[i]["role"]: i * self.n + k for i in rows}
        name = opponent or opponent_of(first, self.env)
        for role in table.game.roles if table.failed is None else self.env.roles:
            engine = None
            if role in by_role:
                index = by_role[role]
            elif name == SELF:      # an untrained policy seat
                index, self.extra = self.extra, self.extra + 1
                self.trajs[index] = Trajectory(example={**first, "role": role, "trained": False}, prompt_ids=[])
            else:
                table.names[role] = name
                try:
                    player = make_player(name, "the row's opponent" if first.get("opponent") else "env.options.opponent")
                except Exception as exc:   # noqa: BLE001
                    table.failed = table.failed or exc
                    continue
                if not isinstance(player, (Checkpoint, Past)):
                    table.players[role] = player
                    continue
                index, self.extra = self.extra, self.extra + 1     # a frozen model's seat: untrained
                self.trajs[index] = Trajectory(example={**first, "role": role, "trained": False}, prompt_ids=[])
                try:   # a past self: one of its league's snapshots, drawn by the table's generator
                    if isinstance(player, Checkpoint):
                        engine = frozen_engine(player.folder)
                    else:
                        table.past_version, engine = self.leagues.draw(player, table.rng)
                except Exception as exc:   # noqa: BLE001
                    table.failed = table.failed or exc
            table.seats[role] = self.seat_of[index] = _Seat(table, role, index, engine=engine)
            if index < len(self.batch):
                self.trajs[index] = self.batch[index]
        return table

    def open(self) -> None:
        """Each table plays its scripted roles until a policy seat is to move."""
        for table in self.tables:
            if table.failed is not None:
                self._fail(table, table.failed)
            else:
                self._advance(table)

    # ------------------------------------------------------------------ the game's side
    def _advance(self, table: _Table) -> None:
        """Play the scripted roles until a policy seat is to move (its turn starts) or the game ends."""
        scripted = 0   # moves of scripted roles in a row: a game that never gives a policy seat the turn ends
        try:
            while not table.over:
                role = table.game.to_move()
                if role is None:
                    return self._finish(table, GAME_OVER)
                if role not in table.game.roles:
                    raise ValueError(f"the game {self.env.game_name}'s to_move() returned {role!r}, not one of its "
                                     f"roles {list(table.game.roles)}")
                observation = table.game.observe(role)
                if not isinstance(observation, str):
                    raise TypeError(f"the game {self.env.game_name}'s observe({role!r}) returned "
                                    f"{type(observation).__name__} {observation!r:.60}; it must return the board "
                                    "as text")
                if role in table.seats:
                    return self._give_turn(table.seats[role], observation)
                scripted += 1
                if scripted > SCRIPTED_MOVES:
                    raise RuntimeError(f"the game {self.env.game_name} gave the scripted players {SCRIPTED_MOVES} "
                                       "moves in a row without a policy seat's turn; does to_move() hand the turn on?")
                move = self._act(table, role, observation)
                self._apply(table, role, str(move))
        except Exception as exc:   # noqa: BLE001 - a broken game or player ends its own table only
            self._fail(table, exc)

    def _act(self, table: _Table, role: str, observation: str) -> str:
        """A scripted role's move, on a thread of its own, waited for env.options.player_timeout_s
        (a player that hangs ends its table; its thread is left to finish)."""
        work = self.pool.submit(table.players[role].act, observation, table.game.legal_moves(), table.rng)
        try:
            return work.result(timeout=self.env.player_timeout_s)
        except FutureTimeout:
            raise TimeoutError(f"the {role} player {table.names[role]!r} gave no move within "
                               f"env.options.player_timeout_s = {self.env.player_timeout_s:g} s") from None

    def _apply(self, table: _Table, role: str, text: str) -> None:
        """The mover's move; an illegal one ends the game or is retried (env.options.illegal)."""
        for end in (self.fmt.end_of_turn, self.fmt.eos_token):   # the token that closed a policy turn: not the move's
            text = text[:-len(end)] if end and text.endswith(end) else text
        move = table.game.play(text)
        if not isinstance(getattr(move, "legal", None), bool):
            raise TypeError(f"the game {self.env.game_name}'s play() returned {type(move).__name__} {move!r:.60}; it "
                            "must return a Move(legal: bool, ...)")
        for other, reward in (move.rewards or {}).items():
            if not isinstance(reward, (int, float)) or isinstance(reward, bool) or not math.isfinite(reward):
                raise ValueError(f"the game {self.env.game_name}'s play() gave {other!r} the reward {reward!r}, not a "
                                 "finite number")
        seat = table.seats.get(role)
        if seat is not None:
            seat.moves += 1
        table.moves.append((role, table.names.get(role, "policy"), text.strip()[:200], move.legal))
        for other, reward in (move.rewards or {}).items():
            if other in table.seats:
                table.seats[other].reward_since += float(reward)
        if move.legal:
            if seat is not None:
                seat.retries = 0
            return
        if seat is not None:
            seat.illegal += 1
        if table.game.to_move() is None:   # the game's own rule ended it (TextArena's second invalid move)
            return self._finish(table, "illegal_move")
        if seat is not None:
            if self.env.illegal == "retry" and seat.retries < self.env.max_retries:
                seat.retries += 1
                return self._give_turn(seat, f"Illegal move: {move.why}. {table.game.observe(role)}")
        self._finish(table, "illegal_move", offender=role)

    def _give_turn(self, seat: _Seat, observation: str) -> None:
        t = self.trajs[seat.index]
        if not seat.started:
            system = self.env.system_for(seat.table.game, seat.role)
            t.prompt_ids = self.fmt.prompt_ids(system, observation)
            t.messages = ([{"role": "system", "content": system}] if system else []) + \
                [{"role": "user", "content": observation}]
            seat.started = True   # (after the prompt: a seat whose prompt failed has no answer to wait for)
            self.admit(seat.index, self.env, t)
            return
        reward, seat.reward_since = seat.reward_since, 0.0
        seat.answer.set_result((StepResult(observation, reward, False, {}), (time.time(), time.time())))

    def _rewards(self, table: _Table, reason: str, offender: str | None) -> dict[str, float]:
        roles = table.game.roles
        if offender is not None:
            return illegal_move_rewards(roles, offender, self.env.illegal_reward,
                                        zero_sum=getattr(table.game, "reward_sum", None) == 0.0)
        if reason == "max_turns":
            return {r: 0.0 for r in roles}
        given = table.game.rewards()
        if not isinstance(given, dict) or set(given) != set(roles):
            kind = sorted(map(str, given)) if isinstance(given, dict) else type(given).__name__
            raise ValueError(f"the game {self.env.game_name}'s rewards() gave {kind}; it must give a number for each "
                             f"of its roles {list(roles)}")
        bad = {r: v for r, v in given.items() if isinstance(v, bool) or not isinstance(v, (int, float))
               or not math.isfinite(v)}
        if bad:
            raise ValueError(f"the game {self.env.game_name}'s rewards() gave {bad}, not finite numbers")
        rewards = {r: float(v) for r, v in given.items()}
        expected = getattr(table.game, "reward_sum", None)
        if expected is not None and abs(sum(rewards.values()) - expected) > 1e-6:
            raise ValueError(f"the game {self.env.game_name}'s rewards {rewards} sum to {sum(rewards.values())}, "
                             f"not its reward_sum {expected}")
        return rewards

    def _finish(self, table: _Table, reason: str, offender: str | None = None) -> None:
        """The game is over: every policy seat gets its role's reward as its outcome."""
        try:
            rewards = self._rewards(table, reason, offender)
        except Exception as exc:   # noqa: BLE001
            return self._fail(table, exc)
        table.over = True
        transcript = " | ".join(f"{role}: {text[:40]}" + ("" if legal else " (illegal)")
                                for role, _, text, legal in table.moves)
        for role, seat in table.seats.items():
            r = rewards.get(role, 0.0)
            info = {"outcome": r, "reason": reason, "win": float(r > 0), "draw": float(r == 0), "loss": float(r < 0),
                    "illegal_moves": float(seat.illegal), "illegal_move_rate": seat.illegal / max(1, seat.moves),
                    "first_mover": float(role == table.game.roles[0]), "game_moves": float(len(table.moves)),
                    "transcript": transcript, "opponent_moves": others_moves(table.moves, role)}
            if table.past_version is not None:   # logged as env_opponent_version_mean: how old the past self is
                info["opponent_version"] = float(table.past_version)
            if offender is not None and role != offender:   # the game ended on another role's move, not this seat's
                info["reason"] = f"opponent_{reason}"
            self._end_seat(seat, StepResult(None, seat.reward_since, True, info))

    def _fail(self, table: _Table, exc: BaseException) -> None:
        table.over = True
        for seat in table.seats.values():
            self._end_seat(seat, error_result(exc))

    def _end_seat(self, seat: _Seat, result: StepResult) -> None:
        t = self.trajs[seat.index]
        if seat.ended:                      # the loop ended it (cut off, out of budget): keep its finish
            t.outcome = float(result.info.get("outcome", t.outcome))
            t.info.update({k: v for k, v in result.info.items() if k != "reason"})
        elif seat.started:                  # waiting for its move's answer: the game's end is the answer
            seat.answer.set_result((result, (time.time(), time.time())))
        else:                               # the game ended before its first move: what it would have seen
            system = self.env.system_for(seat.table.game, seat.role)
            try:
                seen = str(seat.table.game.observe(seat.role))
            except Exception:   # noqa: BLE001 - a game that cannot show a finished board
                seen = ""
            t.prompt_ids = self.fmt.prompt_ids(system, seen)
            t.messages = ([{"role": "system", "content": system}] if system else []) + \
                ([{"role": "user", "content": seen}] if seen else [])
            self.envs[seat.index] = self.env
            t.record(result)
            t.turn_rewards.clear()          # no turn was played
            self.end(seat.index)

    # ------------------------------------------------------------------ the engine's side
    def engine_for(self, i: int, level: str) -> Any:
        seat = self.seat_of.get(i)
        return seat.engine if seat is not None and seat.engine is not None else super().engine_for(i, level)

    def env_step(self, i: int, text: str) -> Future:
        """Seat i's move: its answer is set when it is next to move, or when the game ends."""
        seat = self.seat_of[i]
        seat.answer = Future()
        table = seat.table
        try:
            self._apply(table, seat.role, text)
            if not seat.answer.done():   # legal, the game goes on: the others move until a seat is to
                self._advance(table)
        except Exception as exc:   # noqa: BLE001
            self._fail(table, exc)
        return seat.answer

    def end(self, i: int, finish: str | None = None) -> None:
        """Seat i ended. Where the loop ended it mid-game, its game ends first (so the group
        handed out below has every seat's outcome): max_turns draws, an environment error fails
        the table, a cut-off turn or a spent budget loses as an illegal move would."""
        seat = self.seat_of.get(i)
        if seat is not None and not seat.ended:
            seat.ended = True
            reason = finish or self.trajs[i].finish
            if not seat.table.over:
                if reason == ENV_ERROR:
                    self._fail(seat.table, RuntimeError(self.trajs[i].info.get("env_error", "environment error")))
                elif reason == "max_turns":
                    self._finish(seat.table, "max_turns")
                else:            # truncated / token_budget: no move came, as an illegal one
                    seat.illegal += 1
                    seat.moves += 1
                    self._finish(seat.table, "no_move", offender=seat.role)
        super().end(i, finish)


class _ScriptEngine:
    """An engine that answers seat turns with a demonstration's moves, in order (the warm start)."""

    def __init__(self, fmt: ChatFormat, turns: Sequence[str]):
        self.fmt, self.turns = fmt, list(turns)

    def generate(self, prompts, *, max_tokens, stop, temperature, top_p, seeds) -> list[Sample]:
        out = []
        for _ in prompts:
            ids = self.fmt.encode(self.turns.pop(0) if self.turns else "")
            if self.fmt.end_of_turn_id is not None and not self.fmt.ends_turn(ids):
                ids.append(self.fmt.end_of_turn_id)
            out.append(Sample(ids, [0.0] * len(ids), "stop"))
        return out


def _roll(tables: _Tables) -> list[Trajectory]:
    """Roll the tables out; the scripted players move on threads of a pool of their own (left
    behind, not waited for, where one hangs past env.options.player_timeout_s)."""
    pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="turnrl-player")
    try:
        tables.run(pool)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return tables.batch


class GameRunner:
    """The `EpisodeRunner` of `env.name: game`. Its past selves (`past:` opponents) are the
    policy's weights as pushed (`turnrl.games.league`): `bind` names the folder they start from."""

    def __init__(self):
        self.leagues = Leagues()

    def bind(self, model_dir: str) -> None:
        """The policy's starting folder (the rollout actor's model): where past selves start."""
        self.leagues.folder = str(model_dir)

    def run(self, engine, examples, make_env, fmt, budgets, *, n: int = 1, temperature: float = 1.0,
            top_p: float = 1.0, seed: int | None = None, progress: bool = False, desc: str = "rollout",
            on_group_done=None, on_trajectory_done=None, **_: Any) -> list[Trajectory]:
        """n trajectories per row (trajectory i of row i // n), each the row's role's seat."""
        if not examples:
            return []
        table_env = make_env()
        self.leagues.open([table_env.opponent, *table_env.eval_opponents,
                           *(opponent_of(e, table_env) for e in examples)])
        return _roll(_Tables(engine, examples, table_env, fmt, budgets, n=n, temperature=temperature, top_p=top_p,
                             seed=seed, progress=progress, desc=desc, on_group_done=on_group_done,
                             on_trajectory_done=on_trajectory_done, leagues=self.leagues))

    def stream(self, engine, make_env, fmt, budgets, **options):
        raise NotImplementedError("env.name: game is rolled out in train.mode: sync only for now; set "
                                  "-S train.mode=sync")

    def replay(self, make_env: Callable[[], GameTable], fmt: ChatFormat, example: dict,
               turns: Sequence[str]) -> Trajectory:
        """A demonstration's moves for the row's role, replayed through the real game against
        env.options.demonstration_opponent (seeded as `turnrl.games.table.demonstration_turns`)."""
        table_env = make_env()
        budgets = Budgets(max_turns=max(1, len(turns)), max_tokens_per_turn=1 << 20, max_tokens_total=1 << 30)
        return _roll(_Tables(_ScriptEngine(fmt, turns), [example], table_env, fmt, budgets, n=1, temperature=0.0,
                             top_p=1.0, seed=None, opponent=table_env.demonstration_opponent))[0]

    def load_weights(self, version: int, apply: Callable[[], None], weights: Tensors | None = None) -> None:
        """The policy's new weights (`apply`), and a snapshot of them (`weights`) for each past
        self whose N divides the pushes so far (between two rollouts: no table is running)."""
        apply()
        if weights is not None:
            self.leagues.push(weights)

    def close(self) -> None:
        pass
