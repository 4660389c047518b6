"""The registered data sets (:data:`DATASETS`) and where each is found: a data directory
(``$TURNRL_DATA_DIR``) or the Hugging Face hub. Loading them is :func:`turnrl.data.sources.load`."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from turnrl.data.files import DataSourceError
from turnrl.errors import one_line

#: Environment variable naming the local data directory (e.g. ``../shared/data``).
ENV_VAR = "TURNRL_DATA_DIR"

_FILE_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".parquet")


# --------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class DatasetSpec:
    """Where a data set lives and how its fields map to the schema.

    ``set_dir``/``file``: location under the data directory. ``fields``: schema field -> source
    field. ``answer_transform``: a name in :data:`ANSWER_TRANSFORMS` applied to ``answer`` and
    each of ``answers``. ``hub_*``: the Hugging Face copy (``hub_fields`` when its columns are
    named differently from the local file); ``hub_id=None`` means there is no usable hub copy and
    ``hub_note`` says where to get the file instead.
    """

    name: str
    set_dir: str
    file: str
    fields: Mapping[str, str]
    answer_transform: str | None = None
    hub_id: str | None = None
    hub_config: str | None = None
    hub_split: str = "train"
    hub_fields: Mapping[str, str] | None = None
    hub_note: str = ""
    description: str = ""

    @property
    def relpath(self) -> str:
        return f"{self.set_dir}/{self.file}"


def _spec(**kw: Any) -> DatasetSpec:
    kw["fields"] = MappingProxyType(dict(kw["fields"]))
    if kw.get("hub_fields") is not None:
        kw["hub_fields"] = MappingProxyType(dict(kw["hub_fields"]))
    return DatasetSpec(**kw)


_MATH_FIELDS = {"prompt": "problem", "answer": "answer"}
_GSM8K_FIELDS = {"prompt": "question", "answer": "answer"}

#: The registry: data set name -> :class:`DatasetSpec`.
DATASETS: Mapping[str, DatasetSpec] = MappingProxyType(
    {
        s.name: s
        for s in (
            _spec(
                name="math500",
                set_dir="math500",
                file="test.jsonl",
                fields={"id": "unique_id", **_MATH_FIELDS, "subject": "subject", "level": "level"},
                answer_transform="strip",
                hub_id="HuggingFaceH4/MATH-500",
                hub_split="test",
                description="MATH-500 (PRM800K test split), 500 problems, 7 subjects, levels 1-5",
            ),
            _spec(
                name="gsm8k_train",
                set_dir="gsm8k",
                file="train.jsonl",
                fields=_GSM8K_FIELDS,
                answer_transform="gsm8k",
                hub_id="openai/gsm8k",
                hub_config="main",
                hub_split="train",
                description="GSM8K train, 7473 problems",
            ),
            _spec(
                name="gsm8k_test",
                set_dir="gsm8k",
                file="test.jsonl",
                fields=_GSM8K_FIELDS,
                answer_transform="gsm8k",
                hub_id="openai/gsm8k",
                hub_config="main",
                hub_split="test",
                description="GSM8K test, 1319 problems",
            ),
            _spec(
                name="aime24",
                set_dir="aime24",
                file="test.jsonl",
                fields={"id": "id", **_MATH_FIELDS},
                answer_transform="number",
                hub_id="HuggingFaceH4/aime_2024",
                hub_split="train",
                description="AIME 2024, 30 problems",
            ),
            _spec(
                name="aime25",
                set_dir="aime25",
                file="test.jsonl",
                fields={"id": "id", **_MATH_FIELDS},
                answer_transform="number",
                hub_id="math-ai/aime25",
                hub_split="test",
                description="AIME 2025, 30 problems (integer answers)",
            ),
            _spec(
                name="amc23",
                set_dir="amc23",
                file="test.jsonl",
                fields={"id": "id", "prompt": "question", "answer": "answer"},
                answer_transform="number",
                hub_id="math-ai/amc23",
                hub_split="test",
                description="AMC 2023, 40 problems",
            ),
            _spec(
                name="nq_open",
                set_dir="nq_lost_in_middle",
                file="nq-open-oracle.jsonl.gz",
                fields={"prompt": "question", "answers": "answers", "passages": "ctxs"},
                answer_transform="strip",
                hub_id=None,
                hub_note=(
                    "no hub copy carries the gold passages: download qa_data/nq-open-oracle.jsonl.gz "
                    "from https://github.com/nelson-liu/lost-in-the-middle"
                ),
                description="NQ-open with its gold Wikipedia passage (ctxs[0]), 2655 questions",
            ),
            _spec(
                name="limo",
                set_dir="limo",
                file="train.jsonl",
                fields={"prompt": "question", "answer": "answer"},
                answer_transform="strip",
                hub_id="GAIR/LIMO",
                hub_split="train",
                description="LIMO training problems (question, solution, answer)",
            ),
            _spec(
                name="openr1_math",
                set_dir="openr1_math",
                file="train.jsonl",
                fields={"prompt": "problem", "answer": "answer"},
                answer_transform="strip",
                hub_id="open-r1/OpenR1-Math-220k",
                hub_split="train",
                description="OpenR1-Math-220k training problems (problem, solution, answer)",
            ),
        )
    }
)


# --------------------------------------------------------------------------- resolution
def _data_dir(data_dir: str | os.PathLike[str] | None) -> Path | None:
    if data_dir is not None and str(data_dir):
        return Path(data_dir).expanduser()
    env = os.environ.get(ENV_VAR, "").strip()
    return Path(env).expanduser() if env else None


def _candidates(directory: Path, file: str) -> list[Path]:
    stem = file
    for suf in sorted(_FILE_SUFFIXES, key=len, reverse=True):
        if stem.endswith(suf):
            stem = stem[: -len(suf)]
            break
    out = [directory / file]
    out += [directory / (stem + s) for s in _FILE_SUFFIXES if stem + s != file]
    return out


def resolve_local_path(name: str, data_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """The local file of registered set ``name`` under ``data_dir`` / ``$TURNRL_DATA_DIR``, or None."""
    spec = _lookup(name, None)
    base = _data_dir(data_dir)
    if base is None:
        return None
    for p in _candidates(base / spec.set_dir, spec.file):
        if p.is_file():
            return p
    return None


def _lookup(name: str, split: str | None) -> DatasetSpec:
    """The spec for ``name``; ``split`` selects ``<name>_<split>`` (``gsm8k`` + ``test``)."""
    if split:
        if f"{name}_{split}" in DATASETS:
            return DATASETS[f"{name}_{split}"]
        spec = DATASETS.get(name)
        if spec is not None and split in (spec.hub_split, spec.file.split(".")[0], name.rsplit("_", 1)[-1]):
            return spec
        raise DataSourceError(
            f"data set {name!r} has no split {split!r}; registered names: {', '.join(sorted(DATASETS))}"
        )
    if name in DATASETS:
        return DATASETS[name]
    raise DataSourceError(
        f"unknown data set {name!r}: use a registered name ({', '.join(sorted(DATASETS))}) "
        "or a path to a .jsonl/.jsonl.gz/.json/.parquet file with fields={'prompt': ..., 'answer': ...}"
    )


def _load_hub(spec: DatasetSpec) -> tuple[Iterable[tuple[int, Any]] | None, str]:
    """Records from the hub, or (None, why not). Never raises."""
    if spec.hub_id is None:
        return None, spec.hub_note or "no hub copy"
    try:
        import datasets  # optional dependency
    except Exception as exc:  # ImportError, or a broken install
        return None, f"the `datasets` package is not importable ({type(exc).__name__})"
    try:
        ds = datasets.load_dataset(spec.hub_id, spec.hub_config, split=spec.hub_split)
        records = [(i, dict(r)) for i, r in enumerate(ds, start=1)]
    except BaseException as exc:  # noqa: BLE001 - offline, auth, renamed repo, ... all mean "not reachable"
        if isinstance(exc, KeyboardInterrupt):
            raise
        return None, one_line(exc)
    return records, ""


def _missing_error(spec: DatasetSpec, params_key: str, base: Path | None, hub_why: str) -> DataSourceError:
    looked = (
        f"looked for {base / spec.relpath} (and .jsonl/.jsonl.gz/.json/.parquet variants): not found"
        if base is not None
        else f"${ENV_VAR} is not set"
    )
    if spec.hub_id:
        hub = (
            f"the Hugging Face hub: {spec.hub_id}"
            + (f" (config {spec.hub_config})" if spec.hub_config else "")
            + f", split {spec.hub_split!r}; needs `pip install datasets` and network access"
            + (f" [tried: {hub_why}]" if hub_why else "")
        )
    else:
        hub = f"the Hugging Face hub: not available for this set ({spec.hub_note})"
    return DataSourceError(
        f"data set {spec.name!r} not found. Provide it in one of three ways:\n"
        f"  1. an explicit path: set `{params_key}` in params.yaml (or pass path=...) to a "
        f".jsonl/.parquet file;\n"
        f"  2. a data directory: export {ENV_VAR}=<dir> so that <dir>/{spec.relpath} exists "
        f"(e.g. {ENV_VAR}=../shared/data) [{looked}];\n"
        f"  3. {hub}."
    )
