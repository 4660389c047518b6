"""The peer: TRL's GRPOTrainer on the same model, prompts, group size, token budget and number
of updates as turnrl's step, on CPU.

Single turn: plain GRPO, one completion per sample. Three turns: TRL's own tool-calling loop
(`tools=[python]`): the model's `<code>...</code>` is parsed as a call of `python` (the
benchmark model's response template), run in turnrl's sandbox, its `<output>` appended as a
tool message, and the model generates again, up to `turns - 1` tool rounds, exactly as
turnrl's code_tool loop does.

Timing comes from TRL's own profiling contexts (recorded here instead of sent to a tracker),
a callback at each optimizer step, and a timer around the tool.
"""
from __future__ import annotations

import os
import time
from collections import defaultdict
from typing import Any


def run(case: dict[str, Any]) -> dict[str, Any]:
    """Run `case["warmup"] + case["steps"]` GRPO steps; return per-step times and parts."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    if case["engine"] == "vllm":
        from turnrl.rollout.engines import cpu_env_defaults
        for key, value in cpu_env_defaults(1.0).items():   # the same vLLM settings turnrl's engine runs with
            os.environ.setdefault(key, value)
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.extras import profiling

    from benchmarks.models import train_rows
    from benchmarks.turnrl_side import tree_cpu_seconds, tree_niceness
    from turnrl.envs.code_tool import SYSTEM_PROMPT, CodeToolEnv, parse_action
    from turnrl.rewards.math import grade_math

    torch.manual_seed(case["seed"])
    torch.set_flush_denormal(True)   # as turnrl's trainer does
    parts: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    state = {"step": 0}

    def record(name: str, seconds: float) -> None:
        parts[state["step"]][name] += seconds

    def log_metrics(self, duration: float) -> None:   # TRL's profiling contexts -> `parts`
        name = self.name.split(".", 1)[-1]
        if name == "_get_per_token_logps_and_entropies":
            # no_grad: reference (or old) logprobs while scoring; with grad: the update's forward
            name = "update_forward" if torch.is_grad_enabled() else "ref_old_logprobs"
        record(name, duration)
    profiling.ProfilingContext._log_metrics = log_metrics

    tool_env = CodeToolEnv()

    def python(code: str) -> str:
        """Run Python code in a sandbox and return what it printed.

        Args:
            code: The Python source to run.

        Returns:
            The printed output, between <output> tags.
        """
        start = time.perf_counter()
        observation = tool_env.step(f"<code>{code}</code>").observation or ""
        record("tools", time.perf_counter() - start)
        return observation

    def code_tool_reward(completions, answer, **_) -> list[float]:
        """1.0 for a correct <answer> in the last assistant message, as code_tool grades it."""
        out = []
        for messages, gold in zip(completions, answer):
            text = next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")
            kind, content = parse_action(text or "")
            out.append(float(kind == "answer" and grade_math(f"<answer>{content}</answer>", str(gold)).correct))
        return out

    rows = train_rows(seed=case["seed"])
    data = Dataset.from_list([{"prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                                          {"role": "user", "content": r["prompt"]}],
                               "answer": str(r["answer"])} for r in rows])
    multi = case["turns"] > 1
    args = GRPOConfig(
        output_dir=os.path.join(case["work_dir"], "trl_out"),
        per_device_train_batch_size=case["prompts"] * case["group"], num_generations=case["group"],
        gradient_accumulation_steps=1, num_iterations=1, max_steps=case["warmup"] + case["steps"],
        max_completion_length=case["max_total"] if multi else case["max_tokens"],
        max_tool_calling_iterations=case["turns"] - 1 if multi else None,
        learning_rate=case["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.99, max_grad_norm=1.0,
        beta=case["beta"], epsilon=0.2, epsilon_high=0.28, loss_type="dapo", scale_rewards="group",
        temperature=1.0, top_p=1.0, top_k=0,
        use_cpu=True, bf16=False, seed=case["seed"], report_to="none", logging_steps=1,
        save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        # vLLM colocated in this process; on CPU its "gpu" memory fraction sizes the KV cache from
        # RAM: ~1 GiB, as turnrl's rollout.kv_cache_gib gives its engine
        use_vllm=case["engine"] == "vllm", vllm_mode="colocate", vllm_gpu_memory_utilization=0.05,
        vllm_max_model_length=2048,
    )
    tokenizer = AutoTokenizer.from_pretrained(case["model_dir"], padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(case["model_dir"], dtype=torch.float32)

    marks: list[float] = []
    cpu: list[float] = []
    logs: list[dict] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, st, control, **kw):
            if not marks:
                marks.append(time.perf_counter())
                cpu.append(tree_cpu_seconds())
            state["step"] = st.global_step + 1

        def on_step_end(self, args, st, control, **kw):
            marks.append(time.perf_counter())
            cpu.append(tree_cpu_seconds())

        def on_log(self, args, st, control, logs=None, **kw):
            if logs and "loss" in logs:
                logs_copy = dict(logs)
                logs_copy["step"] = st.global_step
                logs_list.append(logs_copy)

    logs_list = logs
    trainer = GRPOTrainer(model=model, reward_funcs=code_tool_reward, args=args, train_dataset=data,
                          processing_class=tokenizer, tools=[python] if multi else None, callbacks=[Clock()])
    trainer.train()

    steps = []
    for index in range(1, len(marks)):
        log = next((entry for entry in logs if entry["step"] == index), {})
        group = case["prompts"] * case["group"]
        steps.append({
            "step": index,
            "step_s": marks[index] - marks[index - 1],
            "cpu_s": cpu[index] - cpu[index - 1],
            **{f"{k}_s": v for k, v in parts[index].items()},
            "gen_tokens": log.get("completions/mean_length", float("nan")) * group,
            "tool_calls_mean": log.get("tools/call_frequency", 0.0),
            "turns_mean": 1.0 + log.get("tools/call_frequency", 0.0),   # a tool call starts another turn
            "reward_mean": log.get("reward", float("nan")),
        })
    return {"framework": "trl", "steps": steps, "niceness": tree_niceness()}
