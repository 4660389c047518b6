"""Bad input through the real stage scripts: malformed data rows (fail with file and line, or
dropped and counted, as data.bad_rows says), a model path that points nowhere, and a full disk
while a stage writes its outs. Each gives a message that says what to do, and exit code 2 for
bad input (the Prefect flow does not retry it), 1 for a full disk.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from turnrl.config import Config
from turnrl.pipeline.stage import BAD_INPUT_EXIT, run_stage, write_json

from conftest import ROOT

ROWS_OK = [{"q": f"What is {i} + {i}?", "a": str(2 * i)} for i in range(12)]
BAD_LINES = {  # line number in the file -> (text, the problem the error names)
    3: ('{"q": "What is 1 + 2?", "a": ', "bad JSON line"),
    5: ('{"q": "   ", "a": "4"}', "empty prompt"),
    7: ('{"a": "4"}', "missing field 'q'"),
    9: ('{"q": "What is 3 + 3?", "a": null}', "is null"),
    11: ('{"q": ["What is"], "a": "6"}', "must be a string"),
}


def _project(tmp_path: Path, **data) -> Path:
    """A folder holding a params.yaml with a small preprocess (no benchmarks)."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["data"].update(data)
    params["eval"]["benchmarks"] = []
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    return tmp_path


def _stage(project: Path, script: str, prefix: list[str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "MLFLOW_DISABLE_TELEMETRY": "true",
           "HF_HUB_OFFLINE": "1"}
    return subprocess.run([*(prefix or []), sys.executable, str(ROOT / "stages" / script)], cwd=project,
                          env=env, capture_output=True, text=True, timeout=300)


def _user_file(tmp_path: Path) -> Path:
    lines, ok = [], iter(ROWS_OK)
    for n in range(1, len(ROWS_OK) + len(BAD_LINES) + 1):
        lines.append(BAD_LINES[n][0] if n in BAD_LINES else json.dumps(next(ok)))
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.slow   # a real stage process: MLflow import and run, ~10 s
def test_a_malformed_row_fails_preprocess_with_file_line_and_the_fix(tmp_path):
    path = _user_file(tmp_path)
    project = _project(tmp_path, train_set=str(path), heldout_set=str(path), fields={"prompt": "q", "answer": "a"})
    proc = _stage(project, "preprocess.py")
    assert proc.returncode == BAD_INPUT_EXIT, proc.stderr[-2000:]
    assert f"{path}:3: bad JSON line" in proc.stderr
    assert "data.bad_rows: drop" in proc.stderr          # says how to go on
    assert "Traceback" not in proc.stderr
    assert not (project / "data" / "processed" / "manifest.json").exists()


@pytest.mark.slow   # a real stage process: MLflow import and run, ~10 s
def test_malformed_rows_dropped_and_counted_in_the_manifest_and_log(tmp_path):
    path = _user_file(tmp_path)
    project = _project(tmp_path, train_set=str(path), heldout_set=str(path), heldout_examples=4,
                       fields={"prompt": "q", "answer": "a"}, bad_rows="drop")
    proc = _stage(project, "preprocess.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((project / "data" / "processed" / "manifest.json").read_text())
    bad = manifest["bad_rows"]
    assert bad["policy"] == "drop" and bad["dropped"] == len(BAD_LINES)
    reasons = bad["files"][str(path)]["first"]
    for line, (_, problem) in BAD_LINES.items():
        assert any(r.startswith(f"line {line}: ") and problem in r for r in reasons), (line, reasons)
    assert manifest["train"]["n"] + manifest["heldout"]["n"] == len(ROWS_OK)
    assert f"dropped {len(BAD_LINES)} malformed rows (data.bad_rows: drop)" in proc.stderr


@pytest.mark.slow   # a real stage process: MLflow import and run, ~10 s
def test_a_model_path_pointing_nowhere_says_what_to_do(tmp_path):
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["model"]["path"] = str(tmp_path / "no-such-model")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    proc = _stage(tmp_path, "prepare_model.py")
    assert proc.returncode == BAD_INPUT_EXIT, proc.stderr[-2000:]
    assert "model.path=" in proc.stderr and "no such folder" in proc.stderr
    assert "Hugging Face model folder" in proc.stderr and "'tiny'" in proc.stderr
    assert "Traceback" not in proc.stderr


def _can_mount_tmpfs() -> str:
    if shutil.which("unshare") is None:
        return "no `unshare` command"
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=16k tmpfs /mnt"], capture_output=True, text=True)
    return "" if probe.returncode == 0 else f"cannot mount a tmpfs here: {probe.stderr.strip()}"


@pytest.mark.slow   # a real stage process: MLflow import and run, ~10 s
@pytest.mark.skipif(bool(_can_mount_tmpfs()), reason=f"full-disk test needs a private tmpfs: {_can_mount_tmpfs()}")
def test_a_full_disk_while_writing_the_outs_says_so(tmp_path):
    """preprocess writes data/processed onto a 64 KiB tmpfs (in a private mount namespace)."""
    project = _project(tmp_path, train_examples=4096)
    outs = project / "data" / "processed"
    outs.mkdir(parents=True)
    proc = _stage(project, "preprocess.py",
                  prefix=["unshare", "--mount", "--propagation", "private", "sh", "-c",
                          f"mount -t tmpfs -o size=64k tmpfs {outs} && exec \"$0\" \"$@\""])
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "the disk is full (No space left on device) while writing data/processed/" in proc.stderr
    assert "df -h data/processed" in proc.stderr and "dvc repro preprocess" in proc.stderr
    assert not list(outs.glob("*.tmp"))                   # no half-written file left
    assert "Traceback" not in proc.stderr


def test_disk_full_in_any_stage_body_is_reported_not_a_traceback(tmp_path, monkeypatch, capsys):
    """The handler around every stage body: an ENOSPC from write_json (a stage writing metrics)."""
    (tmp_path / "params.yaml").write_text("seed: 0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TURNRL_PARAMS", str(tmp_path / "params.yaml"))
    from contextlib import nullcontext

    from turnrl.tracking import runs
    monkeypatch.setattr(runs, "stage_run", lambda *args, **kwargs: nullcontext())   # no MLflow here

    def body(cfg: Config) -> None:
        real_write_text = Path.write_text

        def full(self, *args, **kwargs):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        monkeypatch.setattr(Path, "write_text", full)
        try:
            write_json(tmp_path / "metrics" / "train.json", {"steps": 1})
        finally:
            monkeypatch.setattr(Path, "write_text", real_write_text)

    with pytest.raises(SystemExit) as exit_info:
        run_stage("train", body)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert f"the disk is full (No space left on device) while writing {tmp_path / 'metrics' / 'train.json'}" in err
    assert "dvc repro train" in err
    assert not list((tmp_path / "metrics").iterdir())         # no half-written file left


@pytest.mark.slow   # a real stage process, stopped before its MLflow run: ~10 s
def test_a_missing_data_file_stops_the_stage_before_its_mlflow_run(tmp_path):
    """The checks (turnrl.config.checks) run at the stage's start: exit 2, the key and the fix,
    and no MLflow run was opened (no store was even created)."""
    project = _project(tmp_path, train_set="mine.jsonl", heldout_set="mine.jsonl",
                       fields={"prompt": "q", "answer": "a"})
    proc = _stage(project, "preprocess.py")
    assert proc.returncode == BAD_INPUT_EXIT, proc.stderr[-2000:]
    assert f"turnrl preprocess: data.train_set = 'mine.jsonl': no such file (relative to {project}" in proc.stderr
    assert "Traceback" not in proc.stderr and not (project / "mlflow.db").exists()
