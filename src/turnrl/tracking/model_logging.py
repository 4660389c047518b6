"""The final policy as an MLflow model (a copy, or a reference to its folder by content
digest, `folder_digest`) and, with `tracking.register_model`, a Model Registry version of it."""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from turnrl.tracking.runs import StageRun

FOLDER_DIGEST_TAG = "turnrl.model_fingerprint"   # the tag's name as runs already logged carry it
log = logging.getLogger(__name__)


def folder_digest(folder: str | Path) -> str:
    """sha256 over a folder's files (relative paths and contents): which weights these are."""
    digest = hashlib.sha256()
    root = Path(folder)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                digest.update(chunk)
    return digest.hexdigest()


def model_requirements() -> list[str]:
    """What loading the policy needs, pinned to this environment (given explicitly: the
    transformers flavor's default adds torchvision and imports it, and setup.sh removes it)."""
    import importlib.metadata as md
    out = []
    for package in ("transformers", "torch", "tokenizers", "safetensors", "accelerate"):
        try:
            out.append(f"{package}=={md.version(package).split('+')[0]}")
        except md.PackageNotFoundError:
            continue
    return out


def _folder_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20


class _ReferenceFlavor:
    """Writes a transformers-flavor MLflow model whose weights stay in `folder`: the flavor's
    hub reference (source_model_name, source_model_revision) names the local folder and its
    content digest, so `mlflow.transformers.load_model` reads the folder itself."""

    def __init__(self, folder: Path, revision: str) -> None:
        self.folder, self.revision = folder.resolve(), revision

    def save_model(self, path: str, mlflow_model, **_: Any) -> None:
        import transformers
        import yaml
        from mlflow.models import Model  # noqa: F401
        from mlflow.pyfunc import add_to_model
        from mlflow.utils.environment import _mlflow_conda_env, _PythonEnv
        from transformers import AutoTokenizer

        os.makedirs(path, exist_ok=True)
        config = json.loads((self.folder / "config.json").read_text())
        tokenizer = AutoTokenizer.from_pretrained(self.folder)
        requirements = model_requirements()
        mlflow_model.add_flavor(
            "transformers", transformers_version=transformers.__version__, code=None, components=["tokenizer"],
            instance_type="TextGenerationPipeline", pipeline_model_type=(config.get("architectures") or ["?"])[0],
            source_model_name=str(self.folder), source_model_revision=self.revision, task="text-generation",
            tokenizer_type=type(tokenizer).__name__, tokenizer_name=str(self.folder),
            tokenizer_revision=self.revision)
        add_to_model(mlflow_model, loader_module="mlflow.transformers", conda_env="conda.yaml",
                     python_env="python_env.yaml")
        Path(path, "requirements.txt").write_text("\n".join(requirements) + "\n")
        Path(path, "conda.yaml").write_text(yaml.safe_dump(_mlflow_conda_env(additional_pip_deps=requirements)))
        _PythonEnv.current().to_yaml(str(Path(path, "python_env.yaml")))
        Path(path, "README.md").write_text(
            f"turnrl policy: a reference to {self.folder} (content sha256 {self.revision}); the weights are not "
            "copied. `dvc checkout` of the commit that produced it restores the folder.\n")
        mlflow_model.save(str(Path(path, "MLmodel")))


def log_policy(run: StageRun, folder: str | Path, *, name: str = "policy") -> str | None:
    """The final policy in `folder` (a Hugging Face folder) as an MLflow transformers model of
    the stage run, tagged with its content digest: a copy when it is at most
    `tracking.model_copy_max_mb`, else a reference to the folder (path and digest).
    Returns the model's id (None when not recorded). Loadable with
    `mlflow.transformers.load_model(f"models:/{model_id}", return_type="components")`."""
    cfg = run.cfg
    folder = Path(folder)
    if not cfg.tracking.log_model or not (folder / "config.json").exists():
        return None
    revision = folder_digest(folder)
    size_mb = _folder_mb(folder)
    copy = size_mb <= cfg.tracking.model_copy_max_mb
    tags = {FOLDER_DIGEST_TAG: revision, "turnrl.env": cfg.env.name, "turnrl.algorithm": cfg.algorithm.name,
            "turnrl.storage": "copy" if copy else f"reference to {folder.resolve()}",
            "turnrl.size_mb": f"{size_mb:.1f}"}

    def log_it():
        import mlflow
        if copy:
            from huggingface_hub import ModelCard
            from transformers import AutoModelForCausalLM, AutoTokenizer
            # By its absolute path: MLflow looks a model's license up on the Hub by its name_or_path,
            # and a relative "models/final" reads as a repo id (five retried requests, ~25 s offline)
            model = AutoModelForCausalLM.from_pretrained(folder.resolve())
            tokenizer = AutoTokenizer.from_pretrained(folder.resolve())
            card = ModelCard(f"---\nlicense: other\n---\n# turnrl policy\n\n{cfg.algorithm.name} on {cfg.env.name}, "
                             f"{cfg.train.steps} steps, from {cfg.model.path}.\n")
            quiet = logging.getLogger("mlflow.transformers")
            level, quiet.level = quiet.level, logging.ERROR   # "Unable to find license information": it is ours
            try:
                info = mlflow.transformers.log_model({"model": model, "tokenizer": tokenizer}, name=name,
                                                     task="text-generation", pip_requirements=model_requirements(),
                                                     model_card=card, tags=tags)
            finally:
                quiet.setLevel(level)
        else:
            from mlflow.models import Model
            info = Model.log(artifact_path=None, name=name, flavor=_ReferenceFlavor(folder, revision),
                             run_id=run.run_id, tags=tags)
        mlflow.set_tag(FOLDER_DIGEST_TAG, revision)
        return info.model_id

    return run.recorder.now("model", f"the {name} model ({'copy' if copy else 'reference'}, {size_mb:.0f} MB)",
                            log_it)


def register_policy(run: StageRun, folder: str | Path, baseline: dict, final: dict) -> Any:
    """With `tracking.register_model: NAME`: the logged model whose folder digest is `folder`'s
    becomes a new version of NAME, tagged with environment, algorithm and headline accuracy."""
    cfg = run.cfg
    name = cfg.tracking.register_model
    if not name:
        return None
    revision = folder_digest(folder)

    def register():
        import mlflow
        found = mlflow.search_logged_models(experiment_ids=[run.experiment_id],
                                            filter_string=f"tags.`{FOLDER_DIGEST_TAG}` = '{revision}'",
                                            order_by=[{"field_name": "creation_time", "ascending": False}],
                                            max_results=1, output_format="list")
        if not found:
            log.warning("tracking.register_model %s: no logged model of %s (folder digest %s) in experiment %s; "
                        "was tracking.log_model off when it was trained?", name, folder, revision[:12],
                        cfg.tracking.experiment)
            return None
        tags = {"env": cfg.env.name, "algorithm": cfg.algorithm.name, "model.path": cfg.model.path,
                "pipeline_run": run.parent_id, "eval_run": run.run_id, "fingerprint": revision}
        for bench, block in final.items():
            if isinstance(block, dict) and isinstance(block.get("accuracy"), (int, float)):
                tags[f"accuracy.{bench}"] = f"{block['accuracy']:.4f}"
                base = (baseline.get(bench) or {}).get("accuracy")
                if isinstance(base, (int, float)):
                    tags[f"accuracy_diff.{bench}"] = f"{block['accuracy'] - base:+.4f}"
        headline = "task" if "task" in final else next(iter(final), None)
        if headline and f"accuracy.{headline}" in tags:
            tags["accuracy"] = tags[f"accuracy.{headline}"]
        version = mlflow.register_model(f"models:/{found[0].model_id}", name, tags=tags)
        log.info("registered %s version %s (%s)", name, version.version, f"models:/{name}/{version.version}")
        mlflow.set_tag("turnrl.registered_model", f"{name}/{version.version}")
        return version

    return run.recorder.now("registry", f"version of {name}", register)
