"""Typed params.yaml.

Every key of params.yaml is declared in `sections` (one model per section), with its type, its
allowed values and a short comment. `load_config` (`loading`) validates the whole file before
any heavy work starts and turns pydantic's errors into messages that name the key path, the bad
value and what is allowed:

    params.yaml: train.steps = -3: must be greater than 0
    params.yaml: train.stepz: unknown key (did you mean 'steps'?); keys under 'train': ...

Nothing here imports anything heavy, so a stage fails within a second on a bad value.
"""
from turnrl.config.loading import (add_params_argument, check_plugins, default_params_file, load_config, main,
                                   params_file, parse_config)
from turnrl.config.sections import (
    AlgorithmCfg, BENCHMARKS, BenchmarkCfg, ClusterCfg, Config, ConfigError, DataCfg, EnvCfg, EvalCfg,
    HealthCfg, LORA_EXCLUDED, LevelsCfg, LoraCfg, ModelCfg, RewardCfg, RolloutCfg, TinyModel, TracesCfg,
    TrackingCfg, TrainCfg, WarmStart
)

__all__ = [
    "AlgorithmCfg", "BENCHMARKS", "BenchmarkCfg", "ClusterCfg", "Config", "ConfigError", "DataCfg", "EnvCfg",
    "EvalCfg", "HealthCfg", "LORA_EXCLUDED", "LevelsCfg", "LoraCfg", "ModelCfg", "RewardCfg", "RolloutCfg",
    "TinyModel", "TracesCfg", "TrackingCfg", "TrainCfg", "WarmStart", "add_params_argument", "check_plugins",
    "default_params_file", "load_config", "main", "params_file", "parse_config"
]
