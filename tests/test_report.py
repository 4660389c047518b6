"""The report after `eval`: Markdown and PNGs comparing two evaluations, readable offline."""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from turnrl.data.sources import write_parquet
from turnrl.pipeline.report import main, render

ROOT = Path(__file__).resolve().parents[1]
SUBJECTS = ["Algebra", "Counting & Probability", "Geometry", "Intermediate Algebra", "Number Theory",
            "Prealgebra", "Precalculus"]


def _metrics(acc: float, tokens: float) -> dict:
    task = {"accuracy": acc, "n": 4, "correct": int(4 * acc), "pass_at_1": acc, "mean_response_tokens": tokens,
            "tokens_per_correct": tokens / acc if acc else None, "mean_turns": 2.0, "protocol": "multi",
            "env": "code_tool", "max_turns": 3, "max_tokens": 160, "temperature": 1.0, "top_p": 1.0,
            "samples_per_problem": 1, "seed": 0, "accuracy_greedy": acc, "mean_response_tokens_greedy": tokens}
    math500 = {"available": True, **{k: v for k, v in task.items() if not k.endswith("_greedy")},
               "n": 500, "protocol": "single", "env": "math_answer", "max_turns": 1, "max_tokens": 96,
               "by_subject": {s: {"accuracy": acc, "n": 70} for s in SUBJECTS},
               "by_level": {str(level): {"accuracy": acc / level, "n": 100} for level in range(1, 6)}}
    aime24 = {"available": False, "reason": "data set 'aime24' not found: set TURNRL_DATA_DIR", "accuracy": None,
              "n": 0, "mean_response_tokens": None, "protocol": "single"}
    return {"task": task, "math500": math500, "aime24": aime24}


def _gens(folder: Path, right: list[bool]) -> None:
    write_parquet([{"benchmark": "task", "id": f"p{i}", "sample": 0, "prompt": f"Compute {i} * 3.", "answer": str(3 * i),
                    "trajectory": "<answer>x</answer>", "extracted": str(3 * i) if ok else "7", "correct": ok,
                    "reason": "equivalent to reference" if ok else f"not equivalent: got 7, expected {3 * i}",
                    "reward": float(ok), "finish": "answer", "turns": 1, "tokens": 5,
                    "decoding": "temperature=1.0,top_p=1.0"} for i, ok in enumerate(right)], folder / "task.parquet")


def _images(md: str) -> list[str]:
    return re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)


def test_report_renders_with_images_that_exist(tmp_path):
    _gens(tmp_path / "gb", [True, False, False, False])
    _gens(tmp_path / "gt", [True, True, True, False])
    (tmp_path / "train.csv").write_text("step,reward_mean,accuracy,response_tokens_mean,kl_ref\n"
                                        "1,0.1,0.1,20,0.0\n2,0.3,0.3,22,0.01\n3,0.5,0.5,25,0.02\n")
    path = render(_metrics(0.25, 40.0), _metrics(0.75, 30.0), tmp_path / "report",
                  baseline_gens=tmp_path / "gb", trained_gens=tmp_path / "gt", curves=tmp_path / "train.csv")
    md = path.read_text()
    images = _images(md)
    assert set(images) == {"accuracy.png", "efficiency.png", "math500_breakdown.png", "training.png"}
    for name in images:   # relative links to files beside the report: opens offline
        assert (path.parent / name).stat().st_size > 1000 and (path.parent / name).read_bytes()[:4] == b"\x89PNG"
    assert "| `task` | multi | 4 | 25.0% | 75.0% | +50.0 pt |" in md
    assert "| `math500` | single | 500 |" in md
    assert "Not available: data set 'aime24' not found" in md
    for subject in SUBJECTS:
        assert f"| {subject} | 70 | 25.0% | 75.0% | +50.0 pt |" in md
    assert "| 5 | 100 | 5.0% | 15.0% | +10.0 pt |" in md
    assert "protocol **single**, env `math_answer`" in md and "protocol **multi**, env `code_tool`" in md
    assert "**2** better with trained, **0** worse, 2 unchanged" in md
    assert "not equivalent ×3" in md and "3 steps" in md


def test_report_without_generations_or_curves(tmp_path):
    a, b = _metrics(0.0, 50.0), _metrics(0.5, 45.0)
    del a["math500"], b["math500"]
    path = render(a, b, tmp_path / "r")
    md = path.read_text()
    assert set(_images(md)) == {"accuracy.png", "efficiency.png"}
    assert all((path.parent / name).exists() for name in _images(md))
    assert "| `task` | multi | 4 | 0.0% | 50.0% | +50.0 pt |" in md and "## Training" not in md


def test_report_command_compares_any_two_metrics_files(tmp_path, capsys):
    for name, acc in [("a", 0.5), ("b", 0.25)]:
        (tmp_path / f"{name}.json").write_text(json.dumps(_metrics(acc, 10.0)))
    assert main([str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(tmp_path / "out"),
                 "--labels", "qwen", "mine"]) == 0
    md = (tmp_path / "out" / "report.md").read_text()
    assert "accuracy qwen" in md and "| `task` | multi | 4 | 50.0% | 25.0% | -25.0 pt |" in md


def test_report_stage_writes_report_md(tmp_path):
    """stages/report.py as DVC runs it: the pipeline's files in, report/ out (and an MLflow run)."""
    for rel in ["stages/report.py", "params.yaml"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics/baseline.json").write_text(json.dumps(_metrics(0.25, 40.0)))
    (tmp_path / "metrics/eval.json").write_text(json.dumps(_metrics(0.5, 40.0)))
    _gens(tmp_path / "eval/baseline", [True, False, False, False])
    _gens(tmp_path / "eval/final", [True, True, False, False])
    proc = subprocess.run([sys.executable, "stages/report.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={"PATH": str(Path(sys.executable).parent), "HOME": str(tmp_path),
                                            "MLFLOW_DISABLE_TELEMETRY": "true"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    md = (tmp_path / "report/report.md").read_text()
    assert all((tmp_path / "report" / name).exists() for name in _images(md))
    assert "## Training" not in md   # no plots/train.csv: the report says nothing rather than failing
    assert (tmp_path / "mlflow.db").exists()


def test_report_stage_without_the_metrics_fails_clearly(tmp_path):
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    (tmp_path / "stages").mkdir()
    shutil.copy(ROOT / "stages/report.py", tmp_path / "stages/report.py")
    proc = subprocess.run([sys.executable, "stages/report.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={"PATH": str(Path(sys.executable).parent), "HOME": str(tmp_path),
                                            "MLFLOW_DISABLE_TELEMETRY": "true"})
    assert proc.returncode == 2 and "metrics/baseline.json" in proc.stderr


def test_evaluations_of_other_settings_are_not_compared(tmp_path, capsys):
    """Two evaluations of a block on other problems counts, samples or temperatures: no Δ, the
    difference said; a file that is not an evaluation's metrics is one line, exit 2."""
    a, b = _metrics(0.5, 10.0), _metrics(0.25, 10.0)
    b["task"].update(n=6, temperature=1.4)
    for name, m in (("a", a), ("b", b)):
        (tmp_path / f"{name}.json").write_text(json.dumps(m))
    assert main([str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(tmp_path / "out")]) == 0
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| `task` | multi | 6 | 50.0% | 25.0% | not comparable: n 4 vs 6, temperature 1.0 vs 1.4 |" in md
    assert "| `math500` | single | 500 | 50.0% | 25.0% | -25.0 pt |" in md   # the same settings: compared
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "broken.json").write_text("{")
    for bad, said in (("list.json", "not an evaluation's metrics"), ("broken.json", "not JSON"),
                      ("missing.json", "cannot be read")):
        assert main([str(tmp_path / bad), str(tmp_path / "b.json"), "--out", str(tmp_path / "out")]) == 2
        assert f"turnrl report: {tmp_path / bad}: {said}" in capsys.readouterr().err
