"""Performance harness: turnrl against TRL on the same work (see run.py)."""
