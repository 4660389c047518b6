import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Tests never download: with network a "data set unreachable" test would fetch it, and without
# network the hub attempt would wait for its timeouts (~20 s per test) before failing.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# As turnrl sets it (src/turnrl/__init__.py), before anything here loads torch: two test workers
# share two cores, and spinning OpenMP threads stall each other.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# The files that take longest, longest first (their slowest tests in the CI run of 4b04af3, two
# workers: pipeline_e2e ~850 s, resume ~410, tools_pipeline ~250, plugins ~210, flows ~190,
# checks_first, critic, compat, benchmarks ~130 each, ...). Two xdist workers take files in
# collection order (`--no-loadscope-reorder`), so the longest start first and the short ones
# fill in: the run does not end with one worker alone on a long file.
LONGEST_FIRST = ("test_pipeline_e2e.py", "test_agent_pipeline.py", "test_resume.py", "test_tools_pipeline.py", "test_plugins.py", "test_flows.py",
                 "test_checks_first.py", "test_critic.py", "test_compat.py", "test_benchmarks.py",
                 "test_eval_during_training.py", "test_async.py", "test_tracking_server.py", "test_tool_faults.py",
                 "test_scale.py", "test_mlmt_two_models.py", "test_ecosystem_skyrl_gym.py", "test_ecosystem_verifiers.py",
                 "test_ecosystem_openenv.py", "test_mlmt.py", "test_evaluation.py", "test_update.py", "test_rollout.py",
                 "test_env_math_refine.py", "test_doctor_model.py", "test_ecosystem_gem.py")


def needs_setup(path: Path, what: str) -> None:
    """For a test module that needs something setup.sh installs beside `.venv` (a side
    virtualenv, verl's module): skip the module, saying why, where it is absent; in CI
    (CI=true), where setup.sh ran, its absence is a failure, never a silent skip."""
    if path.exists():
        return
    if os.environ.get("CI") == "true":
        raise RuntimeError(f"{path.relative_to(ROOT)} is missing in CI; setup.sh should have made it")
    pytest.skip(f"{path.relative_to(ROOT)} is missing ({what}): run ./setup.sh", allow_module_level=True)


def pytest_collection_modifyitems(items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: a file's tests keep their order


@pytest.fixture(scope="session")
def data_dir() -> Path:
    value = os.environ.get("TURNRL_DATA_DIR")
    if not value:
        pytest.skip("set TURNRL_DATA_DIR to ../shared/data (the real data sets) to run this test")
    return Path(value)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """An untrained tiny model (tokenizer + Qwen2) built like prepare_model builds it."""
    from turnrl.config import Config
    from turnrl.data.synthetic import product_rows
    from turnrl.rollout.chat import ChatFormat
    from turnrl.models.tiny import build_model, build_tokenizer, save
    from turnrl.envs.code_tool import SYSTEM_PROMPT

    rows = product_rows(200, seed=0, split="train", exclude=set())
    corpus = [SYSTEM_PROMPT + r["prompt"] + f"<code>print({r['prompt'][8:-1]})</code><output>{r['answer']}</output>"
              f"<answer>{r['answer']}</answer>" for r in rows]
    tokenizer = build_tokenizer(corpus, 512)
    ChatFormat(tokenizer)  # the template must render
    out = tmp_path_factory.mktemp("tiny")
    save(build_model(tokenizer, Config().model.tiny, seed=0), tokenizer, out)
    return out


def measured(what: str, **numbers) -> None:
    """Print what a fault or speed test measured (shown with `pytest -s`)."""
    print(f"\nMEASURED {what}: " + ", ".join(f"{k} = {v:.3g}" if isinstance(v, float) else f"{k} = {v}"
                                            for k, v in numbers.items()))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def copy_project(dest: Path) -> None:
    """The project's files as git sees them (tracked and new, not ignored) in a fresh repo, so
    end-to-end tests run the pipeline from what a clean clone would hold."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    git = ["git", "-c", "user.name=turnrl-test", "-c", "user.email=test@turnrl.invalid"]
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    subprocess.run([*git, "add", "-A"], cwd=dest, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "e2e copy"], cwd=dest, check=True)


def run_dvc(project: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """`dvc ARGS` in a project copy, as a user runs it: this venv's tools on PATH, the copy's
    sources first, no analytics, and no pipeline key inherited from a test's environment."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(project / "src"), "DVC_NO_ANALYTICS": "1", "RAY_USAGE_STATS_ENABLED": "0",
           "MLFLOW_DISABLE_TELEMETRY": "true"}
    env.pop("TURNRL_PIPELINE_KEY", None)
    return subprocess.run(["dvc", *args], cwd=project, env=env, capture_output=True, text=True, timeout=timeout)

class ScriptedEngine:
    """Answers each call with the next scripted turn for every prompt: a stand-in for the
    model in unit tests of the code around the engine (the rollout loop, environments)."""

    def __init__(self, tokenizer, turns, finish="stop"):
        self.tokenizer, self.turns, self.finish, self.calls = tokenizer, list(turns), finish, []

    def generate(self, prompts, *, max_tokens, stop, temperature, top_p, seeds):
        from turnrl.rollout.multi_turn import Sample
        text = self.turns.pop(0)
        self.calls.append({"prompts": [list(p) for p in prompts], "max_tokens": list(max_tokens),
                           "stop": tuple(stop)})
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        out = []
        for limit in max_tokens:
            cut = ids[:limit]
            out.append(Sample(cut, [-0.5] * len(cut), "length" if len(cut) < len(ids) else self.finish))
        return out


def print_past_capture(request, text: str) -> None:
    """Print `text` even under pytest's output capture (a suite's summary table or fuzz counts).
    In an xdist worker, whose output nobody sees, it goes to the controller, which prints it
    when the worker finishes (`pytest_testnodedown` below)."""
    worker_output = getattr(request.config, "workeroutput", None)
    if worker_output is not None:
        worker_output.setdefault("turnrl_summaries", []).append(text)
        return
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(text)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """xdist's controller: print the summaries a finished worker collected."""
    reporter = node.config.pluginmanager.get_plugin("terminalreporter")
    for text in getattr(node, "workeroutput", {}).get("turnrl_summaries", []):
        reporter.write_line(text)


def train_two_steps(model_dir, tmp_path, env: dict, algorithm: dict, resume: bool = False, **sections) -> list[dict]:
    """Two steps of the training loop on the real stack (Ray actors, DeepSpeed, vLLM) for a
    small config (`sections` update its sections, e.g. train={"lr": 1e-2}); the training rows
    are the preprocess stage's. `resume`: step 1 in one run, which checkpoints, then step 2 in
    a second one (a new Ray, new actors, new environments) resumed from that checkpoint."""
    import ray

    from turnrl.config import Config
    from turnrl.pipeline.preprocess import load_split, preprocess
    from turnrl.training.checkpoint import CheckpointStore, run_fingerprint
    from turnrl.training.loop import train
    data = {"env": env, "algorithm": algorithm,
            "data": {"train_examples": 32, "heldout_examples": 8}, "eval": {"benchmarks": []},
            "train": {"steps": 2, "prompts_per_step": 4}, "rollout": {"n": 2, "max_tokens_per_turn": 16}}
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    cfg = Config.model_validate(data)
    preprocess(cfg, tmp_path / "data")
    rows, heldout = load_split(tmp_path / "data", "train"), load_split(tmp_path / "data", "heldout")

    def run(run_cfg, store=None, at=None) -> list[dict]:
        try:
            return train(run_cfg, str(model_dir), str(tmp_path / "data"), rows, str(tmp_path / "final"),
                         checkpoints=store, resume=at, heldout_rows=heldout)
        finally:
            ray.shutdown()
    if not resume:
        history = run(cfg)
    else:
        store = CheckpointStore(tmp_path / "checkpoints", run_fingerprint(cfg, [model_dir]))
        run(cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": 1})}), store)
        at = store.resumable(cfg.train.steps)
        assert at is not None and at.step == 1, "no checkpoint of step 1 to resume from"
        history = run(cfg, store, at)
    assert [h["step"] for h in history] == [1, 2]
    return history


def local_ray(num_cpus: int):
    """A local Ray whose workers import the tests' own modules (fakes defined in tests/) and
    turnrl from src/: a generator for a fixture to yield from (shut down after)."""
    import ray
    before = os.environ.get("PYTHONPATH")
    here = Path(__file__).resolve().parent
    os.environ["PYTHONPATH"] = os.pathsep.join([str(here), str(here.parent / "src"), *filter(None, [before])])
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    try:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    yield
    ray.shutdown()
