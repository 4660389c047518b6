"""What a stage records besides metrics, queued on its Recorder: files and folders as
artifacts, dicts and tables, and its data sets as run inputs (digest: the file's DVC md5)."""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from turnrl.tracking.runs import project_root

if TYPE_CHECKING:
    from turnrl.tracking.runs import StageRun

log = logging.getLogger(__name__)


def log_artifacts(run: StageRun, local: str | Path, artifact_path: str | None = None) -> None:
    """A file or folder as artifacts of the stage run (queued)."""
    local = Path(local)
    if not local.exists():
        return
    what = f"{artifact_path}/{local.name}" if artifact_path else local.name
    if local.is_dir():
        run.recorder.submit("artifacts", what, lambda c: c.log_artifacts(run.run_id, str(local), artifact_path))
    else:
        run.recorder.submit("artifacts", what, lambda c: c.log_artifact(run.run_id, str(local), artifact_path))


def log_dict(run: StageRun, data: Any, name: str) -> None:
    run.recorder.submit("artifacts", name, lambda c: c.log_dict(run.run_id, data, name))


def log_table(run: StageRun, data: Any, name: str) -> None:
    """A table artifact (queued); `data` may be a function making it (called by the Recorder's thread)."""
    run.recorder.submit("artifacts", name, lambda c: c.log_table(run.run_id, data() if callable(data) else data, name))


# --------------------------------------------------------------------------- data sets
def dvc_out_md5(path: str | Path, root: str | Path | None = None) -> str | None:
    """The md5 dvc.lock records for the out holding `path` (a file or a `.dir` folder), if any."""
    import yaml
    lock = Path(root or project_root()) / "dvc.lock"
    if not lock.exists():
        return None
    try:
        stages = (yaml.safe_load(lock.read_text()) or {}).get("stages", {})
    except Exception:
        return None
    target = Path(path).as_posix()
    for stage in stages.values():
        for out in stage.get("outs", []) or []:
            p = str(out.get("path", ""))
            if target == p or target.startswith(p.rstrip("/") + "/"):
                return out.get("md5")
    return None


def file_md5(path: str | Path) -> str:
    """md5 of a file's content: what DVC records for it (in an out's `.dir` listing)."""
    digest = hashlib.md5()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def log_datasets(run: StageRun, sets: dict[str, tuple[str | Path, str]], parent: bool = True) -> None:
    """Data sets as run inputs: {name: (parquet path, context)}, context e.g. `training`,
    `evaluation`. Each is an MLflow dataset whose digest is the file's DVC md5, its source the
    file, tagged with the DVC out's md5 (`dvc.out_md5`, from dvc.lock) and the context; on the
    stage run and (`parent`) on the pipeline's parent run."""
    import mlflow
    import pandas as pd
    from mlflow.entities import DatasetInput, InputTag

    inputs = []
    for name, (path, context) in sets.items():
        path = Path(path)
        if not path.exists():
            continue
        try:
            frame = pd.read_parquet(path)
            digest = file_md5(path)
            dataset = mlflow.data.from_pandas(frame, source=path.resolve().as_uri(), name=name, digest=digest[:36])
            tags = [InputTag("mlflow.data.context", context), InputTag("dvc.md5", digest)]
            out = dvc_out_md5(path)
            if out:
                tags.append(InputTag("dvc.out_md5", out))
            inputs.append(DatasetInput(dataset._to_mlflow_entity(), tags=tags))
        except Exception as exc:   # noqa: BLE001 - an unreadable file is the stage's problem, not tracking's
            log.warning("data set %s (%s) not logged to MLflow: %s", name, path, exc)
    if not inputs:
        return
    names = ", ".join(sets)
    run.recorder.submit("datasets", names, lambda c: c.log_inputs(run.run_id, datasets=inputs))
    if parent:
        run.recorder.submit("datasets", names, lambda c: c.log_inputs(run.parent_id, datasets=inputs))
