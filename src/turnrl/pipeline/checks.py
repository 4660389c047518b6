"""Moved to :mod:`turnrl.config.checks` (`turnrl config` runs them, and the params' package sits
below the pipeline); every name stays importable from here."""
from turnrl.config.checks import *   # noqa: F401,F403
from turnrl.config.checks import InputProblems, all_problems, before_evaluate, require, stage_problems   # noqa: F401
