"""LLM judges (reward.judges) against a real judge server on loopback (Starlette on uvicorn,
scripted answers, latency, failures): scores, parse failures, timeouts, retries, the bound on
requests in flight, and a batch's identical prompts asked once."""
from __future__ import annotations

import re
import socket
import time

import pytest

from turnrl.config import Config
from turnrl.config.sections import JudgeCfg
from turnrl.rewards.functions import RewardFunctionError, from_config
from turnrl.rewards.judge import Judge, check_rows, judge_metrics, parse_score
from turnrl.rollout.multi_turn import Trajectory

from judge_server import JudgeServer, ReferenceJudge


def _cfg(**kw) -> JudgeCfg:
    return JudgeCfg.model_validate({"base_url": "http://127.0.0.1:1/v1", "template": "{response}", **kw})


@pytest.mark.parametrize("score, answer, expected", [
    ({"range": [0, 10]}, "Reasoning... 3 points, so the score is 7", 0.7),
    ({"range": [1, 5]}, "5", 1.0),
    ({"score": "json:score", "range": [0, 1]}, 'Here: {"score": 0.25, "why": "x"}', 0.25),
    ({"score": "labels", "labels": {"correct": 1, "incorrect": 0}}, "INCORRECT, because", 0.0),
    ({"score": "labels", "labels": {"correct": 1, "incorrect": 0}}, "Correct.", 1.0),
])
def test_the_answer_becomes_a_score_in_0_1(score, answer, expected):
    assert parse_score(answer, _cfg(**score)) == pytest.approx(expected)


@pytest.mark.parametrize("score, answer, expected", [
    ({"range": [0, 10]}, "I'd rate it 8/10", 0.8),                            # not 10, the scale's top
    ({"range": [0, 10]}, "Score: 7 out of 10", 0.7),
    ({"range": [0, 10]}, "Score: 6\n(checked in 3 steps)", 0.6),              # the score, not the last number
    ({"range": [0, 10]}, "Score: 7.5e0", 0.75),
    ({"range": [0, 10]}, "It is 4/5.", 0.8),                                  # another scale, mapped onto range
    ({"range": [0, 10]}, "The answer 1/2 is right. Score: 9", 0.9),
    ({"range": [1, 5]}, "Rating: 4", 0.75),
    ({"score": "labels", "labels": {"yes": 1, "no": 0}}, "The answer is not wrong, so: yes", 1.0),   # not "no" in not
    ({"score": "labels", "labels": {"yes": 1, "no": 0}}, "I don't know the reference, but yes", 1.0),
    ({"score": "labels", "labels": {"good": 10, "bad": 0}, "range": [0, 10]}, "Bad.", 0.0),
])
def test_a_judge_s_common_answers_read_as_it_meant_them(score, answer, expected):
    assert parse_score(answer, _cfg(**score)) == pytest.approx(expected)


@pytest.mark.parametrize("score, answer, why", [
    ({"range": [0, 10]}, "no idea", "no number"),
    ({"range": [0, 10]}, "11", "outside range"),
    ({"score": "json:score"}, '{"grade": 1}', "JSON field 'score'"),
    ({"score": "labels", "labels": {"yes": 1}}, "maybe", "none of the labels"),
])
def test_an_answer_without_a_score_is_a_parse_failure_saying_why(score, answer, why):
    with pytest.raises(ValueError, match=why):
        parse_score(answer, _cfg(**score))


@pytest.mark.parametrize("changes, said", [
    ({"template": "Rate {}: {response}"}, "a positional field {}"),
    ({"template": "Rate {response"}, "expected '}' before end of string; write {{ and }} for a literal brace"),
    ({"template": 'Reply as JSON {"score": N} for {response}'}, "is not a field name; write {{ and }}"),
    ({"score": "labels", "labels": {"yes": 5, "no": -3}}, "outside range [0.0, 1.0]"),
    ({"base_url": "judge-host:8000/v1"}, "an http:// or https:// address"),
])
def test_a_judge_config_that_cannot_work_is_refused_with_the_fix(changes, said):
    with pytest.raises(ValueError, match=re.escape(said)):
        _cfg(**changes)
    assert _cfg(template='Reply as JSON {{"score": N}} for {response}').template   # doubled braces are literal


def test_a_template_field_the_rows_lack_is_named_before_any_work():
    judge = _cfg(template="{question} {rubric}")
    check_rows([judge], [{"id": "a", "prompt": "q", "rubric": "r"}], "the training rows")
    with pytest.raises(ValueError, match=r"reward.judges\[0\] \(judge\): the template uses \{rubric\}, and row 1 "
                                         r"of the training rows \(id 'b'\) has no field 'rubric'"):
        check_rows([judge], [{"id": "a", "rubric": "r"}, {"id": "b", "prompt": "q"}], "the training rows")
    with pytest.raises(ValueError, match="score = labels needs"):
        _cfg(score="labels")


@pytest.fixture
def server():
    s = JudgeServer()
    yield s
    s.server.should_exit = True
    s.thread.join(timeout=5)


def _trajs(*responses: str) -> list[Trajectory]:
    out = []
    for k, text in enumerate(responses):
        t = Trajectory(example={"id": f"row-{k}", "prompt": "q", "answer": "a"}, prompt_ids=[1])
        t.add_turn(0, [2], [0.0], text)
        t.outcome, t.finish = 0.0, "answer"
        out.append(t)
    return out


def test_scores_retries_timeouts_and_parse_failures_against_a_real_server(server):
    judge = Judge(_cfg(base_url=server.url, range=[0, 10], timeout_s=1.0, retries=1))
    trajs = _trajs("score 7", "flaky 8", "babble", "slow 9", "score 11")
    out = judge.score_batch(trajs, decode=lambda ids: "")
    assert out[0] == pytest.approx(0.7) and out[1] == pytest.approx(0.8)
    assert server.requests["flaky 8"] == 2 and trajs[1].info["judge_judge"][0]["tries"] == 2   # 503, then retried
    assert "unparsable: no number" in str(out[2]) and server.requests["babble"] == 1      # not retried
    assert "no answer within timeout_s = 1 s" in str(out[3]) and server.requests["slow 9"] == 2
    assert "outside range" in str(out[4])
    assert trajs[0].info["judge_judge"][0]["answer"] == "Score: 7" and trajs[0].info["judge_judge"][0]["seconds"] > 0
    metrics = judge_metrics(trajs)   # the step's view of these five calls
    assert metrics["judge_judge_calls"] == 5 and metrics["judge_judge_retries"] == 2   # flaky and slow retried once
    assert metrics["judge_judge_unparsable"] == 2 and metrics["judge_judge_failures"] == 1   # babble, 11; slow
    assert 2.0 <= metrics["judge_judge_latency_p99_s"] and metrics["judge_judge_latency_p50_s"] < 1.0


def test_latency_quantiles_and_cache_share_by_hand():
    def traj(*calls):
        t = _trajs("x")[0]
        t.info["judge_j"] = [{"prompt": "p", "answer": "", "score": s, "seconds": sec, "tries": 1, "cached": c,
                              "unparsable": False} for s, sec, c in calls]
        return t
    trajs = [traj((1.0, 1.0, False)), traj((0.0, 2.0, False)), traj((0.5, 3.0, False)), traj((None, 5.0, False)),
             traj((1.0, 0.0, True))]
    metrics = judge_metrics(trajs)
    assert metrics["judge_j_calls"] == 4 and metrics["judge_j_cached_frac"] == pytest.approx(0.2)
    assert metrics["judge_j_latency_p50_s"] == pytest.approx(2.5)          # between 2 and 3
    assert metrics["judge_j_latency_p99_s"] == pytest.approx(3 + 0.97 * 2)  # 99% of the way from 3 to 5
    assert metrics["judge_j_failures"] == 1 and metrics["judge_j_unparsable"] == 0


def test_scope_turn_asks_every_turn_and_adds_its_score_to_that_turns_reward(server):
    judge = Judge(_cfg(base_url=server.url, range=[0, 10], scope="turn", weight=2.0,
                       template="{history} || {turn} || {response}"))   # the server answers its last number
    t = Trajectory(example={"id": "row", "prompt": "q", "answer": "a"}, prompt_ids=[1])
    t.add_turn(0, [2], [0.0], "score 2")
    t.add_observation(0, [3], "tool said 4")
    t.add_turn(1, [4], [0.0], "score 8")
    t.turn_rewards = [0.0, 1.0]
    (out,) = judge.score_batch([t], decode=lambda ids: "")
    assert out == pytest.approx(0.5)                       # the mean of 0.2 and 0.8
    assert t.turn_rewards == pytest.approx([0.4, 2.6])     # + weight x each turn's score
    first, second = t.info["judge_judge"]
    assert first["prompt"] == " || 1 || score 2" and first["turn"] == 1
    assert second["prompt"] == "score 2\ntool said 4 || 2 || score 8" and second["score"] == pytest.approx(0.8)
    from turnrl.tracking import traces
    names = [s.name for s in traces.plan(t, name="r", tags={}).spans()]
    assert "judge judge turn 1" in names and "judge judge turn 2" in names

    broken = Trajectory(example={"id": "b", "prompt": "q", "answer": "a"}, prompt_ids=[1])
    broken.add_turn(0, [2], [0.0], "score 3")
    broken.add_turn(1, [2], [0.0], "babble")
    broken.turn_rewards = [0.0, 0.0]
    judge = Judge(_cfg(base_url=server.url, range=[0, 10], scope="turn", weight=2.0))
    (out,) = judge.score_batch([broken], decode=lambda ids: "")
    assert "unparsable" in str(out) and broken.turn_rewards == pytest.approx([0.6, 0.0])   # the scored turn kept


def test_requests_in_flight_never_exceed_max_concurrency_and_a_batch_asks_a_prompt_once(server):
    server.delay_s = 0.2
    judge = Judge(_cfg(base_url=server.url, range=[0, 10], max_concurrency=3))
    trajs = _trajs(*[f"score {k % 10}" for k in range(12)], "score 5", "score 5")
    out = judge.score_batch(trajs, decode=lambda ids: "")
    assert server.most_in_flight == 3
    fives = [t for t in trajs if t.turn_texts[-1] == "score 5"]   # rows 5, 12 and 13
    assert server.requests["score 5"] == 1 and [t.info["judge_judge"][0]["cached"] for t in fives] == [False, True, True]
    assert out[-1] == out[-2] == pytest.approx(0.5)


def test_batches_scored_at_once_from_several_threads_share_max_concurrency(server):
    """The scoring threads (turnrl.rollout.scored) call one judge at once: its bound holds across them."""
    import threading
    server.delay_s = 0.2
    judge = Judge(_cfg(base_url=server.url, range=[0, 10], max_concurrency=3))
    outs = {}

    def score(k):
        outs[k] = judge.score_batch(_trajs(*[f"batch {k}: score {j}" for j in range(6)]), decode=lambda ids: "")
    threads = [threading.Thread(target=score, args=(k,)) for k in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert server.most_in_flight == 3 and sum(server.requests.values()) == 18
    assert all(out == pytest.approx([j / 10 for j in range(6)]) for out in outs.values())


def test_an_identical_prompt_is_asked_once_a_step_across_batches_and_anew_the_next_step(server):
    """Trajectories are scored one by one as they end (turnrl.rollout.scored): a later batch's
    identical prompt waits for the call in flight or reads its answer, without a request of its
    own; new_step (a new policy version) asks again; a failed call is not kept."""
    import threading
    server.delay_s = 0.5
    judge = Judge(_cfg(base_url=server.url, range=[0, 10], retries=0))
    outs = {}

    def score(k):
        outs[k] = judge.score_batch(_trajs("score 7"), decode=lambda ids: "")
    first = threading.Thread(target=score, args=(0,))
    first.start()
    time.sleep(0.2)                      # the first call is in flight
    score(1)
    first.join()
    assert outs == {0: pytest.approx([0.7]), 1: pytest.approx([0.7])} and server.requests["score 7"] == 1
    later = _trajs("score 7")
    assert judge.score_batch(later, decode=lambda ids: "") == pytest.approx([0.7])   # answered: read
    assert server.requests["score 7"] == 1 and later[0].info["judge_judge"][0]["cached"] is True
    assert judge_metrics(later)["judge_judge_calls"] == 0
    judge.new_step()
    assert judge.score_batch(_trajs("score 7"), decode=lambda ids: "") == pytest.approx([0.7])
    assert server.requests["score 7"] == 2
    for _ in range(2):                   # 503 on the first request, no retry: failed, then asked again
        judge.score_batch(_trajs("flaky 4"), decode=lambda ids: "")
    assert server.requests["flaky 4"] == 2
    judge.session.close()


def test_a_judge_sent_to_another_process_opens_its_own_connections_there(server):
    """Ray pickles the rollout actor's reward functions: the session's loop and client stay behind."""
    import pickle
    judge = Judge(_cfg(base_url=server.url, range=[0, 10]))
    assert judge.score_batch(_trajs("score 3"), decode=lambda ids: "") == pytest.approx([0.3])
    copy = pickle.loads(pickle.dumps(judge))
    assert copy.session is not judge.session and copy.session.max_concurrency == judge.cfg.max_concurrency
    assert copy.score_batch(_trajs("score 4"), decode=lambda ids: "") == pytest.approx([0.4])
    judge.session.close()
    copy.session.close()


def test_a_call_still_out_after_hedge_after_gets_a_twin_and_the_first_answer_wins(server):
    """'lagging' answers its first request after 3 s and the second at once: hedged at 0.3 s the
    verdict comes from the twin, well before the first would have."""
    judge = Judge(_cfg(base_url=server.url, range=[0, 10], hedge_after=0.3, timeout_s=10))
    trajs = _trajs("lagging 6", "score 4")
    start = time.perf_counter()
    out = judge.score_batch(trajs, decode=lambda ids: "")
    assert out == pytest.approx([0.6, 0.4]) and time.perf_counter() - start < 2.0
    assert server.requests["lagging 6"] == 2 and server.requests["score 4"] == 1   # a quick call is not hedged
    assert [t.info["judge_judge"][0]["hedged"] for t in trajs] == [True, False]
    assert judge_metrics(trajs)["judge_judge_hedged"] == 1

    unhedged = Judge(_cfg(base_url=server.url, range=[0, 10], timeout_s=10))
    start = time.perf_counter()
    assert unhedged.score_batch(_trajs("lagging 7"), decode=lambda ids: "") == pytest.approx([0.7])
    assert time.perf_counter() - start >= 3.0


def test_hedge_after_a_quantile_waits_for_the_judges_own_latencies():
    from turnrl.rewards.judge import HEDGE_MIN_CALLS
    judge = Judge(_cfg(hedge_after="p90"))
    judge.latencies.extend([1.0] * (HEDGE_MIN_CALLS - 1))
    assert judge.hedge_after_s() is None          # too few answers to know the judge's tail
    judge.latencies.extend([1.0] * 8 + [11.0] * 2)   # 29 at 1 s, 2 at 11 s
    assert judge.hedge_after_s() == pytest.approx(1.0)
    judge.latencies.extend([11.0] * 2)
    assert 1.0 < judge.hedge_after_s() <= 11.0
    assert Judge(_cfg(hedge_after=2.5)).hedge_after_s() == 2.5 and Judge(_cfg()).hedge_after_s() is None


@pytest.mark.parametrize("hedge", ["p5", "fast", -1, 0, True])
def test_a_hedge_after_that_means_nothing_is_refused_naming_the_key(hedge):
    with pytest.raises(ValueError, match="hedge_after"):
        _cfg(hedge_after=hedge)


def test_an_api_key_variable_that_is_not_set_is_refused_before_any_call(monkeypatch):
    monkeypatch.delenv("TURNRL_TEST_JUDGE_KEY", raising=False)
    with pytest.raises(ValueError, match=r"reward.judges\[0\] \(q\): api_key_env names TURNRL_TEST_JUDGE_KEY"):
        Judge(_cfg(api_key_env="TURNRL_TEST_JUDGE_KEY"), key="reward.judges[0] (q)")
    monkeypatch.setenv("TURNRL_TEST_JUDGE_KEY", "sk-test")
    assert Judge(_cfg(api_key_env="TURNRL_TEST_JUDGE_KEY")).session.headers == {"Authorization": "Bearer sk-test"}
    assert Judge(_cfg()).session.headers == {}


def test_a_run_whose_judge_key_is_not_set_stops_before_any_work(monkeypatch, tmp_path):
    from turnrl.config import ConfigError
    from turnrl.training.loop import train
    monkeypatch.delenv("TURNRL_TEST_JUDGE_KEY", raising=False)
    cfg = Config.model_validate({"reward": {"judges": [{"name": "q", "base_url": "http://127.0.0.1:1/v1",
                                                        "template": "{response}", "api_key_env": "TURNRL_TEST_JUDGE_KEY"}]}})
    with pytest.raises(ConfigError, match=r"reward.judges\[0\] \(q\): api_key_env names TURNRL_TEST_JUDGE_KEY"):
        train(cfg, "no-model-read-yet", "no-data", [{"id": "r0", "prompt": "q", "answer": "a"}], str(tmp_path / "out"))


def test_a_judge_is_a_weighted_reward_whose_failures_follow_on_error(server):
    cfg = Config.model_validate({"reward": {"on_error": "zero", "judges": [
        {"name": "quality", "base_url": server.url, "template": "{response}", "range": [0, 10], "weight": 0.5}]}})
    scorer = from_config(cfg.reward, cfg.rollout)
    good, bad = _trajs("score 10", "babble")
    scorer.score([good, bad], decode=lambda ids: "")
    assert good.rewards == {"quality": 1.0} and good.reward == pytest.approx(0.5)
    assert bad.rewards == {"quality": 0.0, "quality_errors": 1.0} and bad.reward == 0.0
    failing = from_config(cfg.reward.model_copy(update={"on_error": "fail"}), cfg.rollout)
    with pytest.raises(RewardFunctionError, match=r"reward.judges\[0\] \(quality\) raised JudgeError: .*unparsable"):
        failing.score(_trajs("babble"), decode=lambda ids: "")
    assert not from_config(cfg.reward, cfg.rollout, judges=False)   # evaluation asks no judge

    from turnrl.tracking import traces
    span = [s for s in traces.plan(good, name="r", tags={}).spans() if s.name == "judge quality"][0]
    assert span.inputs == {"prompt": "score 10"} and span.outputs == {"answer": "Score: 10", "score": 1.0}


def test_a_judge_that_is_down_is_a_counted_failure_not_a_hang():
    with socket.socket() as s:   # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    judge = Judge(_cfg(base_url=f"http://127.0.0.1:{port}/v1", retries=1))
    start = time.perf_counter()
    (out,) = judge.score_batch(_trajs("score 1"), decode=lambda ids: "")
    assert "could not reach it" in str(out) and time.perf_counter() - start < 10


@pytest.mark.slow
@pytest.mark.long   # covered in CI by test_teacher's served judge (sync) and test_agent_pipeline's (async)
def test_a_judge_rewards_two_steps_through_the_real_loop(tiny_model_dir, tmp_path):
    """The rollout actors (Ray) ask the judge for every trajectory of both steps."""
    from conftest import train_two_steps
    judge = ReferenceJudge()
    try:
        history = train_two_steps(tiny_model_dir, tmp_path, {"name": "code_tool"}, {"name": "grpo"}, reward={
            "judges": [{"name": "judge", "base_url": judge.url, "range": [0, 10],
                        "template": "Reference: {reference}\nAnswer: {transcript}"}]})
    finally:
        judge.server.should_exit = True
    assert judge.calls >= len(history)   # every step's batch (identical prompts within one are asked once)
    for h in history:
        assert 0.0 <= h["reward_judge_mean"] <= 1.0 and h["judge_judge_latency_p50_s"] > 0.0
        assert "reward_judge_errors_mean" not in h


def test_outcome_weight_zero_makes_the_judge_the_whole_reward(server):
    cfg = Config.model_validate({"reward": {"outcome_weight": 0.0, "judges": [
        {"name": "quality", "base_url": server.url, "template": "{response}", "range": [0, 10]}]}})
    scorer = from_config(cfg.reward, cfg.rollout)
    right, wrong = _trajs("score 2", "score 9")
    right.outcome = 1.0   # the environment says right; the judge thinks little of it
    scorer.score([right, wrong], decode=lambda ids: "")
    assert right.reward == pytest.approx(0.2) and wrong.reward == pytest.approx(0.9)
    assert right.outcome == 1.0   # still there for the metrics and evaluation
    half = Config.model_validate({"reward": {"outcome_weight": 0.5}})
    assert from_config(half.reward, half.rollout)   # a scorer, with no function: it weights the outcome
    with pytest.raises(ValueError, match="every reward\nwould be 0|every reward would be 0"):
        Config.model_validate({"reward": {"outcome_weight": 0.0}})


def test_scope_group_asks_once_per_group_and_gives_each_response_its_score():
    """RULER-style: the judge sees the group's responses together and answers a JSON list."""
    import json
    import re
    from judge_server import answer, serve
    calls = []

    async def chat(request):
        prompt = (await request.json())["messages"][0]["content"]
        calls.append(prompt)
        scores = [int(v) for v in re.findall(r"Response \d+:\nscore (\d+)", prompt)]
        if "short" in prompt:
            scores = scores[:-1]   # one score missing: unparsable
        return answer("Ranking done. " + json.dumps({"scores": scores}))
    server, thread, url = serve(chat)
    try:
        judge = Judge(_cfg(base_url=url, range=[0, 10], scope="group", score="json:scores",
                           template="{question} ({count}):\n{responses}"))
        first, second = {"id": "a", "prompt": "q1", "answer": "x"}, {"id": "b", "prompt": "q2 short", "answer": "y"}
        trajs = []
        for example, texts in ((first, ["score 2", "score 9", "score 5"]), (second, ["score 1", "score 3"])):
            for text in texts:
                t = Trajectory(example=example, prompt_ids=[1])
                t.add_turn(0, [2], [0.0], text)
                trajs.append(t)
        out = judge.score_batch(trajs, decode=lambda ids: "")
    finally:
        server.should_exit = True
        thread.join(timeout=5)
    assert len(calls) == 2 and sorted(calls)[0] == "q1 (3):\nResponse 1:\nscore 2\n\nResponse 2:\nscore 9\n\nResponse 3:\nscore 5"
    assert out[:3] == pytest.approx([0.2, 0.9, 0.5])
    assert all("no list of 2 scores" in str(o) for o in out[3:])
    metrics = judge_metrics(trajs)
    assert metrics["judge_judge_calls"] == 2 and metrics["judge_judge_unparsable"] == 1   # a group's call once
    assert trajs[1].info["judge_judge"][0]["group_index"] == 2
    with pytest.raises(ValueError, match="scope = group needs score = json"):
        _cfg(scope="group", template="{responses}")
    with pytest.raises(ValueError, match="must show the group's"):
        _cfg(scope="group", score="json:scores")



def test_turnrl_config_names_an_unset_key_and_a_template_field_no_row_has(monkeypatch, tmp_path):
    """What `turnrl config` reads (parse_config, then the checks against the data's first rows): an
    unset api_key_env is its one line (it was a traceback); {respones} is named against the rows."""
    from turnrl.config import ConfigError, parse_config
    from turnrl.config.checks import all_problems
    monkeypatch.delenv("TURNRL_TEST_JUDGE_KEY", raising=False)
    judge = {"name": "q", "base_url": "http://127.0.0.1:1/v1", "template": "{response}"}
    with pytest.raises(ConfigError, match=r"reward.judges\[0\] \(q\): api_key_env names TURNRL_TEST_JUDGE_KEY"):
        parse_config({"reward": {"judges": [{**judge, "api_key_env": "TURNRL_TEST_JUDGE_KEY"}]}})
    typo = Config.model_validate({"reward": {"judges": [{**judge, "template": "{question}: {respones}"}]}})
    problems = [p for p in all_problems(typo) if "reward.judges" in p]
    assert len(problems) == 1 and problems[0].startswith(
        "reward.judges[0] (q): the template uses {respones}, and row 0 of the first rows of synthetic")
    mine = tmp_path / "rows.jsonl"
    mine.write_text('{"problem": "1+1?", "answer": "2", "rubric": "exact"}\n')
    ok = Config.model_validate({"data": {"train_set": str(mine), "heldout_set": str(mine)},
                                "reward": {"judges": [{**judge, "template": "{rubric} {question} {response}"}]}})
    assert not [p for p in all_problems(ok) if "reward.judges" in p]
