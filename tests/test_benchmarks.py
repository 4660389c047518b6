"""The benchmark harness (benchmarks/): argument checks, the plan's "same work" guarantee, the
result-shaping functions, the chat/response templates the TRL peer relies on, and (slow) a
tiny end-to-end `--quick` run."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import results as R  # noqa: E402
from benchmarks.models import RESPONSE_TEMPLATE, TOOL_CHAT_TEMPLATE, ModelSpec, scripted_turns  # noqa: E402
from benchmarks.run import assemble, auto_threads, parse_args, plan  # noqa: E402

WORK_KEYS = ("prompts", "group", "max_tokens", "max_total", "turns", "steps", "warmup", "lr", "beta", "seed",
             "threads", "model")


# --------------------------------------------------------------------------- arguments and plan
def test_quick_runs_the_headline_pairs_and_parts():
    args = parse_args(["--quick"])
    assert args.suites == ["grpo", "tool", "parts"]
    assert (args.steps, args.warmup) == (4, 1)
    names = [c["name"] for c in plan(args)]
    assert names == ["grpo/turnrl-vllm", "grpo/turnrl-vllm-overlap", "grpo/trl-hf", "grpo/trl-vllm",
                     "tool/turnrl-vllm", "tool/turnrl-vllm-overlap", "tool/trl-hf", "tool/trl-vllm", "parts/grpo"]
    assert [c.get("overlap", False) for c in plan(args)] == [False, True, False, False, False, True, False, False, False]
    assert [c["name"] for c in plan(parse_args(["--quick", "--only", "trl-vllm,parts"]))] == \
        ["grpo/trl-vllm", "tool/trl-vllm", "parts/grpo"]
    assert "overlap" not in " ".join(c["name"] for c in plan(parse_args(["--quick", "--no-overlap"])))


def test_threads_follow_the_load_unless_given():
    assert auto_threads(0.3, 2) == 2 and auto_threads(5.0, 2) == 1
    assert parse_args(["--threads", "2"]).threads == 2
    assert parse_args([]).threads in (1, os.cpu_count())


def test_both_frameworks_of_a_pair_get_the_same_work():
    args = parse_args(["--suites", "grpo,tool,engines,large,sweep", "--sweep", "4x4,8x2", "--prompts", "3"])
    cases = plan(args)
    for suite in ("grpo", "tool", "large"):
        members = [c for c in cases if c["suite"] == suite]
        assert {c["kind"] for c in members} == {"loop", "trl"}
        for key in WORK_KEYS:
            assert len({json.dumps(c[key], sort_keys=True) for c in members}) == 1, (suite, key)
    assert {c["engine"] for c in cases if c["suite"] == "grpo" and c["kind"] == "loop"} == {"vllm", "hf"}
    tool = next(c for c in cases if c["name"] == "tool/trl-hf")
    assert tool["turns"] == 3 and tool["model"]["kind"] == "scripted"
    sweep = {(c["prompts"], c["group"]) for c in cases if c["suite"] == "sweep"}
    assert sweep == {(4, 4), (8, 2)}


@pytest.mark.parametrize("argv, message", [
    (["--suites", "grpo,speed"], "unknown speed"),
    (["--group", "1"], "GRPO needs at least 2"),
    (["--max-tokens", "64", "--max-total", "32"], "--max-total (32) must be at least --max-tokens (64)"),
    (["--sweep", "8by4"], "expected PROMPTSxGROUP"),
    (["--rollout-groups", "1,x"], "comma-separated integers"),
    (["--hidden", "500", "--heads", "8"], "multiple of heads"),
    (["--threads", "0"], "--threads = 0"),
    (["--threads", "many"], "--threads = 'many'"),
    (["--trl-engines", "hf,sglang"], "--trl-engines"),
])
def test_bad_arguments_stop_with_the_fix(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


# --------------------------------------------------------------------------- shaping results
def steps_of(values, key="step_s"):
    return [{"step": i + 1, key: v} for i, v in enumerate(values)]


def test_summarize_takes_medians_after_the_warmup():
    steps = [{"step": 1, "step_s": 50.0, "gen_tokens": 10}, {"step": 2, "step_s": 3.0, "gen_tokens": 20},
             {"step": 3, "step_s": 1.0, "gen_tokens": 40}, {"step": 4, "step_s": 2.0, "gen_tokens": 30}]
    out = R.summarize(steps, warmup=1)
    assert out["step_s"] == 2.0 and out["gen_tokens"] == 30 and out["n_steps"] == 3
    assert R.summarize(steps, warmup=0)["step_s"] == 2.5


def test_summarize_refuses_when_no_step_is_left():
    with pytest.raises(ValueError, match="no measured steps"):
        R.summarize(steps_of([1.0, 2.0]), warmup=2)


def test_fit_line_recovers_a_line_and_needs_two_points():
    fit = R.fit_line([16, 32, 64, 128], [1 + 0.05 * x for x in (16, 32, 64, 128)])
    assert fit["slope"] == pytest.approx(0.05) and fit["intercept"] == pytest.approx(1.0)
    assert fit["r2"] == pytest.approx(1.0)
    noisy = R.fit_line([1, 2, 3], [1.0, 3.0, 2.0])
    assert 0 <= noisy["r2"] < 1
    with pytest.raises(ValueError, match="two distinct x"):
        R.fit_line([8, 8], [1.0, 2.0])


def test_overhead_splits_a_loop_step():
    loop = {"step_s": 10.0, "sync_s": 0.5}
    parts = {"generate_s": 3.0, "old_logprobs_s": 1.0, "ref_logprobs_s": 1.0, "update_s": 2.0, "env_s": 1.0,
             "assembly_s": 0.3}
    out = R.overhead(loop, parts)
    assert out["compute_s"] == 7.0 and out["overhead_s"] == pytest.approx(1.5)
    assert out["compute_frac"] + out["env_frac"] + out["sync_frac"] + out["overhead_frac"] == pytest.approx(1.0)
    assert out["non_compute_frac"] == pytest.approx(0.2)
    assert "outside_work_frac" not in out
    timed = R.overhead({**loop, "engine_busy_s": 4.0, "trainer_busy_s": 5.4, "outside_work_s": 0.6}, parts)
    assert timed["outside_work_frac"] == pytest.approx(0.06) and timed["overhead_s"] == out["overhead_s"]


def test_ratio_and_median_ignore_missing_values():
    assert R.ratio(10.0, 2.5) == 4.0
    assert math.isnan(R.ratio(10.0, 0.0))
    assert R.median([3.0, float("nan"), 1.0]) == 2.0
    assert math.isnan(R.median([]))


def test_assemble_pairs_breakdown_sweep_and_headline():
    args = parse_args(["--suites", "grpo,parts,sweep", "--sweep", "2x2,4x4", "--warmup", "1"])
    cases = plan(args)

    def run(step_s, **extra):
        return {"wall_s": 60.0, "peak_rss_mib": 900.0,
                "steps": [{"step": 1, "step_s": 99.0, **extra}] + [{"step": k, "step_s": step_s, **extra}
                                                                     for k in (2, 3, 4)]}
    outcomes = {
        "grpo/turnrl-vllm": run(2.0, sync_s=0.1, gen_tokens=3000.0, trained_tokens=3000.0, train_s=1.0,
                                engine_busy_s=0.9, trainer_busy_s=1.0, outside_work_s=0.1),
        "grpo/turnrl-vllm-overlap": run(1.5, gen_tokens=3000.0),
        "grpo/trl-hf": run(6.0, gen_tokens=3000.0),
        "parts/grpo": run(1.5, generate_s=0.8, env_s=0.0, old_logprobs_s=0.2, ref_logprobs_s=0.2, update_s=0.4),
        "sweep/turnrl-2x2": run(1.0, cpu_s=0.9), "sweep/trl-2x2": run(2.0),
        "sweep/turnrl-4x4": run(1.6, cpu_s=1.14), "sweep/trl-4x4": run(4.4),
    }
    report = assemble(args, cases, outcomes)
    assert report["errors"] == {}
    assert report["pairs"]["grpo"]["speedup"] == 3.0
    assert report["cases"]["grpo/turnrl-vllm"]["train_tokens_per_s"] == 3000.0
    assert report["breakdown"]["grpo"]["overhead_frac"] == pytest.approx((2.0 - 1.6 - 0.1) / 2.0)
    assert report["breakdown"]["grpo"]["non_compute_frac"] == pytest.approx((2.0 - 1.6) / 2.0)
    assert report["sweep"]["turnrl_fit"]["slope"] == pytest.approx(0.6 / 12)
    table = R.markdown(report)
    assert "| grpo/turnrl-vllm | 2.00 |" in table and "| grpo | 2.00 | 6.00 | hf | 3.00x |" in table
    assert report["sweep"]["turnrl_cpu_fit"]["slope"] == pytest.approx(0.24 / 12)
    assert "trl_cpu_fit" not in report["sweep"]     # no CPU seconds recorded: no fit
    assert "turnrl: step_s = 0.0500 s x (prompts x group)" in table
    assert "turnrl: cpu_s = 0.0200 s x (prompts x group)" in table
    line = R.headline(report)
    assert line["turnrl_step_s"] == 2.0 and line["trl_step_s"] == 6.0 and line["speedup"] == 3.0
    assert line["overlap_turnrl_step_s"] == 1.5 and line["overlap_speedup"] == 4.0
    assert line["outside_work_frac"] == 0.05 and report["breakdown"]["grpo"]["outside_work_frac"] == 0.05
    assert "| outside both actors' work calls (measured in the loop) | 0.100 | 5.0% |" in table
    assert line["slope_s_per_sample"] == pytest.approx(0.05) and line["slope_cpu_s_per_sample"] == pytest.approx(0.02)


def test_repeats_alternate_the_frameworks_and_pool_their_steps():
    args = parse_args(["--suites", "grpo", "--trl-engines", "hf", "--repeats", "2", "--warmup", "1"])
    cases = plan(args)
    assert [c["name"] for c in cases] == ["grpo/turnrl-vllm", "grpo/turnrl-vllm-overlap", "grpo/trl-hf",
                                          "grpo/turnrl-vllm#2", "grpo/turnrl-vllm-overlap#2", "grpo/trl-hf#2"]
    outcomes = {"grpo/turnrl-vllm": {"steps": steps_of([9.0, 1.0, 1.0])},
                "grpo/turnrl-vllm#2": {"steps": steps_of([9.0, 3.0, 3.0, 3.0])},
                "grpo/trl-hf": {"steps": steps_of([9.0, 4.0])}, "grpo/trl-hf#2": {"error": "exit 1"}}
    report = assemble(args, cases, outcomes)
    assert report["cases"]["grpo/turnrl-vllm"]["step_s"] == 3.0      # median of 1, 1, 3, 3, 3
    assert report["cases"]["grpo/turnrl-vllm"]["n_steps"] == 5 and report["cases"]["grpo/turnrl-vllm"]["runs"] == 2
    assert report["pairs"]["grpo"]["speedup"] == pytest.approx(4.0 / 3.0)
    assert list(report["errors"]) == ["grpo/trl-hf#2"]


def test_a_failed_case_is_reported_not_dropped():
    args = parse_args(["--suites", "grpo"])
    report = assemble(args, plan(args), {"grpo/turnrl-vllm": {"error": "exit 1; see log"},
                                         "grpo/trl-hf": {"steps": steps_of([1.0])}})
    assert "grpo/turnrl-vllm" in report["errors"]
    assert "no measured steps" in report["errors"]["grpo/trl-hf"]
    assert report["pairs"] == {}


# --------------------------------------------------------------------------- templates
@pytest.fixture(scope="module")
def tool_tokenizer():
    from turnrl.envs.code_tool import SYSTEM_PROMPT
    from turnrl.models.tiny import build_tokenizer
    tok = build_tokenizer([SYSTEM_PROMPT + "<code>print(12 * 34)</code><output>408</output><answer>408</answer>"], 320)
    tok.chat_template = TOOL_CHAT_TEMPLATE
    tok.response_template = RESPONSE_TEMPLATE
    return tok


def test_a_python_tool_call_renders_as_the_code_tool_protocol(tool_tokenizer):
    messages = [{"role": "user", "content": "Compute 12 * 34."},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "python", "arguments": {"code": "print(12 * 34)"}}}]},
                {"role": "tool", "name": "python", "content": "<output>408</output>"}]
    text = tool_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>user\nCompute 12 * 34.<|im_end|>\n<|im_start|>assistant\n<code>print(12 * 34)"
                    "</code><|im_end|>\n<|im_start|>tool\n<output>408</output><|im_end|>\n<|im_start|>assistant\n")


def test_the_response_template_reads_code_as_a_python_call(tool_tokenizer):
    prefix = tool_tokenizer.apply_chat_template([{"role": "user", "content": "q"}], tokenize=True,
                                                add_generation_prompt=True, return_dict=False)
    ids = tool_tokenizer("<code>print(12 * 34)</code><|im_end|>", add_special_tokens=False)["input_ids"]
    parsed = tool_tokenizer.parse_response(ids, prefix=prefix)
    assert parsed["tool_calls"] == [{"type": "function", "function": {"name": "python",
                                                                      "arguments": {"code": "print(12 * 34)"}}}]
    answer = tool_tokenizer("<answer>408</answer><|im_end|>", add_special_tokens=False)["input_ids"]
    assert "tool_calls" not in tool_tokenizer.parse_response(answer, prefix=prefix)


def test_turnrl_frames_an_observation_as_trl_appends_a_tool_message(tool_tokenizer):
    """turnrl's observation block after a `</code>` stop equals TRL's: the end-of-turn token the
    model writes, then the tool message rendered by the same template."""
    from turnrl.rollout.chat import ChatFormat
    frame = ChatFormat(tool_tokenizer).observation_text("<output>408</output>", "tool")
    assert frame == "<|im_end|>\n<|im_start|>tool\n<output>408</output><|im_end|>\n<|im_start|>assistant\n"


def test_turns_of_a_trl_case_count_its_tool_calls():
    assert R.turns({"turns_mean": 2.5, "tool_calls_mean": 9.0}) == 2.5
    assert R.turns({"tool_calls_mean": 1.9}) == pytest.approx(2.9)
    assert R.turns({}) == 1.0


def test_scripted_turns_call_twice_then_answer():
    turns = scripted_turns({"prompt": "Compute 12 * 34.", "answer": "408"})
    assert turns[0].endswith("<code>print(12 * 34)</code>") and turns[1].endswith("<code>print(34 * 12)</code>")
    assert turns[2].endswith("<answer>408</answer>")
    with pytest.raises(ValueError, match="kind"):
        ModelSpec(kind="trained")


# --------------------------------------------------------------------------- end to end (slow)
@pytest.mark.slow
@pytest.mark.long   # ~130 s: the benchmark itself, outside CI like the rest of benchmarks/
def test_quick_run_prints_both_step_times_last(tmp_path):
    """A tiny `--quick` (grpo pair only, 2 prompts x 2 samples x 8 tokens, one measured step, no
    overlap case): the real Ray/DeepSpeed/vLLM loop and TRL's GRPOTrainer both run; ~2 min."""
    pytest.importorskip("trl", reason="the TRL peer needs the bench extra: pip install -e '.[bench]'")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick", "--suites", "grpo", "--prompts", "2",
         "--group", "2", "--max-tokens", "8", "--max-total", "8", "--steps", "1", "--warmup", "1", "--trl-engines", "hf",
         "--no-overlap", "--threads", "1", "--work-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line["turnrl_step_s"] > 0 and line["trl_step_s"] > 0
    # the line rounds the speedup to 2 decimals and the step times to 3
    assert line["speedup"] == pytest.approx(line["trl_step_s"] / line["turnrl_step_s"], abs=0.01)
    assert "overlap_turnrl_step_s" not in line
    report = json.loads((tmp_path / "results.json").read_text())
    assert set(report["cases"]) == {"grpo/turnrl-vllm", "grpo/trl-hf"}
    for name in ("grpo/turnrl-vllm", "grpo/trl-hf"):
        case = report["cases"][name]
        assert case["gen_tokens"] > 0 and case["peak_rss_mib"] > 100, name


def test_covered_counts_overlapping_spans_once():
    from benchmarks.turnrl_side import covered
    assert covered([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == 4.0
    assert covered([(1.0, 2.0), (1.2, 1.5)]) == 1.0
    assert covered([]) == 0.0


def test_tree_cpu_seconds_counts_this_process_and_reaped_children():
    from benchmarks.turnrl_side import tree_cpu_seconds
    start = tree_cpu_seconds()
    subprocess.run([sys.executable, "-c", "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"],
                   check=True)
    assert tree_cpu_seconds() - start >= 0.25


def test_the_noisy_judge_knows_the_truth_and_errs_at_its_rate():
    """benchmarks/noisy_judge.py: right answers score 8-10, wrong 0-2; --flip inverts that
    share of verdicts; the template's fields are where it reads them."""
    import random
    import re
    from benchmarks.noisy_judge import TEMPLATE, verdict
    right = TEMPLATE.format(question="What is 6 * 7?", reference="42", response="<answer>42")   # cut at its stop
    wrong = TEMPLATE.format(question="What is 6 * 7?", reference="42", response="<answer>41</answer>")
    score = lambda text: int(re.search(r"Score: (\d+)", text).group(1))  # noqa: E731
    rng = random.Random(0)
    assert all(score(verdict(right, rng, 0.0, 0.0)) >= 8 and score(verdict(wrong, rng, 0.0, 0.0)) <= 2
               for _ in range(20))
    flipped = [score(verdict(right, rng, 0.25, 0.0)) <= 2 for _ in range(2000)]
    assert 0.22 < sum(flipped) / len(flipped) < 0.28
    assert "Score" not in verdict(right, rng, 0.0, 1.0)   # babble: no score to parse


def test_the_judge_report_pairs_each_judge_run_with_its_programmatic_run():
    from benchmarks.judge import report
    base = [{"row": "sync", "seed": 0, "gain_pts": 70.0, "baseline": 0.2, "trained": 0.9, "train_s": 100.0,
             "steps": 20, "commit": "a"}]
    judged = [{"row": "sync_judge", "seed": 0, "gain_pts": 60.0, "baseline": 0.2, "trained": 0.8, "step_s": 6.0,
               "train_s": 120.0, "steps": 20, "judge_calls": 100, "judge_latency_p50_s": 0.5,
               "judge_latency_p99_s": 2.0, "judge_retries": 1.0, "judge_unparsable": 1.0, "commit": "b"}]
    hedged = [{**judged[0], "row": "sync_judge_hedged", "step_s": 5.5}]
    text = report(judged + hedged, [0], 8731, base)
    assert "- sync_judge over sync: seed 0: 1.20 (against dynamic_sampling.json's run)" in text   # 6.0 s against 100 / 20
    assert "- sync_judge_hedged over sync: seed 0: 1.10 (against" in text
    assert "| sync_judge | +60.0 (1 seed) | +60.0 | 0.800 | 6.00 | 100 | 0.50 / 2.00 | 1.0 | 1.0 | 0.0 |" in text


def test_the_distillation_report_checks_the_target_for_each_opd_grpo_pair():
    from benchmarks.distill import PAIRS, report, rows
    names = {r.name for r in rows(Path("/tmp/w"))}
    assert {n for pair in PAIRS for n in pair} <= names   # a misspelt pair would print no verdict at all

    def run(row, seed, reached_at):
        curve = [{"step": s, "heldout_accuracy": 0.95 if s >= reached_at else 0.3, "wall_s": 10.0 * s,
                  "trajectories": 128 * s} for s in range(2, 21, 2)]
        reached = next((p for p in curve if p["heldout_accuracy"] >= 0.9 * 0.96), None)
        return {"row": row, "seed": seed, "baseline": 0.1, "trained": 0.95, "teacher_accuracy": 0.96,
                "curve": curve, "reached": reached, "step_s": 5.0, "commit": "c"}
    results = [run("grpo", 0, 6), run("opd", 0, 4), run("grpo_lr4x", 0, 4), run("opd_lr4x", 0, 2)]
    text = report(results, [0], Path("/tmp/w"), {"baseline": 0.1, "trained": 0.96})
    assert "- seed 0: opd 4, grpo 6: **not met**" in text
    assert "- seed 0: opd_lr4x 2, grpo 6: met" in text            # 3 x 2 <= 6
    assert "- seed 0: opd_lr4x 2, grpo_lr4x 4: **not met**" in text
    assert "through the text" not in text   # no row mapped a teacher's tokens
    never = {**run("grpo_rare", 0, 99), "reached": None}   # GRPO past its 20 steps: only o <= 6 is shown
    for o, verdict in ((6, "met"), (8, "not decided (grpo did not reach it in 20 steps, fewer than 3 x 8)")):
        text = report([never, run("opd_rare", 0, o)], [0], Path("/tmp/w"), {"baseline": 0.1, "trained": 0.96})
        assert f"- seed 0: opd_rare {o}, grpo_rare >20: {verdict}" in text
    mapped = {**run("opd_own_tokenizer", 0, 4), "teacher_exact_frac": 0.9876}
    assert "(the mean over steps): seed 0: 98.8%" in report([*results, mapped], [0], Path("/tmp/w"),
                                                            {"baseline": 0.1, "trained": 0.96})
