"""GEM (gem-llm 0.1.0) as a turnrl environment: its games served by src/turnrl/envs/ecosystem/gem_server.py
in their own virtualenv (.venv-gem, made by setup.sh: gem-llm needs antlr4-python3-runtime 4.13.2,
hydra-core/omegaconf in .venv need 4.9.*), reached through the real `env.name: openenv` adapter
with `env.options.command`. The reference is GEM itself, run by .venv-gem's python: recorded
actions replayed on both sides give the same observations, rewards, termination and truncation."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import time
from pathlib import Path

import pytest

from conftest import measured, needs_setup
from turnrl import envs
from turnrl.envs.ecosystem import openenv as oe

REPO = Path(__file__).resolve().parents[1]
GEM_PYTHON = REPO / ".venv-gem" / "bin" / "python"
needs_setup(GEM_PYTHON, "gem-llm cannot be installed in .venv: it needs antlr4-python3-runtime 4.13.2, "
                        "hydra-core/omegaconf need 4.9.*")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("openenv.core") is None,
                                reason="openenv-core is not installed in .venv (the ecosystem extra)")

ENV_ID = "game:GuessTheNumber-v0-easy"   # 1..10, 4 turns
COMMAND = f".venv-gem/bin/python src/turnrl/envs/ecosystem/gem_server.py --env {ENV_ID} --port {{port}}"
# Recorded policy turns: a win or a truncation at the turn limit (reward by distance), a guess out
# of range, a repeated guess, text around the boxed number, and a reply GEM cannot parse (-0.1).
SCRIPTS = [["\\boxed{5}", "I think \\boxed{3}", "\\boxed{3}", "\\boxed{8}"],
           ["\\boxed{42}", "\\boxed{7}", "\\boxed{2}", "\\boxed{9}"],
           ["\\boxed{6}", "no idea"]]
SEEDS = [1, 2, 3]
EPISODES = [(seed, script) for seed in SEEDS for script in SCRIPTS]

# 2048 draws a tile after each move from the process's random generators, which every session of
# one server shares: two sessions stepped in turn must each still play its own seed's game.
MOVES_2048 = ["\\boxed{up}", "\\boxed{left}", "\\boxed{down}", "\\boxed{right}"] * 2
SEEDS_2048 = [4, 5]

REFERENCE = """
import importlib.util, json, sys
import gem
from gem.wrappers.observation_wrapper import ObservationWrapper, maybe_add_new_line
env_id, episodes, moves, seeds, server_file = sys.argv[1], *map(json.loads, sys.argv[2:5]), sys.argv[5]

def text(obs, info):   # the latest turn as GEM's observation wrapper shows it
    return info.get("prefix", "") + maybe_add_new_line(obs) + info.get("suffix", "")

out = {"episodes": [], "wrapped_resets": []}
for seed, actions in episodes:
    env = gem.make(env_id)
    obs, info = env.reset(seed=seed)
    steps = [{"obs": obs, "text": text(obs, info)}]
    for action in actions:
        obs, reward, terminated, truncated, info = env.step(action)
        steps.append({"obs": obs, "text": text(obs, info), "reward": float(reward),
                      "terminated": bool(terminated), "truncated": bool(truncated)})
        if terminated or truncated:
            break
    out["episodes"].append(steps)
    wrapped = ObservationWrapper(gem.make(env_id), include_action=False, include_chat_template=False)
    out["wrapped_resets"].append(wrapped.reset(seed=seed)[0])

def alone(seed):
    env = gem.make("game:Game2048-v0-easy")
    return [text(*env.reset(seed=seed))] + [text(*env.step(m)[::4]) for m in moves]

spec = importlib.util.spec_from_file_location("gem_server", server_file)
server = importlib.util.module_from_spec(spec)
spec.loader.exec_module(server)
env_cls, action_cls, _ = server.build("game:Game2048-v0-easy", {})
sessions = [env_cls(), env_cls()]
played = [[s.reset(seed=seed).text] for s, seed in zip(sessions, seeds)]
for m in moves:
    for s, texts in zip(sessions, played):
        texts.append(s.step(action_cls(action=m)).text)
out["2048"] = {"alone": [alone(seed) for seed in seeds], "interleaved": played}
print(json.dumps(out))
"""


def step(env, text):
    result = env.step(text)
    return asyncio.run(result) if asyncio.iscoroutine(result) else result


@pytest.fixture(scope="module")
def gem_url():
    """The server the adapter starts from COMMAND (from the project folder, as a stage would)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)
        mp.delenv("DVC_ROOT", raising=False)
        started = time.monotonic()
        url = oe.server_url(COMMAND, 180.0)
        measured("gem server start", seconds=time.monotonic() - started)
        yield url
        oe.stop_servers()
    deadline = time.monotonic() + 10   # the server's process group was signalled: it is gone within seconds
    while time.monotonic() < deadline:
        try:
            oe._get_json(url, "/health", 1.0)
            time.sleep(0.2)
        except oe.OpenEnvError:
            return
    raise AssertionError(f"the GEM server at {url} still answers after stop_servers()")


@pytest.fixture(scope="module")
def reference():
    """GEM itself, in .venv-gem, playing the recorded episodes (and 2048 through the server's class)."""
    args = [ENV_ID, json.dumps(EPISODES), json.dumps(MOVES_2048), json.dumps(SEEDS_2048),
            str(REPO / "src" / "turnrl" / "envs" / "ecosystem" / "gem_server.py")]
    done = subprocess.run([str(GEM_PYTHON), "-c", REFERENCE, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_replay_matches_gem_itself(gem_url, reference):
    endings = set()
    for (seed, script), expected in zip(EPISODES, reference["episodes"]):
        env = envs.make("openenv", command=COMMAND)
        assert env.reset({"game_seed": seed}) == expected[0]["text"], seed
        turns = 0
        for text, want in zip(script, expected[1:]):
            got = step(env, text)
            turns += 1
            assert got.observation == want["text"] and want["obs"] in want["text"], (seed, text)
            assert got.reward == pytest.approx(want["reward"], abs=1e-9), (seed, text)
            assert got.done == (want["terminated"] or want["truncated"]), (seed, text)
            assert got.info["terminated"] == float(want["terminated"]), (seed, text)
            assert got.info["truncated"] == float(want["truncated"]), (seed, text)
            if got.done:
                assert got.info["outcome"] == pytest.approx(sum(s["reward"] for s in expected[1:]), abs=1e-9)
                endings.add("win" if want["reward"] == 1.0 else "truncated" if want["truncated"] else "invalid")
                break
        assert got.done and turns == len(expected) - 1, seed   # both ended, on the same turn
    assert [e[0]["text"] for e in reference["episodes"]] == reference["wrapped_resets"]   # GEM's wrapper's view
    assert endings == {"win", "truncated", "invalid"}   # the recording covers each way GEM ends here
    first_script = reference["episodes"][::len(SCRIPTS)]   # one script on each seed: the seed reached GEM
    assert len({json.dumps(e) for e in first_script}) == len(SEEDS)
    assert oe.server_url(COMMAND, 180.0) == gem_url   # one server per process, not per episode


def test_sessions_stepped_in_turn_each_play_their_own_seed(reference):
    """The server's class keeps one random state per session: 2048's tiles, drawn after each move
    from generators all sessions share, are those of the session's own seed."""
    games = reference["2048"]
    assert games["interleaved"] == games["alone"]
    assert games["alone"][0] != games["alone"][1]


def test_an_unknown_gem_id_is_one_line_not_a_hang(monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    command = ".venv-gem/bin/python src/turnrl/envs/ecosystem/gem_server.py --env game:NoSuchGame-v0 --port {port}"
    env = envs.make("openenv", command=command, startup_timeout_s=60)
    started = time.monotonic()
    with pytest.raises(oe.OpenEnvError) as error:
        env.reset({"game_seed": 1})
    seconds = time.monotonic() - started
    message = str(error.value)
    measured("unknown GEM id", seconds=seconds)
    assert "\n" not in message and seconds < 60
    assert message.startswith("env.options.command exited with code 2"), message
    assert "game:NoSuchGame-v0" in message and "not found in registry" in message, message


@pytest.mark.slow
def test_two_training_steps_on_a_gem_game(tiny_model_dir, tmp_path):
    """GRPO through Ray and DeepSpeed on a GEM game: the rollout worker starts the GEM server from
    .venv-gem (an absolute command: Ray's workers need not share the test's directory). On the HF
    engine, as the other adapters' two steps."""
    from conftest import train_two_steps
    command = f"{GEM_PYTHON} {REPO / 'src' / 'turnrl' / 'envs' / 'ecosystem' / 'gem_server.py'} --env {ENV_ID} --port {{port}}"
    start = time.monotonic()
    history = train_two_steps(tiny_model_dir, tmp_path, {"name": "openenv", "options": {"command": command}},
                              {"name": "grpo"}, data={"train_examples": 16, "heldout_examples": 4},
                              rollout={"n": 2, "max_tokens_per_turn": 8, "max_turns": 2, "engine": "hf"})
    measured("gem: two training steps", seconds=time.monotonic() - start)
    assert [h["step"] for h in history] == [1, 2]
    assert all(h["finish_env_error_frac"] == 0.0 for h in history)
    # GEM's own per-turn rewards: -0.1 for a reply it cannot parse, up to 1 for a win
    assert all(-0.2 <= h["reward_mean"] <= 1.0 for h in history)
    assert all(1.0 <= h["turns_mean"] <= 2.0 for h in history)
