"""`env.name: openenv` against real OpenEnv servers on loopback: openenv-core's own `create_app`
served by uvicorn in a subprocess (examples/openenv_guess, started by the adapter's `command`,
and a faulty variant defined here), the library's own client as the reference, and the faults
servers really have (down, 500, hanging, garbage, restarted). Each fault test prints what it
measured (`pytest -s`)."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conftest import free_port, measured
from turnrl import envs
from turnrl.envs.ecosystem import openenv as oe
from turnrl.plugins import PluginError
from turnrl.rollout.multi_turn import ENV_ERROR, Budgets, run_rollouts

# openenv-core itself is imported by the tests that use it (it imports gradio: seconds), not at collection
pytestmark = pytest.mark.skipif(importlib.util.find_spec("openenv.core") is None,
                                reason="openenv-core is not installed (the ecosystem extra)")

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
SERVE = f"{sys.executable} -m uvicorn --host 127.0.0.1 --port {{port}} --app-dir {REPO} "
GUESS_COMMAND = SERVE + "examples.openenv_guess.server:app"
# Recorded policy turns, replayed on three seeds: numbers, text around a number, no number at all.
TURNS = ["8", "I think 12", "no idea", "4", "16"]
SEEDS = [3, 5, 11]


def step(env, text):
    result = env.step(text)
    return asyncio.run(result) if asyncio.iscoroutine(result) else result


# --------------------------------------------------------------------------- a faulty OpenEnv server
def faulty_app():
    """The guessing game, except that a guess containing HANG never answers and CRASH raises
    (uvicorn --factory calls this in the server's process)."""
    sys.path.insert(0, str(REPO))
    from openenv.core.env_server import create_app

    from examples.openenv_guess.env import GuessAction, GuessEnvironment, GuessObservation

    class FaultyGuess(GuessEnvironment):
        def step(self, action, timeout_s=None, **kwargs):
            if "HANG" in action.guess:
                time.sleep(60)
            if "CRASH" in action.guess:
                raise RuntimeError("the game crashed")
            return super().step(action, timeout_s=timeout_s, **kwargs)

    return create_app(FaultyGuess, GuessAction, GuessObservation, max_concurrent_envs=64)


def wrong_type_action(text: str) -> dict:
    return {"guess": len(text)}   # an int where the Action wants a string: the server rejects it


def serve(app: str, factory: bool = False) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = (f"{sys.executable} -m uvicorn --host 127.0.0.1 --port {port} --app-dir {TESTS} "
               + ("--factory " if factory else "") + app)
    proc = subprocess.Popen(command.split(), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180   # importing openenv-core (gradio) takes tens of seconds on a loaded machine
    while time.time() < deadline:
        assert proc.poll() is None, f"{app} exited with {proc.returncode}"
        try:
            oe._get_json(url, "/health", 1.0)
            return proc, url
        except oe.OpenEnvError:
            time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"{app} did not answer /health")


@pytest.fixture(scope="module")
def faulty():
    proc, url = serve("test_ecosystem_openenv:faulty_app", factory=True)
    yield url
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.fixture(scope="module")
def guess_url():
    """The example server, started by the adapter's `command` (this process's server)."""
    url = oe.server_url(GUESS_COMMAND, 180.0)
    yield url
    oe.stop_servers()


# --------------------------------------------------------------------------- parity with the library
def library_episode(url: str, seed: int) -> list[tuple[str, float, bool]]:
    """(message, reward with None as 0, done) per turn, from openenv-core's own client."""
    from openenv.core.generic_client import GenericEnvClient
    out = []
    with GenericEnvClient(base_url=url).sync() as client:
        first = client.reset(seed=seed)
        out.append((first.observation["message"], 0.0, first.done))
        for text in TURNS:
            r = client.step({"guess": text})
            out.append((r.observation["message"], 0.0 if r.reward is None else r.reward, r.done))
            if r.done:
                break
    return out


def adapter_episode(env, seed: int) -> tuple[list[tuple[str, float, bool]], float, dict]:
    out = [(env.reset({"game_seed": seed}), 0.0, False)]
    last = None
    for text in TURNS:
        last = step(env, text)
        out.append((last.observation, last.reward, last.done))
        if last.done:
            break
    return out, last.info.get("outcome", sum(r for _, r, _ in out)), last.info


@pytest.mark.parametrize("seed", SEEDS)
def test_server_and_in_process_match_the_library_client(guess_url, seed):
    expected = library_episode(guess_url, seed)
    assert any(r == 1.0 for _, r, _ in expected) or expected[-1][2]   # the recording covers both endings
    for options in ({"url": guess_url}, {"command": GUESS_COMMAND},
                    {"env_class": "examples.openenv_guess.env:GuessEnvironment"}):
        got, outcome, info = adapter_episode(envs.make("openenv", **options), seed)
        assert [(o, d) for o, _, d in got] == [(o, d) for o, _, d in expected], options
        assert [r for _, r, _ in got] == pytest.approx([r for _, r, _ in expected], abs=1e-9)
        assert outcome == pytest.approx(sum(r for _, r, _ in expected), abs=1e-9)
        if got[-1][2]:
            assert info["reason"] == "done" and info["guesses_left"] == 4 - (len(got) - 1)
    assert oe.server_url(GUESS_COMMAND, 180.0) == guess_url   # one server per process, not per episode


def test_loss_mask_covers_exactly_the_policys_tokens(guess_url, tiny_model_dir):
    """Through the server (an async step, awaited by `replay`): the policy's turns are trained on,
    the server's observation between them is not."""
    from transformers import AutoTokenizer

    from turnrl.rollout.chat import ChatFormat
    from turnrl.rollout.multi_turn import replay
    fmt = ChatFormat(AutoTokenizer.from_pretrained(tiny_model_dir))
    turns = ["4", "8"]   # seed 3's number is 8: "Higher.", then "Correct!"
    t = replay(envs.make("openenv", url=guess_url), fmt, {"game_seed": 3}, turns)
    expected = [fmt.encode(x) + [fmt.end_of_turn_id] for x in turns]
    assert [i for i, m in zip(t.response_ids, t.loss_mask) if m] == expected[0] + expected[1]
    first = len(expected[0])
    observation_end = t.loss_mask.index(1, first)
    assert "Higher." in fmt.tokenizer.decode(t.response_ids[first:observation_end])
    assert (t.turn_rewards, t.outcome, t.finish) == ([0.0, 1.0], 1.0, "done")


def test_none_reward_is_zero_and_numeric_fields_are_info():
    env = envs.make("openenv", env_class="examples.openenv_guess.env:GuessEnvironment")
    env.reset({"game_seed": 3})
    result = step(env, "no number here")
    assert (result.observation, result.reward, result.done) == ("Say a number.", 0.0, False)
    assert result.info == {"guesses_left": 3.0}


def test_text_and_observation_mapping_options():
    env = envs.make("openenv", env_class="examples.openenv_guess.env:GuessEnvironment", action="guess",
                    observation="json:dumps")
    first = env.reset({"game_seed": 3})
    assert json.loads(first) == {"message": "I picked a number from 1 to 16. You have 4 guesses.", "guesses_left": 4}
    assert oe.default_render({"a": "x", "n": 2}) == "x"   # the only string field
    assert oe.default_render({"a": "x", "b": "y", "n": [2]}) == "a: x\nb: y\nn: [2]"


# --------------------------------------------------------------------------- bad options
@pytest.mark.parametrize("options, needle", [
    ({}, "set exactly one of env.options.url"),
    ({"url": "http://127.0.0.1:1", "env_class": "a:B"}, "got url, env_class"),
    ({"url": "127.0.0.1:8000"}, "env.options.url = '127.0.0.1:8000'"),
    ({"command": "uvicorn my_env.server:app"}, "must contain {port}"),
    ({"env_class": "my_env.Env"}, "env.options.env_class = 'my_env.Env'"),
    ({"url": "http://127.0.0.1:1", "timeout": 3}, "env.options.timeout: unknown option"),
])
def test_bad_options_are_one_line_naming_the_key(options, needle):
    with pytest.raises(PluginError) as err:
        envs.check_options(envs.resolve("openenv"), options)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_bad_env_class_and_action_field_name_the_key():
    with pytest.raises(PluginError, match=r"env\.options\.env_class = 'json:JSONDecoder' is not a subclass"):
        envs.make("openenv", env_class="json:JSONDecoder")
    with pytest.raises(PluginError, match=r"env\.options\.action = 'word'.*its fields: guess \(string\)"):
        envs.make("openenv", env_class="examples.openenv_guess.env:GuessEnvironment", action="word")


# --------------------------------------------------------------------------- servers that fail
def test_a_server_that_is_down_is_an_environment_error_at_once():
    url = f"http://127.0.0.1:{free_port()}"
    start = time.perf_counter()
    with pytest.raises(oe.OpenEnvError, match=f"the OpenEnv server at {url} is unreachable"):
        envs.make("openenv", url=url).reset({"game_seed": 1})            # the schema, for the default action
    with pytest.raises(oe.OpenEnvError, match=f"the OpenEnv server at {url} could not be reached"):
        envs.make("openenv", url=url, action="guess").reset({"game_seed": 1})   # the WebSocket
    took = time.perf_counter() - start
    assert took < 5, took
    measured("server down", seconds=took)


class _Answer500(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"   # what a WebSocket client expects of a proxy in front of a broken server

    def do_GET(self):
        self.send_error(500, "upstream exploded")

    def log_message(self, *args):
        pass


def test_a_server_answering_500_is_an_environment_error():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Answer500)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(oe.OpenEnvError, match="answered 500 to GET /schema"):
            envs.make("openenv", url=url).reset({"game_seed": 1})
        with pytest.raises(oe.OpenEnvError, match="could not be reached.*500"):
            envs.make("openenv", url=url, action="guess").reset({"game_seed": 1})
    finally:
        server.shutdown()


def test_an_environment_that_raises_or_rejects_the_action(faulty):
    env = envs.make("openenv", url=faulty)
    env.reset({"game_seed": 3})
    with pytest.raises(oe.OpenEnvError, match="failed the step: .*the game crashed"):
        step(env, "CRASH")
    rejecting = envs.make("openenv", url=faulty, action="test_ecosystem_openenv:wrong_type_action")
    rejecting.reset({"game_seed": 3})
    result = step(rejecting, "8")   # the server says VALIDATION_ERROR: the policy is told, the episode goes on
    assert result.observation.startswith("Invalid action") and not result.done and result.reward == 0.0
    assert result.info == {"invalid_action": 1.0}


def test_a_hanging_server_ends_every_trajectory_within_the_timeout(faulty, tiny_model_dir):
    """16 trajectories whose step never answers: all end as env_error in about one step_timeout_s
    (the steps are in flight at once), counted as environment errors."""
    from transformers import AutoTokenizer

    from conftest import ScriptedEngine
    from turnrl.rollout.chat import ChatFormat
    fmt = ChatFormat(AutoTokenizer.from_pretrained(tiny_model_dir))
    make = lambda: envs.make("openenv", url=faulty, step_timeout_s=1.0)   # noqa: E731
    start = time.perf_counter()
    trajs = run_rollouts(ScriptedEngine(fmt.tokenizer, ["HANG"] * 3), [{"game_seed": s} for s in range(16)], make,
                         fmt, Budgets(max_turns=3, max_tokens_per_turn=16, max_tokens_total=128))
    took = time.perf_counter() - start
    assert [t.finish for t in trajs] == [ENV_ERROR] * 16
    assert "did not answer the step within env.options.step_timeout_s = 1.0 s" in trajs[0].info["env_error"]
    assert took < 15, took
    measured("hanging server", trajectories=16, step_timeout_s=1.0, seconds=took)


def _garbage_server(reply_to_step: str) -> tuple[str, callable]:
    """A WebSocket server that answers resets as OpenEnv does and steps with `reply_to_step`;
    returns (its address, stop)."""
    from websockets.asyncio.server import serve
    loop = asyncio.new_event_loop()
    ready, holder = threading.Event(), {}

    async def handler(ws):
        async for raw in ws:
            kind = json.loads(raw).get("type")
            if kind == "reset":
                await ws.send(json.dumps({"type": "observation", "data": {
                    "observation": {"message": "hi"}, "reward": None, "done": False}}))
            elif kind == "step":
                await ws.send(reply_to_step)

    async def main():
        holder["stop"] = asyncio.Event()
        server = await serve(handler, "127.0.0.1", 0)
        holder["port"] = server.sockets[0].getsockname()[1]
        ready.set()
        await holder["stop"].wait()
        server.close()              # closes the connections; their handlers end
        await server.wait_closed()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(main()), loop.close()), daemon=True)
    thread.start()
    ready.wait(10)

    def stop():
        loop.call_soon_threadsafe(holder["stop"].set)
        thread.join(10)
    return f"http://127.0.0.1:{holder['port']}", stop


@pytest.mark.parametrize("reply, needle", [
    ("<html>502 Bad Gateway</html>", "answered the step with something that is not OpenEnv's protocol"),
    (json.dumps({"type": "observation", "data": {"observation": {"message": "x"}, "reward": "lots", "done": False}}),
     "answered a reward that is not a finite number: 'lots'"),
    (json.dumps({"type": "observation", "data": {"observation": "x", "reward": 1.0, "done": True}}),
     "answered an observation that is not an object"),
])
def test_garbage_from_the_server_is_an_environment_error(reply, needle):
    url, stop = _garbage_server(reply)
    try:
        env = envs.make("openenv", url=url, action="guess", step_timeout_s=5.0)
        assert env.reset({"game_seed": 1}) == "hi"
        with pytest.raises(oe.OpenEnvError) as err:
            step(env, "8")
        assert needle in str(err.value) and "\n" not in str(err.value)
    finally:
        stop()


def test_a_server_restarted_mid_run_is_reconnected(guess_url):
    """The command's server killed mid-episode: that episode is an environment error, the next
    reset starts a new server and plays on."""
    live = envs.make("openenv", command=GUESS_COMMAND)
    live.reset({"game_seed": 3})
    server = oe._SERVERS.live[GUESS_COMMAND]
    os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait()
    with pytest.raises(oe.OpenEnvError, match="closed the session during the step|could not be reached"):
        step(live, "8")
    start = time.perf_counter()
    fresh = envs.make("openenv", command=GUESS_COMMAND)
    assert fresh.reset({"game_seed": 3}).startswith("I picked a number")
    took = time.perf_counter() - start
    result = step(fresh, "8")
    assert (result.observation, result.reward, result.done) == ("Correct!", 1.0, True)
    restarted = oe._SERVERS.live[GUESS_COMMAND]
    assert restarted is not server and restarted.alive and restarted.url != guess_url   # a new server, new port
    assert not os.path.exists(server.log) and os.path.exists(restarted.log)   # the dead one's log removed
    measured("server restarted", seconds_to_new_server=took)


def test_a_killed_worker_leaves_no_server_behind():
    """A Ray worker ends by SIGKILL, so no atexit stop runs: the server its command started must
    still stop (within seconds), not live on as an orphan."""
    worker = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from turnrl.envs.ecosystem import openenv as oe; "
        f"print(oe.server_url({GUESS_COMMAND!r}, 120), oe._SERVERS.live[{GUESS_COMMAND!r}].log, flush=True); "
        "time.sleep(600)")],
        stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        url, log = worker.stdout.readline().split()
        assert os.path.exists(log)
        assert url.startswith("http://127.0.0.1:"), url
        oe._get_json(url, "/health", 5.0)
    finally:
        worker.kill()
        worker.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            oe._get_json(url, "/health", 1.0)
        except oe.OpenEnvError:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the server at {url} outlived its killed worker by 15 s")
    deadline = time.monotonic() + 15   # the watcher removes the server's log once the group is stopped
    while os.path.exists(log) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not os.path.exists(log), f"the killed worker's server log {log} was left behind"


# --------------------------------------------------------------------------- the real stack
@pytest.mark.slow
def test_two_training_steps_against_an_openenv_server(tiny_model_dir, tmp_path):
    """GRPO through Ray and DeepSpeed; the rollout worker starts the example server. On the HF
    engine: it spares CI a vLLM start (~100 s); the vLLM path has its own tests. (Resuming
    between the steps, which starts a second server, took 152 s against 51 s in CI: that is
    shown with skyrl_gym's two steps, and resume's code path is the same for every adapter.)"""
    from conftest import train_two_steps
    start = time.time()
    history = train_two_steps(tiny_model_dir, tmp_path, {"name": "openenv", "options": {"command": GUESS_COMMAND}},
                              {"name": "grpo"}, data={"train_examples": 16, "heldout_examples": 4},
                              rollout={"n": 2, "max_tokens_per_turn": 8, "max_turns": 2, "engine": "hf"})
    print(f"\nMEASURED openenv: two training steps in {time.time() - start:.1f} s")
    assert all(0.0 <= h["reward_mean"] <= 1.0 for h in history)
    assert all(h["finish_env_error_frac"] == 0.0 for h in history)
