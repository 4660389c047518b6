"""The rollout loop's waiting policy (`rollout.rejoin`): with `ready`, a slow tool's answer
rejoins as soon as it is back while the engine goes on decoding the others; with `lag` (the
default, reproducible) the schedule counts engine steps and a due answer is waited for."""
import asyncio
import time

import pytest
from transformers import AutoTokenizer

from turnrl.envs.base import StepResult
from turnrl.rollout.chat import ChatFormat
from turnrl.rollout.multi_turn import Budgets, Sample, run_rollouts

EXAMPLE = {"prompt": "Compute 1 + 1.", "answer": "2"}


@pytest.fixture(scope="module")
def fmt(tiny_model_dir):
    return ChatFormat(AutoTokenizer.from_pretrained(tiny_model_dir))


class TimedEngine:
    """A stand-in for a stepped engine (the loop around it is what is tested): request `key`'s
    turn takes `steps[key]` engine steps of `step_s` seconds each; adds, finishes and steps are
    logged with the engine step and the time."""

    def __init__(self, tokenizer, steps: dict[int, int], step_s: float = 0.01):
        self.tokenizer, self.steps, self.step_s, self.log = tokenizer, steps, step_s, []

    def stepper(self, *, stop, temperature, top_p):
        engine = self

        class Stepper:
            def __init__(self):
                self.running, self.now = {}, 0

            def add(self, key, prompt, max_tokens, seed):
                engine.log.append(("add", key, self.now, time.time()))
                self.running[key] = self.now + engine.steps.get(key, 1)

            def step(self):
                time.sleep(engine.step_s)
                self.now += 1
                engine.log.append(("step", None, self.now, time.time()))
                done = [k for k, end in self.running.items() if end <= self.now]
                ids = engine.tokenizer("go", add_special_tokens=False)["input_ids"]
                for k in done:
                    del self.running[k]
                    engine.log.append(("done", k, self.now, time.time()))
                return [(k, Sample(ids, [-0.5] * len(ids), "stop")) for k in done]

            def busy(self):
                return bool(self.running)

            def abort(self):
                self.running.clear()

        return Stepper()


class SlowTool:
    """Two turns; trajectory k's tool takes `delays[k]` seconds (awaited: an async tool)."""
    system_prompt, stop, observation_role = "Go.", (), "tool"
    delays: dict[int, float] = {}
    count = 0

    def __init__(self):
        self.k = SlowTool.count
        SlowTool.count += 1

    def reset(self, example):
        self.turns = 0
        return example["prompt"]

    async def step(self, text):
        self.turns += 1
        if self.turns == 2:
            return StepResult(None, 0.0, True, {"outcome": 1.0, "reason": "answer"})
        await asyncio.sleep(SlowTool.delays.get(self.k, 0.0))
        return StepResult("result", 1.0, False, {"tool_ok": True})


def rollout(fmt, rejoin, steps, delays, n):
    SlowTool.count, SlowTool.delays = 0, delays
    engine = TimedEngine(fmt.tokenizer, steps)
    start = time.perf_counter()
    trajs = run_rollouts(engine, [EXAMPLE], SlowTool, fmt, Budgets(3, 32, 400), n=n, rejoin=rejoin)
    return trajs, engine.log, time.perf_counter() - start


def adds(log, key):
    return [(step, t) for event, k, step, t in log if event == "add" and k == key]


def test_ready_keeps_decoding_while_a_tool_runs_and_rejoins_when_it_is_back(fmt):
    """Trajectory 0's turn ends after 1 step and its tool takes 0.3 s; trajectory 1 decodes for
    60 steps of 10 ms. lag 0: the engine stops until trajectory 0's answer is back (no step
    during the tool call). ready: the engine goes on with trajectory 1, and trajectory 0's next
    turn joins the running batch a few steps later, once its answer is back."""
    steps, delays = {0: 1, 1: 60}, {0: 0.3}
    lag_trajs, lag_log, _ = rollout(fmt, "lag", steps, delays, n=2)
    ready_trajs, ready_log, _ = rollout(fmt, "ready", steps, delays, n=2)
    for trajs in (lag_trajs, ready_trajs):
        assert [t.finish for t in trajs] == ["answer", "answer"] and all(t.num_turns == 2 for t in trajs)
    (lag_step, lag_at), = adds(lag_log, 0)[1:]
    (ready_step, ready_at), = adds(ready_log, 0)[1:]
    assert lag_step == 1                          # rejoined at the step its turn ended: the engine waited
    lag_steps = [t for event, _, step, t in lag_log if event == "step"]
    assert lag_steps[1] - lag_steps[0] >= 0.29    # ... 0.3 s with no decoding at all
    assert ready_step > 5                         # the engine decoded trajectory 1 meanwhile
    ready_steps = [t for event, _, step, t in ready_log if event == "step"]
    assert max(b - a for a, b in zip(ready_steps, ready_steps[1:])) < 0.2     # never stalled on the tool
    tool_start, tool_end = ready_trajs[0].env_times[0]
    assert ready_at >= tool_end and tool_end - tool_start >= 0.29          # rejoined after it was back
    assert [t.response_ids for t in lag_trajs] == [t.response_ids for t in ready_trajs]


def test_ready_waits_only_when_nothing_is_left_to_decode(fmt):
    """Eight trajectories, each turn 1 step, each tool 0.3 s: all tools in flight at once; the
    loop blocks (nothing to decode) until the first is back, not 8 x 0.3 s."""
    trajs, log, took = rollout(fmt, "ready", {}, {k: 0.3 for k in range(8)}, n=8)
    assert [t.finish for t in trajs] == ["answer"] * 8
    spans = [t.env_times[0] for t in trajs]
    assert max(a for a, _ in spans) < min(b for _, b in spans)        # in flight together
    assert took < 0.3 * 8 / 2


def test_rejoin_must_be_lag_or_ready(fmt):
    with pytest.raises(ValueError, match="rejoin = 'soon'"):
        run_rollouts(TimedEngine(fmt.tokenizer, {}), [EXAMPLE], SlowTool, fmt, Budgets(2, 8, 100), rejoin="soon")


def test_ready_with_a_synchronous_environment_and_a_batch_engine(fmt):
    """A blocking environment (thread pool) and an engine that only generates whole batches
    (transformers' way): ready still ends every trajectory, token for token as lag does."""
    from turnrl import envs
    example = {"prompt": "Compute 123 * 456.", "answer": "56088"}
    tok = fmt.tokenizer

    class ByTurn:
        """Calls the tool first, answers once a tool <output> is in the conversation (the system prompt has one)."""
        calls = 0

        def generate(self, prompts, *, max_tokens, stop, temperature, top_p, seeds):
            ByTurn.calls += 1
            out = []
            for p in prompts:
                text = "<answer>56088</answer>" if tok.decode(p).count("<output>") > 1 else "<code>print(123 * 456)</code>"
                ids = tok(text, add_special_tokens=False)["input_ids"]
                out.append(Sample(ids, [-0.5] * len(ids), "stop"))
            return out

    runs = []
    for rejoin in ("lag", "ready"):
        runs.append(run_rollouts(ByTurn(), [example], lambda: envs.make("code_tool"), fmt, Budgets(3, 32, 300), n=3,
                                 rejoin=rejoin, env_workers=3))
    assert [t.response_ids for t in runs[0]] == [t.response_ids for t in runs[1]]
    assert all(t.outcome == 1.0 and t.num_turns == 2 for t in runs[1])
