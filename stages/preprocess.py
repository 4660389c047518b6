"""DVC stage `preprocess`: synthetic splits and benchmarks to data/processed/ (parquet)."""
from pathlib import Path

from turnrl.pipeline.stage import run_stage

OUT = Path("data/processed")


def main(cfg):
    from turnrl import tracking
    from turnrl.pipeline.preprocess import preprocess
    manifest = preprocess(cfg, OUT)
    run = tracking.current_run()
    tracking.log_dict(run, manifest, "manifest.json")
    tracking.log_metrics({f"data/{k}_n": v["n"] for k, v in manifest.items()
                          if isinstance(v, dict) and v.get("n") is not None})
    tracking.log_metrics({"data/bad_rows_dropped": manifest["bad_rows"]["dropped"]})


if __name__ == "__main__":
    run_stage("preprocess", main)
