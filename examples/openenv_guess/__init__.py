"""An OpenEnv environment (openenv-core) served by the library's own server: see env.py."""
