"""DVC stage `preprocess`: synthetic splits and benchmarks to data/processed/ (parquet)."""
from pathlib import Path

from turnrl.pipeline.stage import run_stage

OUT = Path("data/processed")


def main(cfg):
    from turnrl.tracking import artifacts, runs
    from turnrl.pipeline.preprocess import preprocess
    manifest = preprocess(cfg, OUT)
    run = runs.current_run()
    artifacts.log_dict(run, manifest, "manifest.json")
    runs.log_metrics({f"data/{k}_n": v["n"] for k, v in manifest.items()
                      if isinstance(v, dict) and v.get("n") is not None})
    runs.log_metrics({"data/bad_rows_dropped": manifest["bad_rows"]["dropped"]})


if __name__ == "__main__":
    run_stage("preprocess", main)
