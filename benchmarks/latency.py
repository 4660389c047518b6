"""The latency suite: a slow tool, turnrl's `tools` environment against TRL's tool loop.

    python benchmarks/run.py --suites latency --quick

64 trajectories a step (8 prompts x 8 samples), up to 3 turns: the benchmark model calls a
loopback HTTP tool `multiply(a, b)` twice (the product, then the check with the factors
swapped) and answers. The tool server (a process of its own, threads, one per request) adds an
injected latency to every call: 0 and 0.5 s. Both frameworks run a whole GRPO step (rollout,
reference logprobs, update; turnrl also pushes the weights into vLLM) on the same model,
prompts, group size and token budget:

- turnrl: `turnrl.training.loop.train` (Ray, DeepSpeed, vLLM), `env.name: tools` with the HTTP
  tool, `rollout.rejoin: ready` (a tool's answer rejoins the batch as soon as it is back, the
  engine decoding the others meanwhile); also `rejoin: lag` (the default, reproducible) at 0.5 s,
  for the record.
- TRL 1.16: `GRPOTrainer(tools=[multiply])`, its tool-calling loop, with the tool as an async
  function (TRL gathers a completion's async calls) and, in the full suite, as a sync one.

The summary (the last line of `run.py` when this suite runs alone): `tool_latency_s`,
`turnrl_step_s` (at that latency), `turnrl_step_s_no_latency`, `trl_step_s` (TRL's best at that
latency), `tool_turns` (tool calls on a trajectory's critical path: the mean number of tool turns
of turnrl's trajectories, calls of one turn running at once), and the two targets: turnrl at
least 3x faster than TRL at 0.5 s, and turnrl's step growing by at most
1.5 x tool_turns x latency over its no-latency step.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

LATENCY = 0.5
PROMPTS, GROUP = 8, 8
MAX_TURNS, MAX_TOKENS, MAX_TOTAL = 3, 64, 256
SCRIPT_STEPS = 200


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def tool_schema() -> dict:
    """The tool's schema as both frameworks render it (transformers' get_json_schema)."""
    from transformers.utils import get_json_schema
    fn = get_json_schema(multiply)["function"]
    return {"name": fn["name"], "description": fn["description"], "parameters": fn["parameters"]}


# --------------------------------------------------------------------------- the tool server
class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "ToolServer"

    def do_POST(self):   # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        time.sleep(self.server.latency)
        try:
            payload, status = {"result": multiply(int(body["a"]), int(body["b"]))}, 200
        except (KeyError, TypeError, ValueError) as exc:
            payload, status = {"error": f"{type(exc).__name__}: {exc}"}, 400
        with self.server.lock:
            self.server.calls += 1
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):   # noqa: N802
        data = json.dumps({"ok": True, "latency_s": self.server.latency, "calls": self.server.calls}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


class ToolServer(ThreadingHTTPServer):
    """`multiply` over HTTP with `latency` seconds added to every call (a thread per request)."""
    daemon_threads = True
    request_queue_size = 512

    def __init__(self, port: int, latency: float):
        super().__init__(("127.0.0.1", port), _Handler)
        self.latency, self.calls, self.lock = latency, 0, threading.Lock()


class ToolServerProcess:
    """The tool server in a process of its own (neither framework's interpreter serves it)."""

    def __init__(self, latency: float):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.latency = latency
        self.url = f"http://127.0.0.1:{self.port}/multiply"

    def __enter__(self) -> "ToolServerProcess":
        root = Path(__file__).resolve().parents[1]
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.latency", "serve", str(self.port),
                                      str(self.latency)], cwd=str(root))
        import httpx
        deadline = time.time() + 30
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1)
                return self
            except httpx.TransportError:
                if time.time() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("the benchmark's tool server did not start")
                time.sleep(0.2)

    def calls(self) -> int:
        import httpx
        return int(httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=5).json()["calls"])

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


# --------------------------------------------------------------------------- the model
# qwen3-style response template (transformers >= 5.13), so TRL's parse_response reads the
# hermes calls back: <tool_call>JSON</tool_call> repeated, the rest up to <|im_end|> the content.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


def rows(count: int = 512, seed: int = 0) -> list[dict]:
    from turnrl.data.synthetic import product_rows
    return product_rows(count, seed=seed, split="train", exclude=set())


def scripted_turns(row: dict) -> list[str]:
    """Call, check with the factors swapped, answer: two tool turns on every trajectory."""
    def call(a, b):
        return "<tool_call>\n" + json.dumps({"name": "multiply", "arguments": {"a": a, "b": b}}) + "\n</tool_call>"
    return [call(row["a"], row["b"]), call(row["b"], row["a"]), f"<answer>{row['answer']}</answer>"]


def model_name() -> str:
    from turnrl.models.tiny import CHAT_TEMPLATE
    recipe = json.dumps([SCRIPT_STEPS, CHAT_TEMPLATE, RESPONSE_TEMPLATE, inspect.getsource(scripted_turns),
                         inspect.getsource(build_model), inspect.getsource(multiply)], sort_keys=True)
    return "tools-h128-l4-" + hashlib.sha1(recipe.encode()).hexdigest()[:8]


def ensure_model(models_dir: str | Path) -> Path:
    out = Path(models_dir) / model_name()
    if not (out / "config.json").exists():
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        build_model(tmp)
        tmp.rename(out)
    return out


def build_model(out: Path) -> None:
    """The tiny model (hidden 128, 4 layers, vocabulary 512) warm-started on the 3-turn script
    replayed through turnrl's tools environment (the tool a local function with the same
    schema): the prompt with the tool's schema, every response token trained, frames and the
    final end-of-turn token included, so the model closes its turns itself (what TRL needs)."""
    import torch

    from turnrl import envs
    from turnrl.config import TinyModel
    from turnrl.rollout.chat import ChatFormat
    from turnrl.rollout.multi_turn import replay
    from turnrl.models.tiny import build_model as tiny_model, build_tokenizer, save, warm_start

    torch.set_num_threads(1)
    make = lambda: envs.make("tools", functions=["benchmarks.latency:multiply"])   # noqa: E731
    data = rows()
    plain = build_tokenizer([""], 300)
    demos = [replay(make(), ChatFormat(plain), r, scripted_turns(r)) for r in data[:200]]
    tokenizer = build_tokenizer([plain.decode(t.prompt_ids + t.response_ids) for t in demos], 512)
    tokenizer.response_template = RESPONSE_TEMPLATE
    model = tiny_model(tokenizer, TinyModel(vocab_size=512), seed=0)
    fmt = ChatFormat(tokenizer)
    sequences = []
    for row in data:
        t = replay(make(), fmt, row, scripted_turns(row))
        ids = t.prompt_ids + t.response_ids
        sequences.append((ids, [0] * len(t.prompt_ids) + [1] * len(t.response_ids)))
    warm_start(model, sequences, SCRIPT_STEPS, batch_size=16, lr=3e-3, seed=0, desc="latency model")
    save(model, tokenizer, out)


# --------------------------------------------------------------------------- the cases
def cases(args) -> list[dict]:
    """The suite's cases for run.py's plan (each a plain dict a child process runs)."""
    steps = args.steps if not args.quick else 3
    base = {"suite": "latency", "model": None, "prompts": PROMPTS, "group": GROUP, "max_tokens": MAX_TOKENS,
            "max_total": MAX_TOTAL, "turns": MAX_TURNS, "warmup": args.warmup, "steps": steps, "lr": args.lr,
            "beta": args.beta, "seed": args.seed, "threads": args.threads, "env_workers": args.env_workers}
    # TRL at 0.5 s: every call waits in turn (64 x 2 x 0.5 s a step), so fewer steps
    slow = {"steps": 2 if args.quick else max(2, steps // 2)}
    out = [{**base, "name": "latency/turnrl-0", "kind": "latency-turnrl", "latency": 0.0, "rejoin": "ready"},
           {**base, "name": f"latency/turnrl-{LATENCY:g}", "kind": "latency-turnrl", "latency": LATENCY,
            "rejoin": "ready"},
           {**base, "name": f"latency/turnrl-{LATENCY:g}-lag", "kind": "latency-turnrl", "latency": LATENCY,
            "rejoin": "lag"},
           {**base, **slow, "name": f"latency/trl-{LATENCY:g}-async", "kind": "latency-trl", "latency": LATENCY,
            "tool": "async", "engine": "hf"}]
    if not args.quick:
        out += [{**base, **slow, "name": f"latency/trl-{LATENCY:g}-sync", "kind": "latency-trl", "latency": LATENCY,
                 "tool": "sync", "engine": "hf"},
                {**base, "name": "latency/trl-0-async", "kind": "latency-trl", "latency": 0.0, "tool": "async",
                 "engine": "hf"}]
    return out


def _tree():
    from benchmarks.turnrl_side import tree_cpu_seconds, tree_niceness
    return tree_cpu_seconds, tree_niceness


def run_turnrl(case: dict[str, Any]) -> dict[str, Any]:
    """turnrl's product path on the case's tool server; per step the wall time, the rollout's
    share and the tool turns of the trajectories."""
    import ray

    from turnrl.config import parse_config
    from turnrl.training.loop import train
    tree_cpu_seconds, tree_niceness = _tree()
    model_dir = str(ensure_model(case["models_dir"]))
    with ToolServerProcess(case["latency"]) as server:
        cfg = parse_config({
            "seed": case["seed"], "model": {"path": model_dir},
            "env": {"name": "tools", "options": {
                "functions": [], "http": [{**tool_schema(), "url": server.url}], "timeout_s": 60.0,
                "max_concurrent": 256}, **({"workers": case["env_workers"]} if case.get("env_workers") else {})},
            "algorithm": {"name": "grpo", "kl_coef": case["beta"], "clip_low": 0.2, "clip_high": 0.28,
                          "loss_agg": "token-mean"},
            "rollout": {"engine": "vllm", "n": case["group"], "max_turns": case["turns"],
                        "max_tokens_per_turn": case["max_tokens"], "max_tokens_total": case["max_total"],
                        "rejoin": case["rejoin"]},
            "train": {"steps": case["warmup"] + case["steps"], "prompts_per_step": case["prompts"], "lr": case["lr"]},
            "cluster": {"num_cpus": case["threads"]},
        }, source="latency case")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        temp_dir = f"/tmp/rl{os.getpid()}"
        ray.init(address="local", num_cpus=cfg.cluster.num_cpus, include_dashboard=False, _temp_dir=temp_dir,
                 log_to_driver=False)
        steps: list[dict] = []
        marks, cpu, calls = [time.perf_counter()], [tree_cpu_seconds()], [server.calls()]
        niceness: set[int] = set()

        def on_step(step: int, metrics: dict, trajs) -> None:
            marks.append(time.perf_counter())
            cpu.append(tree_cpu_seconds())
            calls.append(server.calls())
            tool_turns = [len(t.observations) for t in trajs]
            steps.append({
                "step": step, "step_s": marks[-1] - marks[-2] if step > 1 else metrics["step_s"],
                "cpu_s": cpu[-1] - cpu[-2], "rollout_s": metrics["rollout_s"], "train_s": metrics["train_s"],
                "sync_s": metrics["sync_s"], "gen_tokens": float(sum(t.policy_tokens() for t in trajs)),
                "turns_mean": metrics["turns_mean"], "tool_turns_mean": sum(tool_turns) / len(tool_turns),
                "tool_turns_max": float(max(tool_turns)), "tool_calls": float(calls[-1] - calls[-2]),
                "tool_errors_mean": metrics.get("env_tool_errors_mean", 0.0), "reward_mean": metrics["reward_mean"],
                "env_error_frac": metrics.get("finish_env_error_frac", 0.0),
            })
            niceness.update(tree_niceness())

        try:
            train(cfg, model_dir, case["work_dir"], rows(seed=case["seed"]), os.path.join(case["work_dir"], "out"),
                  on_step=on_step)
        finally:
            ray.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)
    return {"framework": "turnrl", "steps": steps, "niceness": sorted(niceness)}


def run_trl(case: dict[str, Any]) -> dict[str, Any]:
    """TRL's GRPOTrainer with `tools=[multiply]` calling the case's tool server (async, or sync)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from collections import defaultdict

    import httpx
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from turnrl.envs.tools import SYSTEM_PROMPT
    from turnrl.rewards.math import grade_math
    tree_cpu_seconds, tree_niceness = _tree()
    model_dir = str(ensure_model(case["models_dir"]))
    torch.manual_seed(case["seed"])
    torch.set_flush_denormal(True)
    parts: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    state = {"step": 0, "calls": defaultdict(int)}

    with ToolServerProcess(case["latency"]) as server:
        url = server.url
        clients: dict[str, Any] = {}

        def note(start: float) -> None:
            parts[state["step"]]["tools"] += time.perf_counter() - start
            state["calls"][state["step"]] += 1

        if case["tool"] == "async":
            # no return annotation: get_json_schema would add a "return" entry the template renders,
            # and the prompt would differ from turnrl's (whose tool schemas have none)
            async def multiply(a: int, b: int):   # noqa: F811 - the same tool, over HTTP
                """Multiply two integers.

                Args:
                    a: The first factor.
                    b: The second factor.
                """
                start = time.perf_counter()
                if "async" not in clients:
                    clients["async"] = httpx.AsyncClient(timeout=60)
                reply = await clients["async"].post(url, json={"a": a, "b": b})
                note(start)
                return reply.json()["result"]
        else:
            def multiply(a: int, b: int):   # noqa: F811
                """Multiply two integers.

                Args:
                    a: The first factor.
                    b: The second factor.
                """
                start = time.perf_counter()
                if "sync" not in clients:
                    clients["sync"] = httpx.Client(timeout=60)
                reply = clients["sync"].post(url, json={"a": a, "b": b})
                note(start)
                return reply.json()["result"]

        def correct(completions, answer, **_) -> list[float]:
            out = []
            for messages, gold in zip(completions, answer):
                text = next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "") or ""
                out.append(float(grade_math(text, str(gold)).correct))
            return out

        data = Dataset.from_list([{"prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                                              {"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                                  for r in rows(seed=case["seed"])])
        args = GRPOConfig(
            output_dir=os.path.join(case["work_dir"], "trl_out"),
            per_device_train_batch_size=case["prompts"] * case["group"], num_generations=case["group"],
            gradient_accumulation_steps=1, num_iterations=1, max_steps=case["warmup"] + case["steps"],
            max_completion_length=case["max_total"], max_tool_calling_iterations=case["turns"] - 1,
            learning_rate=case["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            adam_beta1=0.9, adam_beta2=0.99, max_grad_norm=1.0, beta=case["beta"], epsilon=0.2, epsilon_high=0.28,
            loss_type="dapo", scale_rewards="group", temperature=1.0, top_p=1.0, top_k=0, use_cpu=True, bf16=False,
            seed=case["seed"], report_to="none", logging_steps=1, save_strategy="no", disable_tqdm=True,
            dataloader_num_workers=0, use_vllm=False)
        tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        # the same prompt as turnrl's, token for token (the tool's schema rendered alike)
        from turnrl.rollout.chat import ChatFormat
        theirs = tokenizer.apply_chat_template(data[0]["prompt"], tools=[multiply], add_generation_prompt=True,
                                               tokenize=False)
        ours = ChatFormat(tokenizer).prompt_text(SYSTEM_PROMPT, data[0]["prompt"][1]["content"],
                                                 [{"type": "function", "function": tool_schema()}])
        if theirs != ours:
            raise RuntimeError(f"TRL's prompt differs from turnrl's:\n{theirs!r}\n{ours!r}")
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
                    logs_list.append({**logs, "step": st.global_step})

        logs_list = logs
        trainer = GRPOTrainer(model=model, reward_funcs=correct, args=args, train_dataset=data,
                              processing_class=tokenizer, tools=[multiply], callbacks=[Clock()])
        trainer.train()

    steps = []
    for index in range(1, len(marks)):
        log = next((entry for entry in logs if entry["step"] == index), {})
        group = case["prompts"] * case["group"]
        steps.append({"step": index, "step_s": marks[index] - marks[index - 1], "cpu_s": cpu[index] - cpu[index - 1],
                      **{f"{k}_s": v for k, v in parts[index].items()},
                      "tool_calls": float(state["calls"][index]),
                      "tool_turns_mean": state["calls"][index] / group,
                      "tool_calls_mean": state["calls"][index] / group,    # results.turns: 1 + calls
                      "gen_tokens": log.get("completions/mean_length", float("nan")) * group,
                      "reward_mean": log.get("reward", float("nan"))})
    return {"framework": "trl", "steps": steps, "niceness": tree_niceness()}


# --------------------------------------------------------------------------- the summary
def summary(case_medians: dict[str, dict]) -> dict[str, Any]:
    """The suite's one-line summary from the cases' medians (run.py's `cases`)."""
    from benchmarks.results import ratio
    fast = case_medians.get("latency/turnrl-0", {})
    slow = case_medians.get(f"latency/turnrl-{LATENCY:g}", {})
    lag = case_medians.get(f"latency/turnrl-{LATENCY:g}-lag", {})
    trl = {name.split("/")[1]: c for name, c in case_medians.items() if name.startswith(f"latency/trl-{LATENCY:g}")}
    best = min(trl.values(), key=lambda c: c.get("step_s", float("inf")), default={})
    out: dict[str, Any] = {"tool_latency_s": LATENCY}
    if "step_s" in slow:
        out["turnrl_step_s"] = round(slow["step_s"], 3)
    if "step_s" in fast:
        out["turnrl_step_s_no_latency"] = round(fast["step_s"], 3)
    if "step_s" in best:
        out["trl_step_s"] = round(best["step_s"], 3)
        out["trl_tool"] = next(k for k, c in trl.items() if c is best).rsplit("-", 1)[-1]
    if "tool_turns_mean" in slow:
        out["tool_turns"] = round(slow["tool_turns_mean"], 3)
        out["tool_turns_max"] = slow.get("tool_turns_max")
    if "step_s" in lag:
        out["turnrl_step_s_rejoin_lag"] = round(lag["step_s"], 3)
    trl0 = case_medians.get("latency/trl-0-async", {})
    if "step_s" in trl0:
        out["trl_step_s_no_latency"] = round(trl0["step_s"], 3)
    if "turnrl_step_s" in out and "trl_step_s" in out:
        out["speedup"] = round(ratio(out["trl_step_s"], out["turnrl_step_s"]), 2)
        out["speedup_target"] = 3.0
        out["speedup_met"] = out["speedup"] >= 3.0
    if {"turnrl_step_s", "turnrl_step_s_no_latency", "tool_turns"} <= out.keys():
        growth = out["turnrl_step_s"] - out["turnrl_step_s_no_latency"]
        out["growth_s"] = round(growth, 3)
        out["growth_limit_s"] = round(1.5 * out["tool_turns"] * LATENCY, 3)
        out["growth_met"] = growth <= out["growth_limit_s"]
    return out


def markdown(out: dict[str, Any]) -> str:
    """The summary as a table for results.md."""
    rows = [("tool latency per call", f"{out.get('tool_latency_s')} s"),
            ("turnrl step, no latency (rejoin: ready)", out.get("turnrl_step_s_no_latency")),
            ("turnrl step (rejoin: ready)", out.get("turnrl_step_s")),
            ("turnrl step (rejoin: lag, the default)", out.get("turnrl_step_s_rejoin_lag")),
            (f"TRL step ({out.get('trl_tool', '?')} tool)", out.get("trl_step_s")),
            ("TRL step, no latency", out.get("trl_step_s_no_latency")),
            ("tool turns on a trajectory (mean; max)", f"{out.get('tool_turns')}; {out.get('tool_turns_max')}"),
            ("speedup over TRL (target >= 3)", f"{out.get('speedup')} ({'met' if out.get('speedup_met') else 'not met'})"),
            ("turnrl's growth (limit 1.5 x tool turns x latency)",
             f"{out.get('growth_s')} s of {out.get('growth_limit_s')} s "
             f"({'met' if out.get('growth_met') else 'not met'})")]
    lines = ["| latency suite | |", "|---|---|"] + [f"| {k} | {v if v is not None else '-'} |" for k, v in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    """`python -m benchmarks.latency serve PORT LATENCY`: the tool server (run by the cases)."""
    if len(argv) == 3 and argv[0] == "serve":
        server = ToolServer(int(argv[1]), float(argv[2]))
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
