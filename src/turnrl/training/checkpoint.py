"""Resumable training checkpoints: complete folders under `train.checkpoint_dir`, or none.

    checkpoints/
      step_000010/             a complete checkpoint (it got this name only once whole)
        state.json             step, data position, MLflow run id, fingerprint, metrics so far
        policy/                DeepSpeed's save_checkpoint: weights, optimizer and scheduler
                               state, one shard per ZeRO rank
        critic/                the same for PPO's critic
        rng_policy_rank0.pt    each trainer rank's python, numpy and torch generator states
      .partial-step_000020/    being written; ignored and removed by the next run

Atomic: a checkpoint is written into a `.partial-` folder, flushed to disk, then renamed to
`step_N` (a rename within one folder is atomic), and only then are older ones pruned. A crash
at any moment leaves only complete checkpoints under a `step_` name.

Rollouts need no generator state: each step seeds its sampling from (seed, step) alone
(`step_seed`), so a resumed run samples what an uninterrupted one would have.

When a run resumes: the newest complete checkpoint whose fingerprint matches the run's and
whose step is at most `train.steps`. The run fingerprint (`run_fingerprint`) hashes every params key that shapes
what training computes (all of seed, model, data, env, algorithm, rollout, train except the
keys in `NOT_SHAPING`: how long it runs, how often and where it saves or logs, what the health
checks watch for and do; plus
`cluster.trainer_ranks` and `cluster.rollout_engines`) and the content
of the training inputs (the initial model, the training split). So `train.steps` may grow (a
finished 40-step run continues to 60), while a different lr, seed or data starts afresh and
removes the checkpoints of the other configuration.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from turnrl.config import Config

log = logging.getLogger(__name__)

SHAPING_SECTIONS = ("seed", "model", "data", "env", "levels", "reward", "algorithm", "rollout", "train")
#: Cluster keys that change the result: the ZeRO partitioning and each engine's share of prompts.
SHAPING_CLUSTER = frozenset({"cluster.trainer_ranks", "cluster.rollout_engines"})
#: Keys of those sections that do not change what training computes.
NOT_SHAPING = frozenset({"train.steps", "train.checkpoint_every", "train.keep_checkpoints",
                         "train.checkpoint_dir", "train.samples_logged_every", "env.workers",
                         "env.max_error_fraction", "train.on_unhealthy", "train.eval_every",
                         "train.eval_examples", "rollout.engine_timeout_s"})
#: Key prefixes that do not change it either: the health checks only watch.
NOT_SHAPING_PREFIXES = ("train.health.",)
STATE_FILE = "state.json"
_NAME = re.compile(r"^step_(\d+)$")


def shaping_params(cfg: Config) -> dict[str, Any]:
    """The params that a resumed run must share with the checkpoint's run."""
    return {k: v for k, v in cfg.flat().items()
            if (k.split(".")[0] in SHAPING_SECTIONS and k not in NOT_SHAPING and not k.startswith(NOT_SHAPING_PREFIXES))
            or k in SHAPING_CLUSTER}


def run_fingerprint(cfg: Config, inputs: Iterable[Path] = ()) -> str:
    """sha256 of the shaping params and the content of `inputs` (files, or folders walked in
    name order), shortened to 16 hex digits."""
    digest = hashlib.sha256(json.dumps(shaping_params(cfg), sort_keys=True).encode())
    for root in inputs:
        root = Path(root)
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
        for path in files:
            digest.update(str(path.relative_to(root) if root.is_dir() else path.name).encode())
            with path.open("rb") as f:
                digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()[:16]


def step_seed(seed: int, step: int, stream: int | str = 0) -> int:
    """The generator seed of one random stream at one step (rollout engine i: stream i; the
    trainers' mini-batch order: a name): a function of these alone."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{step}:{stream}".encode()).digest()[:4], "little") & 0x7FFFFFFF


class DamagedCheckpoint(RuntimeError):
    """The checkpoint a run resumes from could not be loaded (a file cut short, edited, or of
    another DeepSpeed layout): the message names the folder and what to delete."""


@dataclass
class Resume:
    """A checkpoint to continue from."""
    path: Path
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])

    @property
    def mlflow_run_id(self) -> str | None:
        return self.state.get("mlflow_run_id")


class CheckpointStore:
    """The checkpoints of one training configuration (its `run_fingerprint`, kept as `fingerprint`) in `root`."""

    def __init__(self, root: str | Path, fingerprint: str, keep: int = 2, params: dict[str, Any] | None = None):
        """`params`: the shaping params the fingerprint hashes, kept in state.json so that a
        checkpoint of another configuration can say which of them differ."""
        self.root, self.fingerprint, self.keep = Path(root).resolve(), fingerprint, keep
        self.params = json.loads(json.dumps(params)) if params is not None else None   # as state.json reads back

    def complete(self) -> list[tuple[int, Path]]:
        """(step, folder) of every complete checkpoint, oldest first."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
        return sorted(found)

    def read_state(self, folder: Path) -> dict[str, Any] | None:
        try:
            return json.loads((folder / STATE_FILE).read_text())
        except (OSError, ValueError) as exc:
            log.warning("checkpoint %s is unreadable (%s); skipping it", folder, exc)
            return None

    def resumable(self, max_step: int) -> Resume | None:
        """The newest checkpoint of this configuration at step <= max_step, or None (and why)."""
        for step, folder in reversed(self.complete()):
            state = self.read_state(folder)
            if state is None:
                continue
            if state.get("fingerprint") != self.fingerprint:
                log.warning("checkpoint %s is from another configuration (%s): not resuming from it; a run that "
                            "starts afresh removes it", folder.name, self.difference(state))
                continue
            if step > max_step:
                log.info("checkpoint %s is past train.steps = %d: not resuming from it", folder.name, max_step)
                continue
            return Resume(folder, state)
        return None

    def difference(self, state: dict[str, Any]) -> str:
        """What differs between this configuration and a checkpoint's state, in words."""
        theirs = state.get("params")
        if not isinstance(theirs, dict) or self.params is None:
            return f"fingerprint {state.get('fingerprint')}, this run {self.fingerprint}"
        changed = [f"{k} {theirs.get(k)!r} -> {self.params.get(k)!r}" for k in sorted({*theirs, *self.params})
                   if theirs.get(k) != self.params.get(k)]
        if not changed:
            return "the same params; its model, data or another input differs"
        return ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")

    def discard_all(self) -> None:
        """Remove every checkpoint (a run that starts afresh: they belong to another config)."""
        for _, folder in self.complete():
            log.warning("removing checkpoint %s (a fresh run does not continue it)", folder)
            shutil.rmtree(folder)
        self._remove_partials()

    def _remove_partials(self) -> None:
        if self.root.is_dir():
            for partial in self.root.glob(".partial-*"):
                shutil.rmtree(partial, ignore_errors=True)

    @contextlib.contextmanager
    def writing(self, step: int) -> Iterator[Path]:
        """A folder to write the checkpoint of `step` into; when the block ends without an
        error it is flushed, renamed into place and older checkpoints pruned. `state.json`
        must be written into it (it is what makes the folder readable as a checkpoint)."""
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_partials()
        partial = self.root / f".partial-step_{step:06d}"
        partial.mkdir()
        try:
            yield partial
            if not (partial / STATE_FILE).exists():
                raise RuntimeError(f"checkpoint of step {step} written without {STATE_FILE}")
            _fsync_tree(partial)
            final = self.root / f"step_{step:06d}"
            if final.exists():           # e.g. written again after a resume at this step
                shutil.rmtree(final)
            partial.rename(final)
            _fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        for _, old in self.complete()[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint saved at step %d: %s", step, final)


def write_state(folder: Path, state: dict[str, Any]) -> None:
    (folder / STATE_FILE).write_text(json.dumps(state, indent=1))


def _fsync_tree(folder: Path) -> None:
    """Flush every file and folder under `folder` to disk (a power cut, not only a kill)."""
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    for path in [folder, *(p for p in folder.rglob("*") if p.is_dir())]:
        _fsync_dir(path)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
