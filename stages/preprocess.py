"""DVC stage `preprocess`: synthetic splits and benchmarks to data/processed/ (parquet)."""
from pathlib import Path

from turnrl.stage import run_stage

OUT = Path("data/processed")


def main(cfg):
    import mlflow

    from turnrl.preprocess import preprocess
    manifest = preprocess(cfg, OUT)
    mlflow.log_dict(manifest, "manifest.json")
    mlflow.log_metrics({f"{k}_n": v["n"] for k, v in manifest.items() if v.get("n") is not None})
    mlflow.log_metric("bad_rows_dropped", manifest["bad_rows"]["dropped"])


if __name__ == "__main__":
    run_stage("preprocess", main)
