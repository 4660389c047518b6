"""The pipeline's stage logic, one module per DVC stage (the scripts in stages/ are thin)."""
