"""Moved to :mod:`turnrl.training.folders` (the trainer reads it, and the trainer sits below the
models package); the names stay importable from here for scripts that import them."""
from turnrl.training.folders import high_level_folder, model_dir

__all__ = ["high_level_folder", "model_dir"]
