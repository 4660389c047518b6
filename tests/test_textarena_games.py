"""turnrl.games.textarena: TextArena's two-player games, played through the `Game` protocol, give the
library's own turn order, observations, invalid-move rule and rewards."""
from __future__ import annotations

import random

import pytest

ta = pytest.importorskip("textarena", reason="the textarena library is not importable: pip install -e '.[ecosystem]'")

from turnrl.games.base import RandomPlayer   # noqa: E402
from turnrl.games.table import GameTable, demonstration_turns, make_game   # noqa: E402
from turnrl.games.textarena import ROLES, textarena_game   # noqa: E402
from turnrl.plugins import PluginError   # noqa: E402

GAMES = ["TicTacToe-v0", "KuhnPoker-v0", "ConnectFour-v0", "SimpleNegotiation-v0"]


def _random_game(env_id: str, seed: int):
    """A game of random legal moves for both roles: (game, [(mover, observation, move)])."""
    game = make_game(f"textarena:{env_id}")
    game.reset(seed)
    rng, player, turns = random.Random(seed), RandomPlayer(), []
    while (mover := game.to_move()) is not None:
        observation = game.observe(mover)
        assert game.observe(mover) == observation   # asked twice before a move: the same
        move = player.act(observation, game.legal_moves(), rng)
        result = game.play(move)
        assert result.legal, (env_id, seed, move, result.why)
        turns.append((mover, observation, move))
        assert len(turns) < 100
    return game, turns


def _replay_on_library(env_id: str, seed: int, moves: list[str]):
    """The same moves on TextArena itself: (mover ids, each mover's full log before its move, rewards)."""
    env = ta.make(env_id)
    env.reset(num_players=2, seed=seed)
    movers, logs = [], []
    for move in moves:
        pid, log = env.get_observation()
        movers.append(pid)
        logs.append(log)
        done, _ = env.step(move)
        if done:
            break
    assert done
    return movers, logs, env.close()[0]


@pytest.mark.parametrize("env_id", GAMES + ["Nim-v0"])
@pytest.mark.parametrize("seed", [3, 11])
def test_random_players_play_a_whole_game_as_the_library_does(env_id, seed):
    game, turns = _random_game(env_id, seed)
    movers = [mover for mover, _, _ in turns]
    assert set(movers) == set(ROLES) and game.roles == ROLES
    lib_movers, lib_logs, lib_rewards = _replay_on_library(env_id, seed, [move for _, _, move in turns])
    # whose turn it was: TextArena's current player, mapped to roles
    assert movers == [ROLES[pid] for pid in lib_movers]
    # what each role was shown, put together, is the library's log for that player
    shown = {role: "" for role in ROLES}
    for (mover, observation, _), log in zip(turns, lib_logs):
        shown[mover] += observation
        assert shown[mover] == log
    # the library's rewards by role, summing as reward_sum says
    rewards = game.rewards()
    assert rewards == {ROLES[pid]: float(r) for pid, r in lib_rewards.items()}
    assert set(rewards.values()) <= {-1.0, 0.0, 1.0}
    assert game.reward_sum == 0.0 and sum(rewards.values()) == game.reward_sum
    assert game.to_move() is None and game.legal_moves() == []


@pytest.mark.parametrize("env_id", ["TicTacToe-v0", "ConnectFour-v0", "SimpleNegotiation-v0", "Nim-v0"])
def test_board_and_negotiation_games_alternate_from_player0(env_id):
    _, turns = _random_game(env_id, 5)
    assert [mover for mover, _, _ in turns] == [ROLES[k % 2] for k in range(len(turns))]


def test_kuhn_poker_alternates_within_a_round_and_player1_opens():
    game = make_game("textarena:KuhnPoker-v0")
    game.reset(7)
    assert game.to_move() == "player1" and game.legal_moves() == ["[check]", "[bet]"]
    assert game.play("[bet]").legal and game.to_move() == "player0"
    assert game.legal_moves() == ["[fold]", "[call]"]
    assert game.play("[fold]").legal                       # round 1 over: player0 opens round 2
    assert game.to_move() == "player0" and game.legal_moves() == ["[check]", "[bet]"]
    assert "Starting round 2" in game.observe("player0")


def test_tictactoe_illegal_move_is_retried_once_then_ends_the_game_as_textarena_does():
    game = textarena_game("TicTacToe-v0", {}, "env.options.game")
    game.reset(1)
    game.observe("player0")
    assert game.play("[4]").legal and game.to_move() == "player1"
    legal = game.legal_moves()
    assert "[4]" not in legal and len(legal) == 8
    first = game.play("[4]")                               # occupied: TextArena allows a retry
    assert not first.legal and "occupied" in first.why
    assert game.to_move() == "player1" and game.legal_moves() == legal   # state unchanged, same mover
    assert "attempted an invalid move" in game.observe("player1")
    assert game.play("[0]").legal                          # a legal move resets the library's count
    assert not game.play("[0]").legal and game.to_move() == "player0"
    last = game.play("no move here")                       # the second in a row: the game ends
    assert not last.legal and "ends the game" in last.why and "format" in last.why
    assert game.to_move() is None
    assert game.rewards() == {"player0": -1.0, "player1": 1.0}


@pytest.mark.parametrize("env_id, setup, bad, why", [
    ("KuhnPoker-v0", [], "[call]", "Action must be [check], [bet]"),
    ("ConnectFour-v0", ["[col 0]"] * 6, "[col 0]", "Column 0 is full"),
    ("ConnectFour-v0", [], "[col 9]", "out of bounds"),
    ("Nim-v0", [], "[0 4]", "only 3 left"),
    ("SimpleNegotiation-v0", [], "[Offer: 1000 Ore -> 1 Wheat]", "without having the necessary resources"),
])
def test_invalid_moves_by_the_librarys_rules(env_id, setup, bad, why):
    game = make_game(f"textarena:{env_id}")
    game.reset(2)
    for move in setup:
        assert game.play(move).legal
    mover, legal = game.to_move(), game.legal_moves()
    assert bad not in legal
    result = game.play(bad)
    assert not result.legal and why in result.why
    assert game.to_move() == mover and game.legal_moves() == legal
    ended = game.play(bad)
    assert not ended.legal and game.to_move() is None
    assert game.rewards()[mover] == -1.0 and sum(game.rewards().values()) == 0.0


def test_rewards_before_the_end_are_zero():
    game = make_game("textarena:TicTacToe-v0")
    game.reset(0)
    assert game.rewards() == {"player0": 0.0, "player1": 0.0}


def test_a_game_depends_on_its_seed_only_and_leaves_the_callers_random_alone():
    """Kuhn poker deals each round from the process's `random` while the game runs: two games
    played in turn deal as each alone, and the caller's generator is not moved."""
    def deals(games):
        for game in games:
            game.reset(21)
        seen = [[] for _ in games]
        while any(game.to_move() for game in games):
            for k, game in enumerate(games):
                if (mover := game.to_move()) is not None:
                    seen[k].append(game.observe(mover))
                    game.play(game.legal_moves()[0])
        return seen

    random.seed(1234)
    before = random.getstate()
    alone = deals([make_game("textarena:KuhnPoker-v0")])[0]
    together = deals([make_game("textarena:KuhnPoker-v0"), make_game("textarena:KuhnPoker-v0")])
    assert random.getstate() == before
    assert together[0] == together[1] == alone
    assert sum("Your card is" in text for text in alone) >= 3


def test_reset_starts_a_fresh_log():
    game = make_game("textarena:TicTacToe-v0")
    game.reset(0)
    opening = game.observe("player0")
    game.play("[4]")
    game.reset(0)
    assert game.observe("player0") == opening and "placed their symbol" not in opening


def test_a_game_without_listed_legal_moves_plays_but_a_scripted_player_cannot():
    game = make_game("textarena:IteratedRockPaperScissors-v0", key="env.options.game")
    assert game.reward_sum is None and not game.lists_legal_moves
    game.reset(0)
    assert game.to_move() == "player0" and game.play("[rock]").legal
    with pytest.raises(PluginError) as err:
        game.legal_moves()
    message = str(err.value)
    assert message.startswith("env.options.game = textarena:IteratedRockPaperScissors-v0:") and "\n" not in message
    assert "random, first" in message


@pytest.mark.parametrize("env_id, kwargs, says", [
    ("NoSuchGame-v0", {}, "not found in registry"),
    ("TicTacToe-v0", {"board_size": 4}, "unexpected keyword argument"),
    ("GuessTheNumber-v0", {}, "cannot start with two players"),   # a one-player game
])
def test_a_game_that_cannot_start_is_one_line_naming_the_key(env_id, kwargs, says):
    with pytest.raises(PluginError) as err:
        make_game(f"textarena:{env_id}", kwargs, key="env.options.game")
    message = str(err.value)
    assert message.startswith(f"env.options.game = textarena:{env_id}:") and "\n" not in message
    assert says in message


def test_game_table_and_warm_start_demonstrations_take_a_textarena_game():
    table = GameTable(game="textarena:TicTacToe-v0", trained_roles=["player1"])
    assert table.roles == ROLES and table.trained_roles == ["player1"]
    turns = demonstration_turns(table, {"game_seed": 4, "role": "player1"}, random.Random(0))
    assert turns and all(move.startswith("[") for move in turns)
    with pytest.raises(PluginError, match="has no role 'first'"):
        GameTable(game="textarena:TicTacToe-v0", trained_roles=["first"])
