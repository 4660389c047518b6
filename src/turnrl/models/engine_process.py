"""A rollout engine in a spawned child process (`EngineProcess`), as the model checks use vLLM:
an in-process vLLM engine and a DeepSpeed group do not share a process (vLLM tears
torch.distributed down when it goes). The weights cross in the buffers of `pack_tensors`, as they
cross Ray's object store in training."""
from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path

from turnrl.models.check_report import short_error as _short_error


class EngineProcess:
    """A rollout engine (`make_engine(kind, model_dir, **options)`) in a spawned child process,
    called method by method: generate, prompt_logprobs, load_packed (the packed buckets of
    `PolicyWorker._param_buckets` / `pack_tensors`, unpacked there and handed to the engine's
    `load_weights`, as `RolloutWorker.load_weight_buckets` does). The child's output goes to
    `log_path`."""

    def __init__(self, kind: str, model_dir: str, log_path: str | Path, timeout_s: float = 900, **options):
        import multiprocessing as mp
        self.log_path, self.timeout_s = Path(log_path), timeout_s
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, kind, model_dir, options, str(self.log_path)), daemon=True)
        self.proc.start()
        child.close()
        self.start_seconds = self._receive()   # engine start (raises with the child's error)

    def _receive(self):
        deadline = time.monotonic() + self.timeout_s
        while not self.conn.poll(1.0):
            if not self.proc.is_alive():
                raise EngineError(f"the engine process died (exit code {self.proc.exitcode})", self.log_tail())
            if time.monotonic() > deadline:
                self.close()
                raise EngineError(f"the engine did not answer within {self.timeout_s:.0f} s", self.log_tail())
        ok, value = self.conn.recv()
        if not ok:
            raise EngineError(value, self.log_tail())
        return value

    def call(self, method: str, *args, **kwargs):
        self.conn.send((method, args, kwargs))
        return self._receive()

    def generate(self, prompts, **kwargs):
        return self.call("generate", prompts, **kwargs)

    def prompt_logprobs(self, sequences):
        return self.call("prompt_logprobs", sequences)

    def load_packed(self, buckets: list) -> float:
        return self.call("load_packed", buckets)

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("close", (), {}))
                self.proc.join(30)
            except (OSError, BrokenPipeError):
                pass
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


class EngineError(RuntimeError):
    def __init__(self, message: str, log_tail: str = ""):
        super().__init__(message)
        self.message, self.log_tail = message, log_tail


def _serve(conn, kind: str, model_dir: str, options: dict, log_path: str) -> None:
    """The child: build the engine, then answer calls until "close"."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    try:
        from turnrl.rollout.engines import cpu_env_defaults, make_engine
        for key, value in cpu_env_defaults(options.get("kv_cache_gib", 1.0)).items():
            os.environ.setdefault(key, value)
        start = time.perf_counter()
        if kind == "vllm":
            _check_vllm_architecture(model_dir)
        engine = make_engine(kind, model_dir, **options)
        conn.send((True, time.perf_counter() - start))
    except BaseException as exc:   # noqa: BLE001 - reported to the parent
        conn.send((False, _short_error(exc)))
        return
    from turnrl.training.weight_export import unpack_tensors
    while True:
        method, args, kwargs = conn.recv()
        if method == "close":
            conn.send((True, None))
            return
        try:
            if method == "load_packed":
                start = time.perf_counter()
                engine.load_weights(pair for packed in args[0] for pair in unpack_tensors(packed))
                conn.send((True, time.perf_counter() - start))
            elif method == "reload_from":   # a checkpoint folder through vLLM's own file loader
                from turnrl.rollout.engines import _prepack_cpu_experts_again
                engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": args[0]})
                engine.llm.collective_rpc(_prepack_cpu_experts_again)
                engine.llm.reset_prefix_cache()
                conn.send((True, None))
            else:
                conn.send((True, getattr(engine, method)(*args, **kwargs)))
        except BaseException as exc:   # noqa: BLE001
            traceback.print_exc()
            conn.send((False, _short_error(exc)))


def _check_vllm_architecture(model_dir: str) -> None:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    archs = config.get("architectures") or []
    from vllm import ModelRegistry
    supported = ModelRegistry.get_supported_archs()
    if archs and not any(a in supported for a in archs):
        raise UnsupportedArchitecture(f"vLLM {_vllm_version()} has no implementation of {', '.join(archs)} "
                                      f"(model_type {config.get('model_type')!r})")


class UnsupportedArchitecture(RuntimeError):
    pass


def _vllm_version() -> str:
    import vllm
    return vllm.__version__

