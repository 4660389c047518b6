"""Past selves as opponents (`past:<N>`, and the league `past:<N>:<K>`): parsing and the params
check, the snapshots the runner takes of pushed weights (every N-th push, K kept, a resumed
run's first push as the start), each table's draw among them, and the `weights` handed to
runners (`turnrl.rollout.episodes.hand_weights`)."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from turnrl.games import make_player
from turnrl.games.base import Past
from turnrl.games.table import opponent_rng
from turnrl.games.tables import GameRunner
from turnrl.plugins import PluginError
from turnrl.rollout.chat import ChatFormat
from turnrl.rollout.engines import HFEngine
from turnrl.rollout.episodes import hand_weights
from turnrl.rollout.multi_turn import ENV_ERROR
from test_games import BUDGETS, MoveEngine, game_env


@pytest.fixture(scope="module")
def fmt(tiny_model_dir):
    return ChatFormat(AutoTokenizer.from_pretrained(tiny_model_dir))


@pytest.fixture(scope="module")
def start(tiny_model_dir):
    """The tiny model's own weights, as the trainer names them."""
    return {n: t.detach().clone() for n, t in AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict().items()}


def moved(start, version):
    """The weights of push `version`: every tensor moved by its own amount."""
    return {n: t + 0.01 * version for n, t in start.items()}


def holds(engine, weights) -> bool:
    state = engine.model.state_dict()
    return all(torch.equal(state[n], t) for n, t in weights.items())


def push(runner, version, weights, applied):
    runner.load_weights(version, lambda: applied.append(version), lambda: iter(weights.items()))


def test_past_names_parse_and_bad_ones_are_one_line_errors_before_any_work():
    from turnrl.config import Config
    from turnrl.config.checks import game_problems
    assert make_player("past:3") == Past(3, 1) and make_player("past:2:4") == Past(2, 4)
    assert Past(3).name == "past:3" and Past(2, 4).name == "past:2:4"
    for bad in ("past:", "past:0", "past:x", "past:2:0", "past:1:2:3", "past:-1", "past:1.5"):
        with pytest.raises(PluginError, match=rf"env.options.opponent = '{bad}': use past:<N>"):
            make_player(bad)

    def problems(**options):
        return game_problems(Config.model_validate({"env": {"name": "game", "options": {"game": "nim", **options}}}))
    assert problems(opponent="past:2:4", eval_opponents=["random", "past:1"]) == []
    [opponent] = problems(opponent="past:0")
    [evaluation] = problems(eval_opponents=["random", "past:2:x"])
    assert opponent.startswith("env.options.opponent = 'past:0': ") and "\n" not in opponent
    assert evaluation.startswith("env.options.eval_opponents = 'past:2:x': ") and "\n" not in evaluation
    # NCCL's broadcast goes straight into vLLM: no copy reaches the tables, so a past self would never change
    nccl = Config.model_validate({"env": {"name": "game", "options": {"game": "nim", "opponent": "past:2"}},
                                  "cluster": {"weight_sync": "nccl"}})
    [stale] = game_problems(nccl)
    assert "'past:2'" in stale and "cluster.weight_sync=object_store" in stale


def test_a_past_self_is_refreshed_every_nth_push_and_a_league_keeps_k(fmt, tiny_model_dir, start):
    """past:2:2: the first rollout opens the league on the starting weights; the policy's pushes
    2 and 4 are snapshots (1 and 3 are not, nor a push without weights: the high level's), the
    third replaces the oldest; the engine's own load (`apply`) runs at every push. A refreshed
    engine's logprobs are those of the pushed weights."""
    _, make, task = game_env(game="nim", opponent="past:2:2")
    row = task.rows(2, seed=0, split="train", exclude=set())[1]          # the past self moves first
    runner, applied = GameRunner(), []
    runner.bind(str(tiny_model_dir))
    [t] = runner.run(MoveEngine(fmt, lambda text: "1"), [row], make, fmt, BUDGETS, seed=0)
    assert t.finish != ENV_ERROR and all(m["player"] == "past:2:2" for m in t.info["opponent_moves"])
    league = runner.leagues.by_spec[Past(2, 2)]
    [(_, first)] = league.snapshots
    assert holds(first, start) and t.info["opponent_version"] == 0.0

    push(runner, 1, moved(start, 1), applied)
    assert [v for v, _ in league.snapshots] == [0] and holds(first, start) and not holds(first, moved(start, 1))
    runner.load_weights(2, lambda: applied.append("high"))    # another model's push (no weights): not counted
    push(runner, 2, moved(start, 2), applied)
    assert [v for v, _ in league.snapshots] == [0, 2]
    second = league.snapshots[1][1]
    assert holds(first, start) and holds(second, moved(start, 2)) and second is not first
    push(runner, 3, moved(start, 3), applied)
    assert [v for v, _ in league.snapshots] == [0, 2] and holds(second, moved(start, 2))
    push(runner, 4, moved(start, 4), applied)          # K = 2 held: the oldest engine takes the new weights
    assert [v for v, _ in league.snapshots] == [2, 4] and league.snapshots[1][1] is first
    assert holds(first, moved(start, 4)) and holds(second, moved(start, 2))
    assert applied == [1, "high", 2, 3, 4]

    sequence = [fmt.encode("Heap 7. Take 1, 2 or 3.")]
    reference = HFEngine(str(tiny_model_dir))
    before = reference.prompt_logprobs(sequence)
    reference.load_weights(moved(start, 4).items())
    assert first.prompt_logprobs(sequence) == reference.prompt_logprobs(sequence) != before


def test_a_resumed_runs_first_push_is_the_first_snapshot(fmt, tiny_model_dir, start):
    """A push before the runner's first rollout (a resumed run's checkpoint) is where past:2
    starts, and N counts from it."""
    _, make, task = game_env(game="nim", opponent="past:2")
    row = task.rows(2, seed=0, split="train", exclude=set())[1]
    runner, applied = GameRunner(), []
    runner.bind(str(tiny_model_dir))
    push(runner, 1, moved(start, 1), applied)            # the checkpoint's weights
    runner.run(MoveEngine(fmt, lambda text: "1"), [row], make, fmt, BUDGETS, seed=0)
    league = runner.leagues.by_spec[Past(2)]
    assert [v for v, _ in league.snapshots] == [0]        # push 0: what the run started from
    [(_, engine)] = league.snapshots
    assert holds(engine, moved(start, 1))
    push(runner, 2, moved(start, 2), applied)            # one push since the resume
    assert holds(engine, moved(start, 1))
    push(runner, 3, moved(start, 3), applied)            # two: a snapshot, in the one engine K = 1 keeps
    assert [v for v, _ in league.snapshots] == [2] and league.snapshots[0][1] is engine
    assert holds(engine, moved(start, 3))


def test_each_table_draws_its_snapshot_with_its_own_generator(fmt, tiny_model_dir):
    """past:1:2 with two snapshots: table k of a row plays the one its generator
    (opponent_rng(game seed, k)) draws, the same on every run."""
    _, make, task = game_env(game="nim", opponent="past:1:2")
    row = task.rows(2, seed=0, split="train", exclude=set())[1]          # the past self moves first
    runner = GameRunner()
    runner.bind(str(tiny_model_dir))
    runner.run(MoveEngine(fmt, lambda text: "1"), [row], make, fmt, BUDGETS, seed=0)
    # two snapshots' stand-ins: one always takes 1, the other 2
    runner.leagues.by_spec[Past(1, 2)].snapshots = [(1, MoveEngine(fmt, lambda text: "1")),
                                                    (2, MoveEngine(fmt, lambda text: "2"))]
    n = 8

    def firsts():
        trajs = runner.run(MoveEngine(fmt, lambda text: "1"), [row], make, fmt, BUDGETS, n=n, seed=0)
        assert [t.info["opponent_version"] for t in trajs] == [float(t.info["opponent_moves"][0]["move"])
                                                                for t in trajs]   # the snapshot it met
        return [t.info["opponent_moves"][0]["move"] for t in trajs]
    expected = [str(1 + opponent_rng(int(row["game_seed"]), k).randrange(2)) for k in range(n)]
    assert firsts() == expected == firsts() and set(expected) == {"1", "2"}


def test_an_unbound_runner_plays_models_initial(fmt, tmp_path, monkeypatch):
    """Outside training (the evaluation stages: nothing bound, nothing pushed) a past self is
    models/initial; where there is none, its tables end as environment errors, the folder named."""
    monkeypatch.chdir(tmp_path)
    _, make, task = game_env(game="nim", eval_opponents=["random", "past:3"])
    rows = [r for r in task.rows(4, seed=0, split="heldout", exclude=set()) if r["opponent"] == "past:3"]
    trajs = GameRunner().run(MoveEngine(fmt, lambda text: "1"), rows, make, fmt, BUDGETS)
    assert trajs and all(t.finish == ENV_ERROR and "past:3: no model folder there" in t.info["env_error"]
                         and "models/initial" in t.info["env_error"] for t in trajs)


def test_weights_reach_runners_that_take_them_and_older_runners_still_load():
    calls = []

    class Old:
        def load_weights(self, version, apply):
            calls.append(("old", version))
            apply()

    class New:
        def load_weights(self, version, apply, weights=None):
            calls.append(("new", version, dict(weights()) if weights is not None else None))
            apply()

    class Open:
        def load_weights(self, version, apply, **extra):
            calls.append(("open", version, sorted(extra)))

    loaded = []
    for runner in (Old(), New(), Open()):
        hand_weights(runner, 3, lambda: loaded.append(3), lambda: iter([("w", torch.ones(1))]))
    hand_weights(New(), 4, lambda: loaded.append(4))
    assert calls[:3] == [("old", 3), ("new", 3, {"w": torch.ones(1)}), ("open", 3, ["weights"])]
    assert calls[3] == ("new", 4, None)            # no weights to hand: the call without them
    assert loaded == [3, 3, 4]


@pytest.mark.slow
def test_a_past_self_takes_the_first_update_on_the_real_stack(tiny_model_dir, tmp_path):
    """past:1 through Ray, DeepSpeed and vLLM: step 1's games meet the starting weights, step 2's
    the snapshot of step 1's push (the rollout actor hands the runner its weights)."""
    from conftest import train_two_steps
    env = {"name": "game", "options": {"game": "nim", "opponent": "past:1"}}
    history = train_two_steps(tiny_model_dir, tmp_path, env, {"name": "rae"},
                              rollout={"n": 2, "max_turns": 8, "max_tokens_per_turn": 8, "max_tokens_total": 200})
    assert [h["env_opponent_version_mean"] for h in history] == [0.0, 1.0]
    assert all(h["finish_env_error_frac"] == 0.0 for h in history)
