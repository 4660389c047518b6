"""math_refine (MLMT-RL): solve, feedback, refine. Shared weights step by step and through the
rollout loop's assembly; a frozen high-level model behind a real OpenAI-compatible server
(vLLM on the tiny model), and endpoints that fail."""
import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from turnrl import envs
from turnrl.envs.math_refine import (ENDPOINT_OBSERVATION, FEEDBACK_REQUEST, HIGH_LEVEL_PROMPT, REFINE_REQUEST,
                                     SYSTEM_PROMPT, MathRefineEnv, feedback_messages, parse_feedback)
from turnrl.rollout.chat import ChatFormat
from turnrl.rollout.multi_turn import Budgets, replay, run_rollouts

from conftest import ScriptedEngine

TWELVE = {"prompt": "What is 3 * 4?", "answer": "12"}
HALF = {"prompt": "What is 1/2 as a decimal?", "answer": "\\frac{1}{2}"}
ASK = FEEDBACK_REQUEST.format(problem=TWELVE["prompt"])   # the request restates the problem


# ----------------------------------------------------------------------------- shared weights
def test_the_registry_and_the_protocol_constants():
    env = envs.make("math_refine")
    assert isinstance(env, MathRefineEnv) and "math_refine" in envs.names()
    assert env.feedback == "self" and env.system_prompt == SYSTEM_PROMPT
    assert env.observation_role == "user" and env.stop == ("</answer>", "</feedback>")
    assert [env.role(t) for t in range(3)] == ["low", "high", "low"] and env.num_turns == 3
    assert env.reset(TWELVE) == "What is 3 * 4?"
    assert MathRefineEnv(system_prompt="Be brief.").system_prompt == "Be brief."


def test_a_correct_attempt_then_a_wrong_refinement():
    env = MathRefineEnv()
    env.reset(TWELVE)
    r0 = env.step("3 * 4 = 12. <answer>12</answer>")
    assert not r0.done and r0.reward == 1.0 and r0.observation == ASK
    assert r0.info == {"attempt_correct": 1.0, "attempt_extracted": "12"}
    r1 = env.step("<feedback>Check the product again.</feedback>")
    assert not r1.done and r1.reward == 0.0 and r1.observation == REFINE_REQUEST
    assert r1.info == {"feedback": "Check the product again.", "feedback_format": 1}
    r2 = env.step("You are right, it is <answer>13</answer>")
    assert r2.done and r2.observation is None and r2.reward == 0.0
    info = r2.info
    assert info["outcome"] == 0.0 and info["reason"] == "answer" and info["extracted"] == "13"
    assert info["attempt_correct"] == 1.0 and info["attempt_extracted"] == "12" and info["improvement"] == -1.0
    assert info["feedback"] == "Check the product again." and info["feedback_format"] == 1
    with pytest.raises(RuntimeError):
        env.step("<answer>12</answer>")


def test_a_wrong_attempt_then_a_right_refinement_graded_with_math_verify():
    env = MathRefineEnv()
    env.reset(HALF)
    r0 = env.step("It is \\boxed{0.25}")
    assert r0.reward == 0.0 and r0.info["attempt_extracted"] == "0.25" and not r0.done
    env.step("<feedback>Halve 1, not 1/2.</feedback>")
    r2 = env.step("So it is <answer>0.5</answer>")                # 0.5 == \frac{1}{2}
    assert r2.done and r2.reward == 1.0
    assert r2.info["outcome"] == 1.0 and r2.info["attempt_correct"] == 0.0 and r2.info["improvement"] == 1.0
    assert r2.info["extracted"] == "0.5" and r2.info["reason"] == "answer"


def test_missing_tags_do_not_end_the_exchange_early():
    env = MathRefineEnv()
    env.reset(TWELVE)
    r0 = env.step("I am not sure what three fours are.")            # no answer: just wrong
    assert not r0.done and r0.reward == 0.0 and r0.observation == ASK
    assert r0.info["attempt_extracted"] is None
    r1 = env.step("Add four three times.")                          # no <feedback> tags
    assert not r1.done and r1.observation == REFINE_REQUEST
    assert r1.info == {"feedback": "Add four three times.", "feedback_format": 0}
    r2 = env.step("4 + 4 + 4, so twelve.")                          # no answer at the end
    assert r2.done and r2.reward == 0.0
    assert r2.info["outcome"] == 0.0 and r2.info["reason"] == "no_answer" and r2.info["extracted"] is None
    assert r2.info["improvement"] == 0.0 and r2.info["feedback_format"] == 0

    env.reset(TWELVE)                                               # reset starts a new exchange
    assert env.step("<answer>12</answer>").observation == ASK


@pytest.mark.parametrize("text, feedback, ok", [
    ("<feedback> Carry the one. </feedback>", "Carry the one.", True),
    ("Hmm. <feedback>first</feedback> <feedback>second</feedback>", "first", True),
    ("<feedback>Carry the one.", "Carry the one.", False),          # cut before the closing tag
    ("plain words", "plain words", False),
])
def test_parse_feedback(text, feedback, ok):
    assert parse_feedback(text) == (feedback, ok)


def test_feedback_messages():
    msgs = feedback_messages("What is 3 * 4?", "<answer>13</answer>", "Teach.")
    assert [m["role"] for m in msgs] == ["system", "user"] and msgs[0]["content"] == "Teach."
    assert "What is 3 * 4?" in msgs[1]["content"] and "<answer>13</answer>" in msgs[1]["content"]
    assert feedback_messages("p", "a")[0]["content"] == HIGH_LEVEL_PROMPT


def test_constructor_errors():
    with pytest.raises(ValueError, match="endpoint_url"):
        MathRefineEnv(feedback="endpoint")
    with pytest.raises(ValueError, match="feedback"):
        MathRefineEnv(feedback="teacher")


# ----------------------------------------------------------------------------- token assembly
@pytest.fixture(scope="module")
def fmt(tiny_model_dir):
    from transformers import AutoTokenizer
    return ChatFormat(AutoTokenizer.from_pretrained(str(tiny_model_dir)))


def _spans(t):
    """(turn, mask, start, end) runs of equal (turn id, loss mask) over the response."""
    runs, start = [], 0
    for i in range(1, len(t.response_ids) + 1):
        if i == len(t.response_ids) or (t.turn_ids[i], t.loss_mask[i]) != (t.turn_ids[start], t.loss_mask[start]):
            runs.append((t.turn_ids[start], t.loss_mask[start], start, i))
            start = i
    return runs


def test_replay_masks_exactly_the_policy_turns(fmt):
    turns = ["<answer>13</answer>", "<feedback>3 * 4 is 12.</feedback>", "<answer>12</answer>"]
    t = replay(MathRefineEnv(), fmt, TWELVE, turns)
    assert t.prompt_ids == fmt.prompt_ids(SYSTEM_PROMPT, TWELVE["prompt"])
    assert t.num_turns == 3 and t.turn_rewards == [0.0, 0.0, 1.0] and t.outcome == 1.0 and t.finish == "answer"
    assert t.observations == [ASK, REFINE_REQUEST]
    ids = [fmt.encode(x) for x in turns]
    obs = [fmt.observation_ids(o, "user") for o in t.observations]
    assert t.response_ids == ids[0] + obs[0] + ids[1] + obs[1] + ids[2]
    assert _spans(t) == [
        (0, 1, 0, len(ids[0])),
        (0, 0, len(ids[0]), len(ids[0] + obs[0])),
        (1, 1, len(ids[0] + obs[0]), len(ids[0] + obs[0] + ids[1])),
        (1, 0, len(ids[0] + obs[0] + ids[1]), len(ids[0] + obs[0] + ids[1] + obs[1])),
        (2, 1, len(ids[0] + obs[0] + ids[1] + obs[1]), len(t.response_ids)),
    ]
    assert t.policy_tokens() == sum(map(len, ids)) and t.info["improvement"] == 1.0
    # the feedback request is a user message between the assistant's attempt and its feedback
    assert fmt.tokenizer.decode(obs[0]) == (f"<|im_end|>\n<|im_start|>user\n{ASK}<|im_end|>\n"
                                            "<|im_start|>assistant\n")


def test_scripted_rollouts_through_the_loop(fmt):
    turns = ["<answer>12</answer>", "<feedback>Right.</feedback>", "<answer>12</answer>"]
    engine = ScriptedEngine(fmt.tokenizer, turns)
    trajs = run_rollouts(engine, [TWELVE], lambda: MathRefineEnv(), fmt, Budgets(3, 64, 1000), n=2)
    assert engine.calls[0]["stop"] == ("</answer>", "</feedback>") and len(engine.calls) == 3
    for t in trajs:
        assert t.finish == "answer" and t.outcome == 1.0 and t.turn_rewards == [1.0, 0.0, 1.0]
        assert t.info["improvement"] == 0.0 and t.info["feedback"] == "Right."
        assert sorted(set(t.turn_ids)) == [0, 1, 2]


# ----------------------------------------------------------------------------- failing endpoints
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_endpoint_gives_explicit_missing_feedback():
    env = MathRefineEnv(feedback="endpoint", endpoint_url=f"http://127.0.0.1:{_free_port()}/v1", timeout_s=5)
    assert env.role(0) == env.role(1) == "low" and env.num_turns == 2
    env.reset(TWELVE)
    start = time.monotonic()
    r0 = env.step("<answer>13</answer>")
    assert time.monotonic() - start < 5
    assert not r0.done and r0.reward == 0.0
    error = r0.info["feedback_error"]
    assert error and "Connection" in error
    assert r0.info["feedback"] == f"(no feedback: {error})"
    assert r0.observation == ENDPOINT_OBSERVATION.format(feedback=f"(no feedback: {error})", refine_request=REFINE_REQUEST)
    r1 = env.step("<answer>12</answer>")                            # the refinement is still graded
    assert r1.done and r1.reward == 1.0 and r1.info["outcome"] == 1.0 and r1.info["improvement"] == 1.0
    assert r1.info["feedback_error"] == error


def test_a_silent_endpoint_times_out():
    with socket.socket() as server:                                 # accepts connections, never answers
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        env = MathRefineEnv(feedback="endpoint", endpoint_model="m", timeout_s=1,
                            endpoint_url=f"http://127.0.0.1:{server.getsockname()[1]}/v1")
        env.reset(TWELVE)
        start = time.monotonic()
        r0 = env.step("<answer>13</answer>")
        assert time.monotonic() - start < 4
    assert "Timeout" in r0.info["feedback_error"] and r0.observation.startswith("<feedback>(no feedback: ")


def test_an_http_error_is_reported_not_raised():
    class Failing(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_error(503, "overloaded")

        do_POST = do_GET

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = MathRefineEnv(feedback="endpoint", endpoint_url=f"http://127.0.0.1:{server.server_port}/v1")
        env.reset(TWELVE)
        r0 = env.step("<answer>13</answer>")                        # fails already at GET /models
    finally:
        server.shutdown()
        server.server_close()
    assert "503" in r0.info["feedback_error"] and "(no feedback: " in r0.observation


# ----------------------------------------------------------------------------- a real endpoint
@pytest.fixture(scope="module")
def vllm_server(tiny_model_dir, tmp_path_factory):
    """vLLM's OpenAI-compatible server on the tiny model, on loopback; yields its /v1 URL."""
    import requests
    from turnrl.rollout.engines import cpu_env_defaults

    port = _free_port()
    log = tmp_path_factory.mktemp("vllm_server") / "server.log"
    env = {**os.environ, **cpu_env_defaults(1.0)}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model_dir),
           "--port", str(port), "--host", "127.0.0.1", "--max-model-len", "2048", "--dtype", "float32",
           "--enforce-eager", "--seed", "0"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the vLLM server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if requests.get(f"{url}/models", timeout=2).ok:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the vLLM server did not answer within 180 s:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield url
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
def test_feedback_from_a_frozen_model_behind_vllm_serve(vllm_server, fmt):
    # The untrained tiny model's greedy reply decodes to nothing (partial UTF-8 bytes), which the
    # environment reports as an empty response; sampled, it writes (nonsense) text.
    options = {"feedback": "endpoint", "endpoint_url": vllm_server, "feedback_max_tokens": 16,
               "feedback_temperature": 1.0}
    env = envs.make("math_refine", **options)
    env.reset(TWELVE)
    r0 = env.step("3 * 4 = 13. <answer>13</answer>")
    assert not r0.done and r0.reward == 0.0 and r0.info["attempt_correct"] == 0.0
    assert r0.info["feedback_error"] == "", r0.info["feedback"]
    feedback = r0.info["feedback"]
    assert feedback and not feedback.startswith("(no feedback")
    assert feedback in r0.observation and r0.observation.endswith(REFINE_REQUEST)
    assert r0.observation == ENDPOINT_OBSERVATION.format(feedback=feedback, refine_request=REFINE_REQUEST)
    r1 = env.step("So it is <answer>12</answer>")                   # the refinement is graded
    assert r1.done and r1.reward == 1.0 and r1.info["outcome"] == 1.0 and r1.info["reason"] == "answer"
    assert r1.info["improvement"] == 1.0 and r1.info["feedback"] == feedback and r1.info["extracted"] == "12"

    # the same, assembled by the rollout loop with threads stepping the environments
    engine = ScriptedEngine(fmt.tokenizer, ["3 * 4 = 13. <answer>13</answer>", "So it is <answer>12</answer>"])
    trajs = run_rollouts(engine, [TWELVE], lambda: envs.make("math_refine", **options), fmt,
                         Budgets(3, 64, 1000), n=2, env_workers=2)
    for t in trajs:
        assert t.num_turns == 2 and t.finish == "answer" and t.turn_rewards == [0.0, 1.0]
        assert t.info["feedback_error"] == "" and t.observations[0].endswith(REFINE_REQUEST)
        assert t.info["feedback"] and t.info["feedback"] in t.observations[0]
        assert sorted(set(t.turn_ids)) == [0, 1] and t.loss_mask[-1] == 1
