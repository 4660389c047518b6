"""Games of several players (`env.name: game`): the protocol with scripted games, the tables
runner (turn order, per-role rewards, masks over the policy's roles only, self-play pairing,
illegal moves, faults), the rows, the warm start's replays, and role-conditioned advantages."""
import random
import re

import pytest
import torch
from transformers import AutoTokenizer

from turnrl import envs
from turnrl.algos import advantages as adv
from turnrl.algos.registry import AdvantageInputs
from turnrl.algos.registry import resolve as resolve_algorithm
from turnrl.games import GameTable, make_player
from turnrl.games.builtin import Nim, TicTacToe
from turnrl.games.tables import GameRunner, table_rows
from turnrl.plugins import PluginError
from turnrl.rollout.chat import ChatFormat
from turnrl.rollout.multi_turn import ENV_ERROR, Budgets, Sample

BUDGETS = Budgets(max_turns=10, max_tokens_per_turn=16, max_tokens_total=400)


@pytest.fixture(scope="module")
def fmt(tiny_model_dir):
    return ChatFormat(AutoTokenizer.from_pretrained(tiny_model_dir))


class MoveEngine:
    """Answers each seat's turn with `pick(prompt text)`: a stand-in for the model in these unit
    tests of the runner around it. Records the prompts it saw."""

    def __init__(self, fmt, pick, finish="stop"):
        self.fmt, self.pick, self.finish, self.prompts = fmt, pick, finish, []

    def generate(self, prompts, *, max_tokens, stop, temperature, top_p, seeds):
        out = []
        for p in prompts:
            text = self.fmt.tokenizer.decode(p)
            self.prompts.append(text)
            ids = self.fmt.encode(self.pick(text)) + [self.fmt.end_of_turn_id]
            out.append(Sample(ids, [-0.5] * len(ids), self.finish))
        return out


def last_heap(text: str) -> int:
    return int(re.findall(r"Heap (\d+)", text)[-1])


def game_env(**options):
    spec = envs.resolve("game")
    checked = envs.check_options(spec, options)
    return spec, spec.bind(checked), spec.task_for(checked)


def test_nim_and_tictactoe_follow_their_rules():
    nim = Nim()
    nim.reset(3)
    start = nim.heap
    assert nim.to_move() == "first" and nim.legal_moves() == ["1", "2", "3"][:min(3, start)]
    assert not nim.play("take 4").legal and nim.heap == start and nim.to_move() == "first"   # unchanged
    while nim.to_move() is not None:
        mover = nim.to_move()
        assert nim.play(nim.legal_moves()[-1]).legal
    assert nim.rewards()[mover] == 1.0 and sum(nim.rewards().values()) == 0.0   # who took the last won

    ttt = TicTacToe()
    ttt.reset(0)
    for cell in ("1", "4", "2", "5"):
        assert ttt.play(f"cell {cell}").legal
    assert not ttt.play("4").legal and ttt.to_move() == "first"                   # taken
    assert ttt.play("3").legal and ttt.to_move() is None
    assert ttt.rewards() == {"first": 1.0, "second": -1.0}
    assert "You are O" in TicTacToe().observe("second")


def test_self_play_pairs_rows_and_each_seat_is_its_own_trajectory(fmt):
    _, make, task = game_env(game="nim")
    rows = task.rows(4, seed=0, split="train", exclude=set())
    assert [r["role"] for r in rows] == ["first", "second", "first", "second"]
    assert rows[0]["game_seed"] == rows[1]["game_seed"] and rows[0]["game"] == "nim"
    assert table_rows(rows, make()) == [(0, 1), (2, 3)]
    groups = []
    engine = MoveEngine(fmt, lambda text: str(min(3, last_heap(text))))
    trajs = GameRunner().run(engine, rows, make, fmt, BUDGETS, n=2, on_group_done=groups.append)
    assert len(trajs) == 8 and len(groups) == 4 and all(len(g) == 2 for g in groups)
    for k in range(2):            # row 0's k-th and row 1's k-th trajectories sat at one table
        first, second = trajs[k], trajs[2 + k]
        assert first.example["role"] == "first" and second.example["role"] == "second"
        assert first.outcome + second.outcome == 0.0 and {first.outcome, second.outcome} == {1.0, -1.0}
        assert first.info["transcript"] == second.info["transcript"]
        moves = first.info["transcript"].split(" | ")
        assert [m.split(":")[0] for m in moves] == ["first", "second"] * (len(moves) // 2) + ["first"] * (len(moves) % 2)
        # each seat's tokens: its own moves trained (mask 1), the game's messages not (mask 0)
        assert first.num_turns == (len(moves) + 1) // 2 and second.num_turns == len(moves) // 2
        for t in (first, second):
            assert t.finish == "game_over" and t.info["illegal_moves"] == 0.0
            assert sum(t.loss_mask) == t.num_turns * 2     # "3" + end of turn, per move
            assert t.info["first_mover"] == float(t.example["role"] == "first")
    # the second mover's prompt already shows the first mover's move
    heap = Nim()
    heap.reset(rows[1]["game_seed"])
    assert f"Heap {heap.heap - 3}" in fmt.tokenizer.decode(trajs[2].prompt_ids)


def test_a_scripted_opponent_plays_the_other_role_and_only_the_row_role_is_trained(fmt):
    _, make, task = game_env(game="tictactoe", opponent="random")
    row = task.rows(2, seed=0, split="train", exclude=set())[1]
    assert row["role"] == "second"

    def free_cell(text):
        board = re.findall(r"Board: ([^ .]+)", text)[-1].replace("/", "")
        return next(c for c in board if c.isdigit())
    trajs = GameRunner().run(MoveEngine(fmt, free_cell), [row], make, fmt, BUDGETS, n=3, seed=5)
    assert len(trajs) == 3
    for t in trajs:
        moves = t.info["transcript"].split(" | ")
        assert moves[0].startswith("first:") and t.num_turns == sum(m.startswith("second") for m in moves)
        assert t.info["win"] + t.info["draw"] + t.info["loss"] == 1.0
        assert "You are O" in fmt.tokenizer.decode(t.prompt_ids)
    # the opponent's generator is seeded per (game seed, table): the same run gives the same games
    again = GameRunner().run(MoveEngine(fmt, free_cell), [row], make, fmt, BUDGETS, n=3, seed=5)
    assert [t.info["transcript"] for t in again] == [t.info["transcript"] for t in trajs]


def test_an_illegal_move_ends_the_game_or_is_retried(fmt):
    _, make, task = game_env(game="nim", opponent="first")
    row = task.rows(1, seed=0, split="train", exclude=set())[0]
    [t] = GameRunner().run(MoveEngine(fmt, lambda text: "7"), [row], make, fmt, BUDGETS)
    assert t.finish == "illegal_move" and t.outcome == -1.0 and t.info["illegal_moves"] == 1.0 and t.num_turns == 1

    _, make, _ = game_env(game="nim", opponent="first", illegal="retry", max_retries=1)
    answers = iter(["7", "1"] * 20)
    engine = MoveEngine(fmt, lambda text: next(answers))
    [t] = GameRunner().run(engine, [row], make, fmt, Budgets(max_turns=40, max_tokens_per_turn=16,
                                                            max_tokens_total=4000))
    assert "Illegal move: 7 is not 1, 2 or 3" in engine.prompts[1]
    assert t.finish == "game_over" and t.info["illegal_moves"] >= 1 and t.num_turns > 2

    _, make, _ = game_env(game="nim", opponent="first", illegal="retry", max_retries=1, illegal_reward=-2.0)
    [t] = GameRunner().run(MoveEngine(fmt, lambda text: "9"), [row], make, fmt, BUDGETS)
    assert t.finish == "illegal_move" and t.outcome == -2.0 and t.info["illegal_moves"] == 2.0   # one retry, then out


def test_a_cut_off_turn_loses_and_max_turns_draws(fmt):
    _, make, task = game_env(game="nim")
    rows = task.rows(2, seed=0, split="train", exclude=set())
    trajs = GameRunner().run(MoveEngine(fmt, lambda text: "1", finish="length"), rows, make, fmt, BUDGETS)
    assert trajs[0].finish == "truncated" and trajs[0].outcome == -1.0
    assert trajs[1].outcome == 1.0 and trajs[1].num_turns == 0 and trajs[1].finish == "opponent_no_move"   # never moved
    assert trajs[1].messages[-1] == {"role": "user", "content": trajs[1].messages[-1]["content"]}   # what it was shown
    assert "Heap" in trajs[1].messages[-1]["content"]
    short = Budgets(max_turns=1, max_tokens_per_turn=16, max_tokens_total=400)
    trajs = GameRunner().run(MoveEngine(fmt, lambda text: "1"), rows, make, fmt, short)
    assert {t.finish for t in trajs} == {"max_turns"} and all(t.outcome == 0.0 and t.info["draw"] for t in trajs)


class Broken(Nim):
    """Crashes a few moves into every game whose heap starts odd."""

    def reset(self, seed):
        super().reset(seed)
        self.start = self.heap

    def play(self, text):
        if self.start % 2 and self.heap < self.start - 2:
            raise RuntimeError("the rules engine crashed")
        return super().play(text)


class Unfair(Nim):
    def rewards(self):
        return {"first": 1.0, "second": 1.0}


class ThreeCounts:
    """Three players say 1 or 2 in turn, two rounds; the largest total wins 1, the others lose
    0.5 each (zero-sum); anything else is an illegal move."""
    roles = ("a", "b", "c")
    reward_sum = 0.0

    def reset(self, seed):
        self.said = []

    def to_move(self):
        return self.roles[len(self.said) % 3] if len(self.said) < 6 else None

    def observe(self, role):
        return f"You are {role}. Said so far: {self.said}. Say 1 or 2."

    def legal_moves(self):
        return ["1", "2"]

    def play(self, text):
        from turnrl.games.base import Move
        if text.strip() not in ("1", "2"):
            return Move(legal=False, why=f"{text.strip()!r} is not 1 or 2")
        self.said.append(int(text.strip()))
        return Move()

    def rewards(self):
        totals = {r: sum(self.said[i::3]) for i, r in enumerate(self.roles)}
        best = max(totals, key=lambda r: (totals[r], -self.roles.index(r)))
        return {r: 1.0 if r == best else -0.5 for r in self.roles}


def test_a_game_of_three_players_trains_all_three_seats_and_an_illegal_move_balances(fmt):
    """Self-play seats three rows of the three roles at one table (rows of one game seed together,
    whatever their order); a zero-sum game's illegal move costs the mover 1 and gives each other 0.5."""
    from turnrl.games.base import illegal_move_rewards
    assert illegal_move_rewards(("a", "b", "c"), "b", -1.0, zero_sum=True) == {"a": 0.5, "b": -1.0, "c": 0.5}
    assert illegal_move_rewards(("x", "y"), "x", -1.0, zero_sum=True) == {"x": -1.0, "y": 1.0}
    assert illegal_move_rewards(("a", "b", "c"), "a", -2.0, zero_sum=False) == {"a": -2.0, "b": 0.0, "c": 0.0}
    _, make, task = game_env(game="tests.test_games:ThreeCounts")
    rows = task.rows(6, seed=0, split="train", exclude=set())
    assert sorted(r["role"] for r in rows) == ["a", "a", "b", "b", "c", "c"]
    mixed = [rows[0], rows[3], rows[1], rows[4], rows[2], rows[5]]   # two seeds' rows interleaved
    tables = table_rows(mixed, make())
    assert len(tables) == 2 and all(len({mixed[i]["game_seed"] for i in t}) == 1 for t in tables)
    assert all(sorted(mixed[i]["role"] for i in t) == ["a", "b", "c"] for t in tables)
    trajs = GameRunner().run(MoveEngine(fmt, lambda text: "2" if "You are a" in text else "1"), rows[:3], make, fmt,
                             BUDGETS)
    assert [t.example["role"] for t in trajs] == ["a", "b", "c"]
    assert len({t.info["transcript"] for t in trajs}) == 1 and all(t.num_turns == 2 for t in trajs)   # one table
    assert [t.outcome for t in trajs] == [1.0, -0.5, -0.5]
    trajs = GameRunner().run(MoveEngine(fmt, lambda text: "3" if "You are b" in text else "1"), rows[:3], make, fmt,
                             BUDGETS)
    assert [t.outcome for t in trajs] == [0.5, -1.0, 0.5] and trajs[1].finish == "illegal_move"


def test_a_broken_game_ends_its_own_table_only(fmt, monkeypatch):
    _, make, task = game_env(game="tests.test_games:Broken")
    rows = task.rows(16, seed=0, split="train", exclude=set())
    trajs = GameRunner().run(MoveEngine(fmt, lambda text: "1"), rows, make, fmt, BUDGETS)
    for t in trajs:
        game = Broken()
        game.reset(t.example["game_seed"])
        if game.heap % 2:
            assert t.finish == ENV_ERROR and "the rules engine crashed" in t.info["env_error"]
        else:   # the other tables played on to the end
            assert t.finish == "game_over" and t.outcome in (1.0, -1.0)
    assert {t.finish for t in trajs} == {ENV_ERROR, "game_over"}
    _, make, task = game_env(game="tests.test_games:Unfair")
    trajs = GameRunner().run(MoveEngine(fmt, lambda text: str(min(3, last_heap(text)))),
                             task.rows(2, seed=0, split="train", exclude=set()), make, fmt, BUDGETS)
    assert all(t.finish == ENV_ERROR and "reward_sum 0.0" in t.info["env_error"] for t in trajs)


class ShowsADict(Nim):
    def observe(self, role):
        return {"heap": self.heap}


class ResetFails(Nim):
    def reset(self, seed):
        raise KeyError("board")


class NoLegalMoves(Nim):
    def legal_moves(self):
        return []


class NanReward(Nim):
    def rewards(self):
        return {"first": float("nan"), "second": 0.0}


class ForgetsARole(Nim):
    def rewards(self):
        return {"first": 1.0}


class NeverHandsOver(Nim):
    """The second player (the scripted opponent) keeps the turn for ever: a pass that changes nothing."""
    def to_move(self):
        return "second"

    def play(self, text):
        from turnrl.games.base import Move
        return Move(legal=True)


def test_a_game_that_breaks_its_protocol_ends_its_table_naming_what(fmt):
    """A board that is not text (it crashed the whole batch), a NaN or missing role's reward (a
    silent draw), a game that never gives a policy seat the turn (an endless loop): each ends its
    own table as an environment error saying what the game did."""
    for game, said, opponent in (
            ("ShowsADict", "observe('first') returned dict {'heap': ", "self"),
            ("NanReward", "rewards() gave {'first': nan}, not finite numbers", "self"),
            ("ForgetsARole", "rewards() gave ['first']; it must give a number for each of its roles", "self"),
            ("NeverHandsOver", "gave the scripted players 10000 moves in a row", "random")):
        _, make, task = game_env(game=f"tests.test_games:{game}", opponent=opponent)
        rows = [r for r in task.rows(4, seed=0, split="train", exclude=set()) if r["role"] == "first"][:1] \
            if opponent != "self" else task.rows(2, seed=0, split="train", exclude=set())
        trajs = GameRunner().run(MoveEngine(fmt, lambda text: "1"), rows, make, fmt, BUDGETS)
        assert trajs and all(t.finish == ENV_ERROR for t in trajs), (game, [t.finish for t in trajs])
        assert all(said in t.info["env_error"] for t in trajs), (game, trajs[0].info["env_error"])


def test_bad_names_are_one_line_errors():
    with pytest.raises(PluginError, match=r"trained_roles .* has no role 'black'"):
        GameTable(game="nim", trained_roles=["black"])
    with pytest.raises(PluginError, match=r"env.options.opponent = 'grandmaster'"):
        make_player("grandmaster")
    with pytest.raises(PluginError, match=r"env.options.game = 'chess'"):
        GameTable(game="chess")
    # a model seat opens only at the pipeline's tables: not as the demonstrations' opponent, not by hand
    with pytest.raises(PluginError, match=r"env.options.demonstration_opponent = 'checkpoint:models/initial': a model "
                                          r"plays a seat only at the pipeline's tables"):
        GameTable(game="nim", demonstration_opponent="checkpoint:models/initial")
    for model in ("checkpoint:models/initial", "past:2"):
        table = GameTable(game="nim", opponent=model)
        with pytest.raises(PluginError, match=r"the opponent = '.*': .*playing by hand \(turnrl env game\) needs a "
                                              r"scripted player"):
            table.reset({"game_seed": 0, "role": "first"})


def test_held_out_rows_play_each_role_against_each_evaluation_opponent(fmt):
    _, make, task = game_env(game="nim", eval_opponents=["random", "first"])
    held = task.rows(8, seed=0, split="heldout", exclude=set())
    assert {r["subject"] for r in held} == {"first vs random", "first vs first", "second vs random", "second vs first"}
    train = task.rows(8, seed=0, split="train", exclude={r["game_seed"] for r in held})
    assert not {r["game_seed"] for r in train} & {r["game_seed"] for r in held}
    trajs = GameRunner().run(MoveEngine(fmt, lambda text: "1"), held, make, fmt, BUDGETS)
    assert all(t.finish == "game_over" for t in trajs)


def test_demonstrations_replay_through_the_real_game(fmt):
    spec, make, task = game_env(game="tictactoe")
    for row in task.rows(4, seed=0, split="train", exclude=set()):
        demo = task.demonstrate(row, random.Random(1), True)
        t = GameRunner().replay(make, fmt, row, demo.turns)
        assert t.finish == "game_over" and t.info["illegal_moves"] == 0.0
        assert [x.split("<")[0] for x in t.turn_texts] == demo.turns and sum(t.loss_mask) > 0


def test_role_baselines_by_hand():
    rewards = torch.tensor([1.0, -1.0, 1.0, 1.0])
    mask = torch.ones(4, 2)
    roles = ["nim/first", "nim/second", "nim/first", "nim/second"]
    a, base = adv.role_baseline(rewards=rewards, mask=mask, roles=roles, baselines={}, decay=0.5)
    assert base == {"nim/first": 0.5, "nim/second": 0.0}       # 0.5 * 0 + 0.5 * mean
    assert torch.allclose(a[:, 0], torch.tensor([0.5, -1.0, 0.5, 1.0]))
    a, base = adv.role_baseline(rewards=rewards, mask=mask, roles=roles, baselines=base, decay=0.5)
    assert base == {"nim/first": 0.75, "nim/second": 0.0} and torch.allclose(a[0], torch.tensor([0.25, 0.25]))

    rae = resolve_algorithm("rae")
    state: dict = {}
    x = AdvantageInputs(rewards=rewards, turn_rewards=torch.zeros(4, 0), mask=mask, turn_ids=torch.zeros(4, 2),
                        high=torch.zeros(4, 2, dtype=torch.bool), group_ids=torch.tensor([0, 0, 1, 1]),
                        first_obs_pos=torch.full((4,), 2), roles=tuple(roles), state=state)

    class Cfg:
        options = {"decay": 0.5}
    rae.advantages(x, Cfg())
    assert state["role_baselines"] == {"nim/first": 0.5, "nim/second": 0.0}   # kept across steps by the caller


class RewardedNim(Nim):
    """Nim whose every legal move rewards its mover at once, in a scale of the mover's role:
    the first mover gets what it took, the second ten times that."""

    def play(self, text):
        mover, heap = self.to_move(), self.heap
        move = super().play(text)
        if move.legal:
            move.rewards = {mover: float(heap - self.heap) * (1 if mover == "first" else 10)}
        return move


def test_each_seat_carries_only_its_own_turns_so_turn_level_credit_sees_one_role(fmt):
    """Self-play: a seat's turn ids count its own moves only (its trained tokens of turn k are its
    k-th move), its turn rewards are its own moves' (none of the other seat's), its first
    observation is what follows its own first move, and each group is one role: mt_grpo's turn
    term (turn 0's reward, group-normalised, on the tokens before the first observation) is
    computed within one role on that role's first move."""
    from turnrl.training.loop import advantage_inputs, collate
    _, make, task = game_env(game="tests.test_games:RewardedNim")
    rows = task.rows(4, seed=0, split="train", exclude=set())

    class BySeed(MoveEngine):      # takes 1 to 3 by the turn's sampling seed: a group's games differ
        def generate(self, prompts, *, seeds, **options):
            out = []
            for p, seed in zip(prompts, seeds):
                self.pick = lambda text: str(min(last_heap(text), 1 + seed % 3))
                out += super().generate([p], seeds=[seed], **options)
            return out
    trajs = GameRunner().run(BySeed(fmt, None), rows, make, fmt, BUDGETS, n=2, seed=0)
    end = fmt.end_of_turn or ""
    assert min(t.num_turns for t in trajs) >= 2          # every seat moved more than once
    for t in trajs:
        role, scale = t.example["role"], 1 if t.example["role"] == "first" else 10
        mine = [m.split(": ", 1)[1] for m in t.info["transcript"].split(" | ") if m.startswith(role + ":")]
        assert t.finish == "game_over" and t.num_turns == len(mine) >= 1
        trained = [[i for i, (m, k) in enumerate(zip(t.loss_mask, t.turn_ids)) if m and k == turn]
                   for turn in range(t.num_turns)]
        assert [fmt.tokenizer.decode([t.response_ids[i] for i in pos]).replace(end, "").strip()
                for pos in trained] == mine
        assert sorted(set(t.turn_ids)) == list(range(t.num_turns))
        assert t.turn_rewards == [float(move) * scale for move in mine]
    batch = collate(trajs, fmt.tokenizer.pad_token_id or 0)
    x = advantage_inputs(trajs, batch, group_size=2)
    for g in set(x.group_ids.tolist()):
        assert len({x.roles[i] for i in range(len(trajs)) if x.group_ids[i] == g}) == 1
    for row, t in enumerate(trajs):
        p = len(t.prompt_ids)
        before = (batch["loss_mask"][row] > 0) & (torch.arange(batch["loss_mask"].shape[1]) < x.first_obs_pos[row])
        assert (batch["turn_ids"][row][before] == 0).all() and before.sum() == sum(
            m for m, k in zip(t.loss_mask, t.turn_ids) if k == 0)
        assert x.turn_rewards[row, 0] == t.turn_rewards[0] and p <= x.first_obs_pos[row]
    mt_grpo = resolve_algorithm("mt_grpo")

    class Cfg:
        turn_coef, options = 1.0, {}
    a = mt_grpo.advantages(x, Cfg())
    assert a.isfinite().all() and (a[batch["loss_mask"] == 0] == 0).all()
    # a seat's first move: the outcome's advantage plus its first-move reward normalised within
    # its group (one role); a seat that never saw an observation (its first move ended the game)
    # gets the outcome's alone
    a_out = adv.grpo(rewards=x.rewards, mask=x.mask, group_ids=x.group_ids)
    a_turn = adv.group_normalize(x.turn_rewards[:, 0], x.group_ids)
    assert a_turn.abs().max() > 0          # the turn term is not all 0 here
    for row in range(len(trajs)):
        before = (batch["loss_mask"][row] > 0) & (torch.arange(a.shape[1]) < x.first_obs_pos[row])
        turn = a_turn[row] if x.first_obs_pos[row] < a.shape[1] else 0.0
        assert torch.allclose(a[row][before], a_out[row][before] + turn)


@pytest.mark.parametrize("illegal", ["end", "retry"])
def test_textarena_tictactoe_at_the_tables_under_either_illegal_rule(fmt, illegal):
    """The policy repeats a taken cell: with `end` turnrl's rule ends the game at once; with
    `retry` (5 retries allowed) TextArena's own rule ends it at the second invalid move."""
    pytest.importorskip("textarena", reason="the ecosystem extra (textarena) is not installed")
    _, make, task = game_env(game="textarena:TicTacToe-v0", illegal=illegal, max_retries=5)
    rows = task.rows(2, seed=0, split="train", exclude=set())
    assert [r["role"] for r in rows] == ["player0", "player1"]
    first, second = GameRunner().run(MoveEngine(fmt, lambda text: "[4]"), rows, make, fmt, BUDGETS)
    assert first.outcome == 1.0 and second.outcome == -1.0 and second.finish == "illegal_move"
    assert second.info["illegal_moves"] == (1.0 if illegal == "end" else 2.0) and first.info["illegal_moves"] == 0.0
    assert second.num_turns == (1 if illegal == "end" else 2)


def test_the_task_block_reports_win_draw_loss_and_illegal_moves_per_role_and_opponent(fmt):
    from turnrl.pipeline.evaluate import breakdown, summarize_generations
    spec, make, task = game_env(game="nim", eval_opponents=["random", "first"])
    held = task.rows(16, seed=0, split="heldout", exclude=set())
    picks = iter(["1", "1", "9"] * 100)    # every third move illegal
    trajs = GameRunner().run(MoveEngine(fmt, lambda text: next(picks)), held, make, fmt, BUDGETS)
    block = summarize_generations(trajs, 1, spec.eval_metrics)
    assert block["win"] + block["draw"] + block["loss"] == pytest.approx(1.0)
    assert block["win"] == block["accuracy"] and 0 < block["illegal_move_rate"] <= 1
    by = breakdown(trajs, "subject", 1, spec.eval_metrics)
    assert set(by) == {"first vs random", "first vs first", "second vs random", "second vs first"}
    for subject, entry in by.items():
        mine = [t for t in trajs if t.example["subject"] == subject]
        assert entry["n"] == len(mine) and entry["loss"] == sum(t.outcome < 0 for t in mine) / len(mine)


def test_params_with_a_game_are_checked_before_any_work():
    from turnrl.config import Config
    from turnrl.config.checks import game_problems
    ok = Config.model_validate({"env": {"name": "game", "options": {"game": "tictactoe"}}})
    assert game_problems(ok) == []
    bad = Config.model_validate({"env": {"name": "game", "options": {"game": "nim", "eval_opponents": ["grandmaster"]}},
                                 "train": {"mode": "async"}, "algorithm": {"policy_loss": "decoupled"}})
    problems = game_problems(bad)
    assert len(problems) == 2 and all("\n" not in p for p in problems)
    assert "train.mode = async" in problems[0] and "env.options.eval_opponents = 'grandmaster'" in problems[1]
    for game, said in (("ResetFails", "reset(0) at the first position raised KeyError: 'board'"),
                       ("ShowsADict", "observe('first') returned dict; it must return the text"),
                       ("NoLegalMoves", "legal_moves() at the first position gave []")):
        problems = game_problems(Config.model_validate({"env": {"name": "game", "options": {
            "game": f"tests.test_games:{game}"}}}))
        assert len(problems) == 1 and said in problems[0], (game, problems)


def test_a_frozen_checkpoint_plays_a_role(fmt, tiny_model_dir):
    """checkpoint:<folder> plays a seat of its own on a transformers engine, moving first here (the
    untrained tiny model rarely writes a legal move: then the game ends on its illegal or cut-off
    move, the policy's seat winning); a folder that is not there ends the table as an environment
    error."""
    _, make, task = game_env(game="nim", opponent=f"checkpoint:{tiny_model_dir}")
    row = task.rows(2, seed=0, split="train", exclude=set())[1]          # the policy moves second
    [t] = GameRunner().run(MoveEngine(fmt, lambda text: "1"), [row], make, fmt, BUDGETS, seed=0)
    theirs = t.info["opponent_moves"]
    assert t.finish != ENV_ERROR and all(m["player"] == f"checkpoint:{tiny_model_dir}" for m in theirs)
    if t.num_turns == 0:             # its first move ended the game: refused, or its turn cut off
        assert t.finish in ("opponent_illegal_move", "opponent_no_move") and t.outcome == 1.0
        assert t.finish == "opponent_no_move" or (len(theirs) == 1 and not theirs[0]["legal"])
    else:                            # it wrote a legal first move: the policy's seat played on
        assert theirs[0]["turn"] == -1 and theirs[0]["legal"]
    _, make, _ = game_env(game="nim", opponent="checkpoint:/no/such/folder")
    [t] = GameRunner().run(MoveEngine(fmt, lambda text: "1"), [row], make, fmt, BUDGETS)
    assert t.finish == ENV_ERROR and "no model folder there" in t.info["env_error"]


def test_an_evaluation_checkpoint_that_is_not_there_is_a_params_problem():
    from turnrl.config import Config
    from turnrl.config.checks import game_problems
    cfg = Config.model_validate({"env": {"name": "game", "options": {
        "eval_opponents": ["random", "checkpoint:models/initial", "checkpoint:/no/such/folder"]}}})
    assert game_problems(cfg) == ["env.options.eval_opponents: 'checkpoint:/no/such/folder': no model folder there "
                                  "(config.json missing); name a saved checkpoint, or checkpoint:models/initial "
                                  "(the warm start)"]


def test_a_seats_trace_has_a_span_per_move_of_the_other_players(fmt):
    from turnrl.tracking.traces import plan
    _, make, task = game_env(game="nim", opponent="random")
    row = task.rows(2, seed=0, split="train", exclude=set())[1]          # the policy moves second
    [t] = GameRunner().run(MoveEngine(fmt, lambda text: "1"), [row], make, fmt, BUDGETS)
    theirs = t.info["opponent_moves"]
    assert theirs[0]["turn"] == -1 and [m["turn"] for m in theirs[1:]] == list(range(len(theirs) - 1))
    assert all(m["role"] == "first" and m["player"] == "random" and m["legal"] for m in theirs)
    trace = plan(t, name="rollout", tags={})
    turns = [c for c in trace.root.children if c.name.startswith("turn ")]
    assert trace.root.children[0].name == "move · first (random)"            # the opening move, before turn 1
    assert len(turns) == t.num_turns
    after = [[s.outputs["move"] for s in c.children if s.name.startswith("move · ")] for c in turns]
    assert [m for ms in after for m in ms] == [m["move"] for m in theirs[1:]]


def test_an_openai_compatible_endpoint_plays_a_role(fmt):
    """endpoint:<base_url>: each of its moves is a chat completion on a real loopback server; one
    that keeps failing ends its table as an environment error, the server's answer named."""
    from judge_server import answer, serve
    from starlette.responses import PlainTextResponse
    asked = []

    async def chat(request):
        body = await request.json()
        asked.append(body["messages"][-1]["content"])
        return answer("I take 1")

    async def down(request):
        return PlainTextResponse("overloaded", status_code=500)
    server, thread, url = serve(chat)
    broken, broken_thread, broken_url = serve(down)
    try:
        _, make, task = game_env(game="nim", opponent=f"endpoint:{url}#frozen")
        row = task.rows(2, seed=0, split="train", exclude=set())[1]          # the policy moves second
        [t] = GameRunner().run(MoveEngine(fmt, lambda text: "1"), [row], make, fmt, BUDGETS)
        assert t.finish == "game_over" and all(m["player"] == f"endpoint:{url}#frozen" for m in t.info["opponent_moves"])
        assert len(asked) == len(t.info["opponent_moves"]) and asked[0].startswith("Heap ")
        _, make, _ = game_env(game="nim", opponent=f"endpoint:{broken_url}")
        [t] = GameRunner().run(MoveEngine(fmt, lambda text: "1"), [row], make, fmt, BUDGETS)
        assert t.finish == ENV_ERROR and "HTTP 500: overloaded" in t.info["env_error"]
    finally:
        server.should_exit = broken.should_exit = True
        thread.join(5)
        broken_thread.join(5)


@pytest.mark.slow
def test_two_self_play_steps_on_the_real_stack(tiny_model_dir, tmp_path):
    """rae on self-play Nim through Ray, DeepSpeed and vLLM's stepper (the seats' answers rejoin
    as the other seat moves): every game ends in a win, draw or loss, none in an error. (The
    untrained model rarely writes a legal move, so most games end at once; a step whose sampled rows
    are all second movers may have no seat that moved at all.)"""
    import math

    from conftest import train_two_steps
    history = train_two_steps(tiny_model_dir, tmp_path, {"name": "game", "options": {"game": "nim"}},
                              {"name": "rae"}, rollout={"n": 2, "max_turns": 8, "max_tokens_per_turn": 8,
                                                        "max_tokens_total": 200})
    for h in history:
        assert h["finish_env_error_frac"] == 0.0 and math.isfinite(h["loss"])
        assert h["env_win_mean"] + h["env_draw_mean"] + h["env_loss_mean"] == pytest.approx(1.0)
        assert 0.0 <= h["env_game_moves_mean"] <= 15.0 and 0.0 <= h["env_illegal_move_rate_mean"] <= 1.0


class Hangs:
    def act(self, observation, legal_moves, rng):
        import time
        time.sleep(5)
        return legal_moves[0]


def test_a_player_that_hangs_ends_its_game_not_the_batch(fmt):
    _, make, task = game_env(game="nim", opponent="tests.test_games:Hangs", player_timeout_s=0.2)
    row = task.rows(2, seed=0, split="train", exclude=set())[1]          # the player moves first
    [t] = GameRunner().run(MoveEngine(fmt, lambda text: "1"), [row], make, fmt, BUDGETS)
    assert t.finish == ENV_ERROR and "gave no move within env.options.player_timeout_s = 0.2 s" in t.info["env_error"]


class WontStart(Nim):
    def reset(self, seed):
        if seed % 4 == 1:
            raise RuntimeError("no board for this seed")
        super().reset(seed)


def test_a_game_that_cannot_start_or_a_rows_unknown_opponent_fails_its_own_table(fmt):
    _, make, task = game_env(game="tests.test_games:WontStart", opponent="random")
    rows = task.rows(6, seed=0, split="train", exclude=set())
    bad = next(i for i, r in enumerate(rows) if r["game_seed"] % 4 == 3)
    rows[bad] = {**rows[bad], "opponent": "grandmaster"}
    trajs = GameRunner().run(MoveEngine(fmt, lambda text: "1"), rows, make, fmt, BUDGETS)
    assert any(r["game_seed"] % 4 == 3 for i, r in enumerate(rows) if i != bad)
    for row, t in zip(rows, trajs):
        if row is rows[bad]:
            assert t.finish == ENV_ERROR and "the row's opponent = 'grandmaster'" in t.info["env_error"]
        elif row["game_seed"] % 4 == 1:
            assert t.finish == ENV_ERROR and "no board for this seed" in t.info["env_error"]
        else:
            assert t.finish == "game_over"
    assert {t.finish for t in trajs} == {ENV_ERROR, "game_over"}


def test_turnrl_env_plays_a_game_by_hand(capsys, tmp_path, monkeypatch):
    """`turnrl env game --step ...`: the row's role is typed, the scripted opponent moves itself."""
    from turnrl.pipeline.env_cli import explore
    monkeypatch.chdir(tmp_path)
    explore("game", {"game": "nim", "eval_opponents": ["first"]}, row=0, steps=["3", "3", "3", "3", "3"])
    out = capsys.readouterr().out
    heap = Nim()
    heap.reset(0)
    assert f"first observation: (first) Heap {heap.heap}. Take 1, 2 or 3." in out
    assert f"[second plays 1] (first) Heap {heap.heap - 4}." in out
    assert '"reason": "game_over"' in out or '"reason": "illegal_move"' in out
