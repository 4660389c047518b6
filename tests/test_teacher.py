"""On-policy distillation's teacher (turnrl.rewards.teacher): logprobs of the policy's sampled
tokens in their full context, from a vLLM-style completions server on loopback; what the opd
algorithm needs from params; a served teacher through the real loop (slow)."""
from __future__ import annotations

import math
import re

import pytest

from turnrl.config import Config
from turnrl.config.loading import check_plugins
from turnrl.config.sections import TeacherCfg
from turnrl.rewards.teacher import Teacher, prompt_logprobs, tokenizer_mismatch, top_logprobs
from turnrl.rollout.multi_turn import Trajectory

from judge_server import TeacherServer


def _trajectory() -> Trajectory:
    t = Trajectory(example={"id": "row-0", "prompt": "q", "answer": "a"}, prompt_ids=[1, 2])
    t.add_turn(0, [10, 20], [-0.3, -0.4], "call")
    t.add_observation(0, [30], "tool says")   # not the policy's: no teacher signal
    t.add_turn(1, [40], [-0.5], "answer")
    return t


def test_the_teacher_scores_every_sampled_token_in_its_full_context():
    server = TeacherServer()
    try:
        t = _trajectory()
        Teacher(TeacherCfg(base_url=server.url)).annotate([t])
    finally:
        server.close()
    # the whole sequence went out (prompt, turns, observation); the policy's tokens keep their logprob
    assert t.teacher_logprobs == pytest.approx([-0.10, -0.20, 0.0, -0.40])
    assert server.requests == 1


def test_top_k_brings_the_teachers_most_likely_tokens_at_each_sampled_position():
    server = TeacherServer()
    try:
        t = _trajectory()
        Teacher(TeacherCfg(base_url=server.url, top_k=2)).annotate([t])
    finally:
        server.close()
    assert t.teacher_logprobs == pytest.approx([-0.10, -0.20, 0.0, -0.40])   # the sampled tokens' as before
    assert t.teacher_top_ids == [[100, 101], [100, 101], [], [100, 101]]     # none at the observation
    assert t.teacher_top_logprobs == [pytest.approx([-0.001, -0.002])] * 2 + [[]] + [pytest.approx([-0.001, -0.002])]


def test_top_logprobs_ranks_by_logprob_and_names_a_server_that_gives_fewer():
    # vLLM's entry: the top k and the prompt's own token (here outside them, less likely)
    entry = {"4": {"logprob": -3.0, "rank": 9}, "8": {"logprob": -0.2, "rank": 2}, "6": {"logprob": -0.1, "rank": 1}}
    body = {"choices": [{"prompt_logprobs": [None, entry]}]}
    assert top_logprobs(body, 2) == [([], []), ([6, 8], [-0.1, -0.2])]
    with pytest.raises(ValueError, match=r"top_k = 4: the teacher's answer has 3 tokens at position 1 .*--max-logprobs 4"):
        top_logprobs(body, 4)


def test_top_k_needs_the_policys_tokenizer():
    with pytest.raises(ValueError, match=r"top_k = 4 with tokenizer = 'other': the teacher's top tokens are ids of "
                                         r"its own vocabulary"):
        TeacherCfg(base_url="http://127.0.0.1:1/v1", top_k=4, tokenizer="other")


def test_a_teacher_that_is_down_or_gives_no_logprobs_is_an_env_error_naming_it_never_a_silent_zero():
    """Retried, then counted like an environment error: the trajectory ends env_error naming the
    teacher and why, and nothing of it is trained on (the loop stops past env.max_error_fraction)."""
    from turnrl.training.loop import env_errors
    for mode, why in (("down", "HTTP 503"), ("bare", "no prompt_logprobs for every token")):
        server = TeacherServer(mode)
        try:
            t = _trajectory()
            Teacher(TeacherCfg(base_url=server.url, retries=1)).annotate([t])
        finally:
            server.close()
        assert server.requests == (2 if mode == "down" else 1)   # a 503 is retried, a bare answer is final
        assert t.finish == "env_error" and re.search(f"reward.teacher .* gave no logprobs .*'row-0'.*{why}",
                                                      t.info["env_error"])
        assert t.loss_mask == [0, 0, 0, 0] and t.teacher_logprobs == [0.0] * 4
        assert env_errors([t]) == (1.0, f"{t.info['env_error']} (row 'row-0')")


def test_prompt_logprobs_reads_each_tokens_entry_by_id():
    body = {"choices": [{"prompt_logprobs": [None, {"7": {"logprob": -1.5}, "9": {"logprob": -0.1}},
                                             {"8": {"logprob": -2.0}}]}]}
    assert prompt_logprobs(body, [5, 7, 8]) == [0.0, -1.5, -2.0]
    with pytest.raises(ValueError, match="no logprob for token 8 at position 2"):
        prompt_logprobs({"choices": [{"prompt_logprobs": [None, {"7": {"logprob": -1.5}}, {"6": {"logprob": -1}}]}]},
                        [5, 7, 8])


def test_opd_without_a_teacher_is_refused_when_params_are_checked():
    cfg = Config.model_validate({"algorithm": {"name": "opd"}})
    assert any("reward.teacher.serve" in p for p in check_plugins(cfg))
    with_teacher = Config.model_validate({"algorithm": {"name": "opd"},
                                          "reward": {"teacher": {"base_url": "http://t:8000/v1"}}})
    assert not any("teacher" in p for p in check_plugins(with_teacher))
    both = {"algorithm": {"name": "opd", "dynamic_sampling": {"enabled": True}},
            "reward": {"teacher": {"base_url": "http://t:8000/v1"}}}
    assert any("turn dynamic sampling off" in p for p in check_plugins(Config.model_validate(both)))
    with pytest.raises(ValueError, match="not both"):
        TeacherCfg(base_url="http://t/v1", serve="some/model")
    with pytest.raises(ValueError, match="base_url = 'notaurl': an http:// or https:// address"):
        TeacherCfg(base_url="notaurl")
    with pytest.raises(ValueError, match="tokenizer = '/nonexistent/tok': no such folder"):
        TeacherCfg(base_url="http://t/v1", tokenizer="/nonexistent/tok")
    assert TeacherCfg(serve="Qwen/Qwen3-8B").serve == "Qwen/Qwen3-8B"   # a hub id is not a folder to check


def test_a_teacher_the_algorithm_does_not_learn_from_is_left_out_and_a_served_context_fits_the_checkpoint(
        tmp_path, caplog):
    """reward.teacher left in params with algorithm grpo: neither served nor asked (said once). A served
    model's max_model_len above the checkpoint's positions (the tiny model's 2048 against the default
    4096: vLLM would not start) is served with the checkpoint's."""
    import json
    from turnrl.training.loop import without_unused_teacher
    from turnrl.training.served_models import context_length
    teacher = {"teacher": {"base_url": "http://t:8000/v1"}}
    grpo = Config.model_validate({"algorithm": {"name": "grpo"}, "reward": teacher})
    with caplog.at_level("WARNING"):
        assert not without_unused_teacher(grpo).reward.teacher.enabled and grpo.reward.teacher.enabled
    assert "algorithm.name = grpo learns from no teacher: it is not served nor asked" in caplog.text
    opd = Config.model_validate({"algorithm": {"name": "opd"}, "reward": teacher})
    assert without_unused_teacher(opd) is opd
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    assert context_length(str(tmp_path), 4096, "reward.teacher") == 2048
    assert context_length(str(tmp_path), 1024, "reward.teacher") == 1024
    assert context_length("Qwen/Qwen3-8B", 4096, "reward.teacher") == 4096   # a hub id: vLLM decides


def test_a_teacher_with_another_tokenizer_is_named(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer
    assert tokenizer_mismatch(str(tiny_model_dir), str(tiny_model_dir)) is None
    other = AutoTokenizer.from_pretrained(tiny_model_dir)
    other.add_tokens(["<extra_token_a>", "<extra_token_b>"])
    other.save_pretrained(tmp_path / "other")
    assert "differs from the policy's" in tokenizer_mismatch(str(tmp_path / "other"), str(tiny_model_dir))


@pytest.mark.slow
def test_opd_learns_from_a_teacher_turnrl_serves_beside_a_served_judge(tiny_model_dir, tmp_path, monkeypatch):
    """reward.teacher.serve and reward.judges[*].serve: two checkpoints behind vLLM's OpenAI
    server, each in a Ray actor of its own; opd trains on the teacher's logprobs and its top 4
    (reward.teacher.top_k). The teacher is the policy's own start, so at step 1 the per-token
    signal is only the engines' numerics."""
    import subprocess

    import turnrl.training.loop as loop
    from conftest import train_two_steps
    checked = []   # the served teacher's tokenizer, checked by its /tokenize once it answered
    real_check = loop.check_teacher_server

    def check(cfg, student_dir):
        checked.append((cfg.base_url, real_check(cfg, student_dir)))
        return checked[-1][1]
    monkeypatch.setattr(loop, "check_teacher_server", check)
    history = train_two_steps(tiny_model_dir, tmp_path, {"name": "code_tool"}, {"name": "opd"}, reward={
        "on_error": "zero",
        "teacher": {"serve": str(tiny_model_dir), "max_model_len": 1024, "top_k": 4},
        "judges": [{"name": "served", "serve": str(tiny_model_dir), "max_model_len": 1024, "max_tokens": 8,
                    "score": "labels", "labels": {"answer": 1.0, "code": 0.0, "output": 0.5},
                    "template": "Question: {question}\nResponse: {response}"}]})
    assert len(history) == 2
    assert len(checked) == 1 and checked[0][0].startswith("http") and checked[0][1] == (None, None)   # same ids
    assert history[0]["advantage_abs_mean"] < 0.01   # the same weights: log pi_T - log pi ~ 0
    # top_k 4 through the real server: at step 1 (the teacher's own weights) the KL to its top 4,
    # renormalised, is -log(the policy's mass on them): above 0, and at most log(V / 4), a flat
    # distribution's (the fixture's model is untrained). The positions' alignment is tested by
    # hand (test_algos_advantages, test_gateway_samples); this is vLLM's answer read end to end
    from transformers import AutoConfig
    flat = math.log(AutoConfig.from_pretrained(tiny_model_dir).vocab_size / 4)
    assert 0.0 < history[0]["top_k_kl"] <= flat + 1e-3, (history[0]["top_k_kl"], flat)
    assert math.isfinite(history[1]["top_k_kl"]) and history[1]["top_k_kl"] > 0
    for h in history:
        assert h["judge_served_calls"] > 0 and h["judge_served_failures"] == 0   # the judge answered every call
        assert 0.0 <= h["reward_served_mean"] <= 1.0
    left = subprocess.run(["pgrep", "-f", f"api_server --model {tiny_model_dir}"], capture_output=True, text=True)
    assert not left.stdout.strip(), "a served model outlived the run"


@pytest.mark.slow
def test_opd_from_a_teacher_of_another_chat_format_reads_it_in_its_own_template(tiny_model_dir, tmp_path):
    """reward.teacher.chat_template = teacher, end to end: a Llama-format miniature (its own
    tokenizer and chat template, untrained) served by vLLM scores the tiny policy's turns inside
    its own rendering of each conversation, mapped back through the text; no trajectory fails."""
    from conftest import train_two_steps

    from turnrl.models import miniatures
    teacher = miniatures.build("llama", tmp_path / "teacher", warmstart_steps=0)
    history = train_two_steps(tiny_model_dir, tmp_path, {"name": "code_tool"}, {"name": "opd"}, reward={
        "teacher": {"serve": str(teacher), "tokenizer": str(teacher), "chat_template": "teacher",
                    "max_model_len": 1024}})
    assert len(history) == 2
    for h in history:
        assert h.get("finish_env_error_frac", 0.0) == 0.0
        # the untrained policy samples any token, its special ones too (no signal: Llama's vocabulary
        # has none of them), and bytes that are no UTF-8; the rest map, a third one to one
        assert 0.0 < h["teacher_exact_frac"] and h["teacher_exact_frac"] + h["teacher_unreadable_frac"] <= 1.0
        assert h["advantage_abs_mean"] > 0.1   # another model: log pi_T - log pi is far from 0
