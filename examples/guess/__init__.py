"""A number-guessing task as a turnrl plugin: an environment, a reward function, training data
and a benchmark file. See docs/plugins.md."""
