"""The multi-turn rollout loop: token in, token out; environment tokens masked; budgets."""
import sys
import time

import pytest
from transformers import AutoTokenizer

from turnrl import envs
from turnrl.rollout.chat import ChatFormat
from turnrl.rollout.multi_turn import Budgets, Sample, replay, run_rollouts

from conftest import ScriptedEngine

EXAMPLE = {"prompt": "Compute 123 * 456.", "answer": "56088"}


@pytest.fixture(scope="module")
def fmt(tiny_model_dir):
    return ChatFormat(AutoTokenizer.from_pretrained(tiny_model_dir))


def test_two_turn_tool_trajectory_is_exact(fmt):
    tok = fmt.tokenizer
    engine = ScriptedEngine(tok, ["<code>print(123 * 456)</code>", "<answer>56088</answer>"])
    [t] = run_rollouts(engine, [EXAMPLE], lambda: envs.make("code_tool"), fmt, Budgets(3, 32, 200))
    turn1 = tok("<code>print(123 * 456)</code>", add_special_tokens=False)["input_ids"]
    turn2 = tok("<answer>56088</answer>", add_special_tokens=False)["input_ids"]
    obs = fmt.observation_ids("<output>56088</output>", "tool")
    # token in, token out: the response is exactly sampled ids + observation ids + sampled ids
    assert t.response_ids == turn1 + obs + turn2
    assert t.loss_mask == [1] * len(turn1) + [0] * len(obs) + [1] * len(turn2)
    assert t.turn_ids == [0] * (len(turn1) + len(obs)) + [1] * len(turn2)
    assert t.engine_logprobs == [-0.5] * len(turn1) + [0.0] * len(obs) + [-0.5] * len(turn2)
    assert t.turn_rewards == [1.0, 1.0] and t.outcome == 1.0 and t.finish == "answer"
    assert t.first_observation == len(turn1)
    # the second call continued the exact token sequence of the first
    assert engine.calls[1]["prompts"][0] == t.prompt_ids + turn1 + obs
    # the observation sits in the chat template's tool role
    assert tok.decode(obs) == "<|im_end|>\n<|im_start|>tool\n<output>56088</output><|im_end|>\n<|im_start|>assistant\n"


def test_groups_are_contiguous_and_finished_trajectories_drop_out(fmt):
    engine = ScriptedEngine(fmt.tokenizer, ["<answer>1</answer>"])
    trajs = run_rollouts(engine, [EXAMPLE, {"prompt": "Compute 1 * 1.", "answer": "1"}],
                         lambda: envs.make("code_tool"), fmt, Budgets(3, 32, 200), n=3)
    assert [t.example["answer"] for t in trajs] == ["56088"] * 3 + ["1"] * 3
    assert [t.outcome for t in trajs] == [0.0] * 3 + [1.0] * 3
    assert len(engine.calls) == 1            # everyone answered in turn 1: no second call


def test_max_turns_ends_the_trajectory(fmt):
    engine = ScriptedEngine(fmt.tokenizer, ["<code>print(1)</code>"] * 2)
    [t] = run_rollouts(engine, [EXAMPLE], lambda: envs.make("code_tool"), fmt, Budgets(2, 32, 500))
    assert t.finish == "max_turns" and t.num_turns == 2 and len(t.observations) == 1
    assert t.loss_mask[-1] == 1              # no observation after the last allowed turn


def test_a_turn_cut_by_the_token_limit_is_truncated(fmt):
    engine = ScriptedEngine(fmt.tokenizer, ["<code>print(123456789 * 987654321)</code>"])
    [t] = run_rollouts(engine, [EXAMPLE], lambda: envs.make("code_tool"), fmt, Budgets(3, 5, 200))
    assert t.finish == "truncated" and len(t.response_ids) == 5 and t.outcome == 0.0


def test_the_total_token_budget_caps_each_turn_and_ends_the_trajectory(fmt):
    turn = "<code>print(123 * 456)</code>"
    n_turn = len(fmt.encode(turn))
    n_obs = len(fmt.observation_ids("<output>56088</output>", "tool"))
    engine = ScriptedEngine(fmt.tokenizer, [turn, turn])
    [t] = run_rollouts(engine, [EXAMPLE], lambda: envs.make("code_tool"), fmt,
                       Budgets(3, 64, n_turn + n_obs + 3))
    assert engine.calls[1]["max_tokens"] == [3]       # only what is left of the budget
    assert t.finish == "truncated" and len(t.response_ids) == n_turn + n_obs + 3


def test_the_context_length_is_respected(fmt):
    engine = ScriptedEngine(fmt.tokenizer, [])
    [t] = run_rollouts(engine, [EXAMPLE], lambda: envs.make("code_tool"), fmt, Budgets(3, 32, 200, max_context=5))
    assert t.finish == "token_budget" and t.response_ids == [] and engine.calls == []


def test_replay_matches_the_loop(fmt):
    turns = ["<code>print(123 * 456)</code>", "<answer>56088</answer>"]
    looped = run_rollouts(ScriptedEngine(fmt.tokenizer, turns), [EXAMPLE], lambda: envs.make("code_tool"), fmt,
                          Budgets(3, 32, 200))[0]
    replayed = replay(envs.make("code_tool"), fmt, EXAMPLE, turns)
    assert replayed.prompt_ids + replayed.response_ids == looped.prompt_ids + looped.response_ids
    assert replayed.loss_mask == looped.loss_mask and replayed.outcome == looped.outcome == 1.0


def check_token_in_token_out(t, fmt):
    """Decoded policy tokens equal what was sampled; every other response token is an
    observation, exactly as the chat template renders it."""
    segments, current, mask_now = [], [], None
    for tok, m in zip(t.response_ids, t.loss_mask):
        if m != mask_now and current:
            segments.append((mask_now, current))
            current = []
        mask_now = m
        current.append(tok)
    if current:
        segments.append((mask_now, current))
    policy = [ids for m, ids in segments if m == 1]
    observations = [ids for m, ids in segments if m == 0]
    assert [fmt.tokenizer.decode(ids, skip_special_tokens=False) for ids in policy] == t.turn_texts[:len(policy)]
    assert observations == [fmt.observation_ids(o, "tool", after_eos=fmt.ends_turn(turn))
                            for o, turn in zip(t.observations, policy)]
    assert all(lp <= 0 for lp, m in zip(t.engine_logprobs, t.loss_mask) if m) 
    assert all(lp == 0 for lp, m in zip(t.engine_logprobs, t.loss_mask) if not m)


class _Template:
    """A tokenizer stand-in whose chat template takes a system message or refuses it."""
    def __init__(self, takes_system: bool):
        self.takes_system = takes_system

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False, **_):
        if messages[0]["role"] == "system" and not self.takes_system:
            raise ValueError("System role not supported")
        return "".join(f"<{m['role']}>{m['content']}" for m in messages)


def test_what_a_template_does_is_probed_per_tokenizer_not_per_address():
    """CI caught Gemma 2's check reading another family's answer: the probes were cached by
    id(tokenizer), and a new tokenizer took a freed one's address. CPython frees an object at
    its last reference and reuses the address at once, so 50 rounds of free-then-create reuse
    one for sure (no gc.collect(): in a process holding torch it takes ~1 s a call)."""
    from turnrl.rollout.chat import _PROBES, _renders_system
    for _ in range(50):
        accepting = _Template(True)
        assert _renders_system(accepting)
        del accepting
        assert not _renders_system(_Template(False))
    assert not any(isinstance(k, _Template) for k in list(_PROBES.keys())), "a freed tokenizer's probes stay"


def test_real_transformers_engine_keeps_sampled_ids(tiny_model_dir, fmt):
    from turnrl.rollout.engines import HFEngine
    engine = HFEngine(str(tiny_model_dir))
    trajs = run_rollouts(engine, [EXAMPLE] * 4, lambda: envs.make("code_tool"), fmt, Budgets(3, 16, 80), n=2)
    assert len(trajs) == 8
    for t in trajs:
        assert t.finish in {"answer", "no_action", "max_turns", "token_budget", "truncated"}
        check_token_in_token_out(t, fmt)


def test_a_turn_ended_by_the_model_is_not_closed_twice(fmt):
    """A ramble has no stop string: the model ends it with the end-of-turn token itself, and
    the conversation is exactly what the chat template renders for the same messages."""
    from turnrl.envs.intervention import INTERVENTION, InterventionEnv
    env = InterventionEnv(max_turns=3)
    example = {"prompt": "Compute 12 + 34.", "answer": "46"}
    t = replay(env, fmt, example, ["Let me think about it again.", "<answer>46</answer>"])
    eos = fmt.tokenizer.eos_token_id
    first_turn = [i for i, k in zip(t.response_ids, t.turn_ids) if k == 0]
    assert t.outcome == 1.0 and eos in first_turn
    assert t.response_ids[t.loss_mask.index(0) - 1] == eos          # the ramble's last policy token
    messages = [{"role": "system", "content": env.system_prompt}, {"role": "user", "content": example["prompt"]},
                {"role": "assistant", "content": "Let me think about it again."},
                {"role": "user", "content": INTERVENTION},
                {"role": "assistant", "content": "<answer>46</answer>"}]
    rendered = fmt.tokenizer.apply_chat_template(messages, tokenize=False)
    text = fmt.tokenizer.decode(t.prompt_ids + t.response_ids, skip_special_tokens=False)
    assert rendered.startswith(text) and rendered[len(text):].strip() == fmt.tokenizer.eos_token


def test_two_models_each_play_their_level_of_one_conversation(fmt):
    """math_refine with a second model for the feedback: turns 0 and 2 come from the solver's
    engine, turn 1 from the feedback model's, each batched over the live trajectories."""
    tok = fmt.tokenizer
    low = ScriptedEngine(tok, ["<answer>57</answer>", "<answer>123</answer>"])
    high = ScriptedEngine(tok, ["<feedback>5+8=13 7+4+1=12</feedback>"])
    example = {"prompt": "Compute 75 + 48.", "answer": "123"}
    trajs = run_rollouts({"low": low, "high": high}, [example], lambda: envs.make("math_refine"), fmt,
                         Budgets(3, 32, 400), n=2)
    assert len(low.calls) == 2 and len(high.calls) == 1
    assert all(len(c["prompts"]) == 2 for c in low.calls + high.calls)   # the group shares each call
    for t in trajs:
        assert t.turn_texts == ["<answer>57</answer>", "<feedback>5+8=13 7+4+1=12</feedback>", "<answer>123</answer>"]
        assert t.outcome == 1.0 and t.info["attempt_correct"] == 0.0 and t.finish == "answer"
        # the feedback model continued exactly the solver's tokens and the environment's
        attempt = tok("<answer>57</answer>", add_special_tokens=False)["input_ids"]
        assert high.calls[0]["prompts"][0][len(t.prompt_ids):][:len(attempt)] == attempt
        assert sorted(set(t.turn_ids)) == [0, 1, 2]
    # one engine for both levels is the shared-weights mode: three calls
    shared = ScriptedEngine(tok, ["<answer>57</answer>", "<feedback>ok</feedback>", "<answer>123</answer>"])
    run_rollouts(shared, [example], lambda: envs.make("math_refine"), fmt, Budgets(3, 32, 400))
    assert len(shared.calls) == 3


# --------------------------------------------------------------------------- continuous batching across turns
class SteppingEngine:
    """A stand-in for an engine driven step by step (the code around it is what is tested):
    request `key` takes `steps[key]` engine steps and answers `text`; every add and finish
    is logged with the engine step it happened at."""

    def __init__(self, tokenizer, text: str, steps: dict[int, int]):
        self.tokenizer, self.text, self.steps, self.log = tokenizer, text, steps, []

    def stepper(self, *, stop, temperature, top_p):
        engine = self

        class Stepper:
            def __init__(self):
                self.running, self.now = {}, 0

            def add(self, key, prompt, max_tokens, seed):
                engine.log.append(("add", key, self.now))
                self.running[key] = self.now + engine.steps.get(key, 1)

            def step(self):
                self.now += 1
                done = [k for k, end in self.running.items() if end <= self.now]
                ids = engine.tokenizer(engine.text, add_special_tokens=False)["input_ids"]
                for k in done:
                    del self.running[k]
                    engine.log.append(("done", k, self.now))
                return [(k, Sample(ids, [-0.5] * len(ids), "stop")) for k in done]

            def busy(self):
                return bool(self.running)

            def abort(self):
                self.running.clear()

        return Stepper()


class SlowCodeTool:
    """code_tool whose answers come back after a random delay (a slow sandbox or network)."""

    def __init__(self, rng):
        self.env, self.rng = envs.make("code_tool"), rng

    def __getattr__(self, name):
        return getattr(self.env, name)

    def step(self, text):
        time.sleep(self.rng.uniform(0, 0.03))
        return self.env.step(text)


def test_a_turn_starts_while_other_trajectories_still_decode(fmt):
    """Trajectory 0's turn takes 1 engine step, trajectory 1's 6: with a lag of 2, trajectory
    0's second turn joins the batch at step 3, before trajectory 1's first turn is done."""
    engine = SteppingEngine(fmt.tokenizer, "<code>print(1)</code>", steps={0: 1, 1: 6})
    trajs = run_rollouts(engine, [EXAMPLE], lambda: envs.make("code_tool"), fmt, Budgets(2, 32, 500), n=2,
                         observation_lag=2)
    adds_of_0 = [step for event, key, step in engine.log if event == "add" and key == 0]
    first_done_of_1 = next(step for event, key, step in engine.log if event == "done" and key == 1)
    assert adds_of_0 == [0, 3] and first_done_of_1 == 6
    assert [t.finish for t in trajs] == ["max_turns", "max_turns"]
    assert all(t.num_turns == 2 and len(t.observations) == 1 for t in trajs)
    check_token_in_token_out(trajs[0], fmt)


def test_the_schedule_does_not_depend_on_how_long_the_environment_takes(fmt):
    """Answers that come back late are waited for at their due step: the engine sees the same
    adds at the same steps whatever the environment's timing."""
    import random
    logs = []
    for run in range(3):
        rng = random.Random(run)
        engine = SteppingEngine(fmt.tokenizer, "<code>print(2)</code>", steps={k: 1 + k % 3 for k in range(6)})
        run_rollouts(engine, [EXAMPLE], lambda: SlowCodeTool(rng), fmt, Budgets(3, 32, 500), n=6,
                     observation_lag=1, env_workers=3)
        logs.append(engine.log)
    assert logs[0] == logs[1] == logs[2]
    assert sum(1 for event, *_ in logs[0] if event == "add") == 6 * 3      # three turns each


class Wrapped:
    """code_tool, with some of its methods replaced."""

    def __init__(self, **replaced):
        self.env = envs.make("code_tool")
        self.__dict__.update(replaced)

    def __getattr__(self, name):
        return getattr(self.env, name)


def test_an_environment_that_raises_ends_only_its_own_trajectory(fmt):
    """A user's environment raising in its factory, reset or step: that trajectory ends (finish
    env_error, the exception in info), the others go on to their answers."""
    calls = {"n": 0}

    def factory():
        calls["n"] += 1
        k = calls["n"]
        if k == 1:
            raise OSError("no sandbox today")
        if k == 2:
            return Wrapped(reset=lambda example: (_ for _ in ()).throw(KeyError("prompt")))
        if k == 3:
            return Wrapped(step=lambda text: (_ for _ in ()).throw(RuntimeError("sandbox gone")))
        return envs.make("code_tool")

    engine = ScriptedEngine(fmt.tokenizer, ["<code>print(123 * 456)</code>", "<answer>56088</answer>"] * 2)
    trajs = run_rollouts(engine, [EXAMPLE], factory, fmt, Budgets(3, 32, 500), n=5)
    assert [t.finish for t in trajs] == ["env_error", "env_error", "env_error", "answer", "answer"]
    assert trajs[0].info["env_error"] == "OSError: no sandbox today" and trajs[0].response_ids == []
    assert trajs[1].info["env_error"] == "KeyError: 'prompt'"
    assert trajs[2].info["env_error"] == "RuntimeError: sandbox gone" and trajs[2].num_turns == 1
    assert all(t.outcome == 1.0 for t in trajs[3:]) and all(t.outcome == 0.0 for t in trajs[:3])


def test_an_async_environment_steps_concurrently(fmt):
    """An environment whose step is a coroutine function: every trajectory's pending step is in
    flight at once (8 steps of 0.3 s each take about 0.3 s, not 2.4 s)."""
    import asyncio
    import time

    class SlowAsync:
        def __init__(self):
            self.env = envs.make("code_tool")
            self.system_prompt, self.stop, self.observation_role = (self.env.system_prompt, self.env.stop,
                                                                    self.env.observation_role)

        def reset(self, example):
            return self.env.reset(example)

        async def step(self, text):
            await asyncio.sleep(0.3)
            return self.env.step(text.replace("<code>print(123 * 456)</code>", "<answer>56088</answer>"))

    engine = ScriptedEngine(fmt.tokenizer, ["<code>print(123 * 456)</code>"])
    start = time.perf_counter()
    trajs = run_rollouts(engine, [EXAMPLE], SlowAsync, fmt, Budgets(3, 32, 500), n=8, env_workers=1)
    assert time.perf_counter() - start < 1.5
    assert [t.finish for t in trajs] == ["answer"] * 8 and all(t.outcome == 1.0 for t in trajs)
    # each trajectory's generation and environment step are timed (for traces): the steps overlap
    assert all(len(t.turn_times) == 1 and len(t.env_times) == 1 for t in trajs)
    steps = [t.env_times[0] for t in trajs]
    assert all(end - begin >= 0.29 for begin, end in steps)
    assert max(begin for begin, _ in steps) < min(end for _, end in steps)     # all in flight at once
    assert all(t.turn_times[0][1] <= t.env_times[0][0] for t in trajs)        # generated, then stepped


def test_a_failing_rollout_drops_the_engines_unfinished_requests(fmt):
    """An error the loop cannot pin on one trajectory's reset or step (here an environment
    whose observation_role raises once it has stepped: the check after reset reads it first)
    stops the rollout, and the engine keeps no request of it."""
    class NoRole(Wrapped):
        stepped = False

        def step(self, text):
            self.stepped = True
            return self.env.step(text)

        @property
        def observation_role(self):
            if self.stepped:
                raise RuntimeError("no role")
            return "tool"

    engine = SteppingEngine(fmt.tokenizer, "<code>print(3)</code>", steps={0: 1, 1: 9})
    steppers = []
    original = engine.stepper
    engine.stepper = lambda **kw: steppers.append(original(**kw)) or steppers[-1]
    with pytest.raises(RuntimeError, match="no role"):
        run_rollouts(engine, [EXAMPLE], NoRole, fmt, Budgets(2, 32, 500), n=2)
    assert not steppers[0].busy()        # trajectory 1's request did not stay in the engine


def ran_in_a_fresh_interpreter(test_name: str) -> bool:
    """Run one test in its own pytest process (and say whether it was). An in-process vLLM
    engine sets up torch.distributed and tears it down again when it goes: a DeepSpeed engine
    that an earlier test built in this process (test_critic) keeps groups that then no longer
    exist, and the next one built here (test_update) fails with "Group ... is not registered".
    The product never shares a process between the two: engines and trainers are Ray actors."""
    import os
    import subprocess
    if os.environ.get("TURNRL_TEST_ISOLATED"):
        return False
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-m", "slow",
                           f"{__file__}::{test_name}"], env={**os.environ, "TURNRL_TEST_ISOLATED": "1"},
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-2000:]
    return True


class GoOn:
    """Every turn ends at a digit and is answered "go on" until the third: turns of different
    lengths, so on a real engine trajectories reach each turn at different steps."""
    system_prompt, stop, observation_role = "Count.", tuple("0123456789"), "tool"

    def reset(self, example):
        self.turns = 0
        return example["prompt"]

    def step(self, text):
        from turnrl.envs.base import StepResult
        self.turns += 1
        done = self.turns == 3
        return StepResult(None if done else "go on", 0.0, done, {"reason": "answer"} if done else {})


@pytest.mark.slow
def test_vllm_rollouts_batch_across_turns_and_repeat_for_the_same_seed(tiny_model_dir, fmt):
    """The real vLLM engine stepped by the loop: turns of different lengths join and leave the
    running batch; the same torch seed gives the same trajectories, token for token. The engine
    starts after the search environment's index library (bm25s, which loads numba) was
    imported, which broke vLLM's engine start before `_answer_dict_for_llvmlite`."""
    if ran_in_a_fresh_interpreter("test_vllm_rollouts_batch_across_turns_and_repeat_for_the_same_seed"):
        return
    import torch
    import turnrl.envs.search  # noqa: F401
    from turnrl.rollout.engines import CPU_KV_BLOCK_SIZE, VLLMEngine
    assert "llvmlite.binding.ffi" in sys.modules
    engine = VLLMEngine(str(tiny_model_dir), max_model_len=512, seed=0)
    examples = [{"prompt": f"Compute {a} + {a}.", "answer": str(2 * a)} for a in range(4)]
    runs = []
    for _ in range(2):
        # an empty cache for each, as every training step starts with (a push drops it): keys and values
        # served from the cache the first run left would differ from recomputed ones in the last bits
        assert engine.llm.reset_prefix_cache()
        torch.manual_seed(7)
        runs.append(run_rollouts(engine, examples, GoOn, fmt, Budgets(3, 64, 400), n=4, observation_lag=2))
    first, second = runs
    assert [t.response_ids for t in first] == [t.response_ids for t in second]
    assert [t.engine_logprobs for t in first] == [t.engine_logprobs for t in second]
    went_on = [t for t in first if t.num_turns > 1]       # the rest ran out of tokens in turn 1
    assert len(went_on) >= 4 and all(t.observations[0] == "go on" for t in went_on)
    assert all(t.num_turns == 3 for t in first if t.finish == "answer")
    assert len({len(t.turn_texts[0]) for t in went_on}) > 1        # turns of different lengths
    for t in first:
        check_token_in_token_out(t, fmt)
        # every turn's request sent the conversation so far: what it prefilled and what the cache served
        firsts = [next(j for j, (k, m) in enumerate(zip(t.turn_ids, t.loss_mask)) if k == turn and m)
                  for turn in range(t.num_turns)]
        assert t.prefill_tokens + t.cached_tokens == sum(len(t.prompt_ids) + j for j in firsts)
        # prefix caching: turn k reuses every full block (CPU_KV_BLOCK_SIZE tokens) of what turn k - 1
        # computed, its prompt and its sampled tokens but the last (whose keys turn k computes)
        computed = [len(t.prompt_ids) + firsts[k] + sum(m for k2, m in zip(t.turn_ids, t.loss_mask) if k2 == k) - 1
                    for k in range(t.num_turns - 1)]
        assert t.cached_tokens >= sum(CPU_KV_BLOCK_SIZE * (c // CPU_KV_BLOCK_SIZE) for c in computed)
    from turnrl.training.loop import rollout_metrics
    metrics = rollout_metrics(first, 4)
    assert sum(t.cached_tokens for t in first) > 0 and 0 < metrics["prefix_cache_hit_rate"] < 1
    assert metrics["prefill_tokens_mean"] == sum(t.prefill_tokens for t in first) / len(first)


@pytest.mark.slow
def test_the_vllm_stepper_stops_where_vllm_itself_stops(tiny_model_dir):
    """Stop strings checked by the stepper on each step's tokens give the same tokens, logprobs
    and finish reasons as vLLM's own stop handling (greedy, so sampling noise plays no part)."""
    if ran_in_a_fresh_interpreter("test_the_vllm_stepper_stops_where_vllm_itself_stops"):
        return
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from turnrl.rollout.engines import VLLMEngine
    engine = VLLMEngine(str(tiny_model_dir), max_model_len=512, seed=0)
    prompts = [[1] + list(range(10 + k, 40 + 3 * k)) for k in range(12)]
    limits = [6, 40] * 6

    def vllm_generate(stop):
        return engine.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts],
            [SamplingParams(temperature=0.0, max_tokens=m, stop=stop, include_stop_str_in_output=True, logprobs=0)
             for m in limits], use_tqdm=False)

    # stop strings that occur mid-output: a few characters of what greedy decoding writes
    texts = [out.outputs[0].text for out in vllm_generate([])]
    short = sorted({t[4:6] for t in texts if len(t) > 8})[:3]
    longer = sorted({t[10:16] for t in texts if len(t) > 20})[:2]
    for stop in (short, longer + ["</code>"], []):
        ours = engine.generate(prompts, max_tokens=limits, stop=stop, temperature=0.0, top_p=1.0,
                               seeds=[None] * len(prompts))
        theirs = vllm_generate(stop)
        for sample, out in zip(ours, theirs):
            c = out.outputs[0]
            assert sample.token_ids == list(c.token_ids), stop
            assert sample.finish == ("length" if c.finish_reason == "length" else "stop"), stop
            assert sample.logprobs == pytest.approx([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
                                                    abs=1e-5)
        if stop:
            assert {s.finish for s in ours} == {"stop", "length"}, stop     # both kinds of ending seen


@pytest.mark.slow
def test_a_weight_push_mid_turn_samples_the_rest_from_the_new_weights_only(tiny_model_dir):
    """Asynchronous training pushes weights while turns decode (partial rollout). The tokens
    sampled after the push, by requests that were running and by a new request whose prompt the
    engine has cached, have exactly the logprobs the new weights give the same sequences: no
    keys or values of the older weights are left (vLLM's plain reset leaves them while requests
    run: up to 0.79 nats off here). The tokens from before the push keep their logprobs, and every
    request still gets all its tokens (or ends at an end of sequence)."""
    if ran_in_a_fresh_interpreter("test_a_weight_push_mid_turn_samples_the_rest_from_the_new_weights_only"):
        return
    import torch
    from transformers import AutoModelForCausalLM
    from turnrl.rollout.engines import VLLMEngine
    engine = VLLMEngine(str(tiny_model_dir), max_model_len=512, seed=0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.manual_seed(1)
    pushed = {name: p.detach() + 0.05 * torch.randn_like(p) for name, p in model.named_parameters()}
    prompts = [[1] + [5 + k, 9, 12, 30 + k] * 20 for k in range(4)]
    stepper = engine.stepper(stop=[], temperature=1.0, top_p=1.0)
    for key, prompt in enumerate(prompts):
        stepper.add(key, prompt, 60, None)
    done = {}
    for _ in range(20):
        done.update(stepper.step())
    assert not done
    at_push = {key: len(ids) for key, ids, *_ in stepper.running.values()}
    before = {key: list(logprobs) for key, _, logprobs, *_ in stepper.running.values()}
    engine.load_weights(pushed.items())
    stepper.add(4, prompts[0], 30, None)   # cached by request 0 under the older weights
    while stepper.busy():
        done.update(stepper.step())
    for k, limit in enumerate([60] * 4 + [30]):   # all their tokens (or up to an end of sequence)
        assert len(done[k].token_ids) == len(done[k].logprobs) and (done[k].finish == "stop") != \
            (len(done[k].token_ids) == limit)
    scored = engine.prompt_logprobs([prompts[k % 4] + done[k].token_ids for k in range(5)])
    for k in range(5):
        start = at_push.get(k, 0)
        sampled, new_weights = done[k].logprobs[start:], scored[k][len(prompts[k % 4]) + start:]
        assert sampled == pytest.approx(new_weights, abs=1e-4), k
        if k < 4:
            assert done[k].logprobs[:start] == before[k]   # kept as the older weights gave them
            # and they were the older weights': the new ones give them otherwise
            assert max(abs(a - b) for a, b in zip(before[k], scored[k][len(prompts[k]):])) > 0.05


@pytest.mark.parametrize("rejoin, is_async", [("ready", False), ("ready", True), ("lag", False)])
def test_a_step_past_env_step_timeout_ends_only_its_trajectory(fmt, rejoin, is_async):
    """A user's environment whose step hangs (here: one trajectory's of four sleeps 30 s) ends that
    trajectory env_error after env.step_timeout_s, naming the plugin; the others answer, and the
    rollout does not wait for the hung step."""
    import asyncio
    import threading
    import time
    release = threading.Event()

    class Hangs:
        count = 0

        def __init__(self):
            Hangs.count += 1
            self.hangs = Hangs.count == 2
            self.env = envs.make("code_tool")
            self.system_prompt, self.stop, self.observation_role = (self.env.system_prompt, self.env.stop,
                                                                    self.env.observation_role)

        def reset(self, example):
            return self.env.reset(example)

        def step(self, text):
            if self.hangs:
                release.wait(30)
            return self.env.step(text)

    class AsyncHangs(Hangs):
        async def step(self, text):
            if self.hangs:
                await asyncio.sleep(30)
            return self.env.step(text)

    engine = ScriptedEngine(fmt.tokenizer, ["<answer>56088</answer>"])
    start = time.perf_counter()
    try:
        trajs = run_rollouts(engine, [EXAMPLE], AsyncHangs if is_async else Hangs, fmt,
                             Budgets(3, 32, 500, step_timeout_s=1.0), n=4, rejoin=rejoin)
    finally:
        release.set()
    assert time.perf_counter() - start < 15
    assert [t.finish for t in trajs] == ["answer", "env_error", "answer", "answer"]
    said = trajs[1].info["env_error"]
    assert said.startswith(f"StepTimeout: {__name__}.") and "Hangs.step took longer than env.step_timeout_s = 1 s" \
        in said, said
    assert trajs[1].outcome == 0.0 and all(t.outcome == 1.0 for t in (trajs[0], *trajs[2:]))
