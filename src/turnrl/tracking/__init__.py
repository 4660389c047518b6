"""MLflow tracking: one parent run per pipeline run, one child run per stage execution.

Stages run as separate processes under `dvc repro` (or a Prefect flow), so they find their
common parent run by a key: `$TURNRL_PIPELINE_KEY` if set (the Prefect flow sets it to its
flow run id), else the id and start time of the `dvc` process they run under, else their own
process (a stage run by hand gets a parent of its own).

Default store: a sqlite file `mlflow.db` and a folder `mlartifacts/` in the project; see them
with `mlflow ui --backend-store-uri sqlite:///mlflow.db`. `tracking.uri` selects any server; one
that does not answer when a stage starts is replaced by the project's store, with one warning
(`tracking.on_unreachable: local`, the default), or stops the stage in one line (`fail`).

The modules, each imported where it is used (this package re-exports nothing):

- `runs`: `stage_run` (the parent and the stage's nested run, opened on the store), `StageRun`,
  `current_run`, `log_metrics`, `log_parent`, the identifying params and the parent's headline
  accuracies (`headline_metrics`; the description with the report's table is
  turnrl.pipeline.report's `log_headline`), the pipeline key, `tracking_uri`, `run_link`.
- `recorder`: the `Recorder`, which sends from a background thread so training never waits for
  the server; an outage is retried for `tracking.retry_s`, then the stage goes on without it
  (one warning, a count at the end); `mlflow_name` puts metric names in sections.
- `system`: CPU, memory, disk, network and GPU metrics of a stage run (`system/...`).
- `artifacts`: files, dicts and tables as artifacts; data sets as run inputs (DVC md5 digests).
- `model_logging`: the final policy as an MLflow transformers model (a copy, or a reference to
  its folder by content digest) and its Model Registry version.
- `traces`: sampled trajectories as MLflow traces, a span per turn.
- `logs`: `quiet_logs` (vLLM's logging configuration for this process and its Ray actors,
  repeated warnings once, expected ones dropped) and its filters.

Local results (plots/, metrics/, checkpoints/, models/) never depend on the tracking server.
"""
