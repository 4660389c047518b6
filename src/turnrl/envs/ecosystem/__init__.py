"""The ecosystem adapters: environments of other libraries, run unchanged as turnrl environments.

Each adapter is registered by name in `turnrl.envs` (`env.name: gym_text`, ...) and imports its
library on first use, so turnrl works without any of them (`pip install -e '.[ecosystem]'`
installs the ones that fit beside it):

- `gym_text`: TextArena games (`textarena:<env id>`) and gymnasium-style text games
  (`module:factory`), one player; turnrl.games.textarena plays TextArena's two-player games on
  the same `make_game`.
- `skyrl_gym`: skyrl-gym (SkyRL's) text environments, built as SkyRL's generator builds them.
- `openenv`: OpenEnv (openenv-core) servers (a running one, or one each rollout worker starts
  from a command) and Environment classes in process.
- `verifiers`: verifiers 0.4.0 environments. The library cannot share turnrl's virtualenv, so it
  runs in `.venv-verifiers` behind `verifiers_bridge.py`, a script started by file path with that
  venv's python (JSON lines over stdin/stdout).
- `gem_server.py`: GEM (gem-llm) games served over OpenEnv's protocol for `env.name: openenv`,
  a script started by file path with `.venv-gem`'s python (gem-llm cannot share turnrl's venv
  either).

The two scripts import nothing of turnrl (it is not installed in their venvs) and drop this
folder from `sys.path` first, where `verifiers.py` and `openenv.py` would shadow the libraries of
those names; importing this package imports none of the adapters.

The glue they share lives in one place each:

- `glue`: the import guard (`import_library`, the install hint) and the numeric info filter
  (`numeric_info`, `OWN_INFO_KEYS`). The guard itself is defined in `turnrl.plugins` and
  re-exported by `glue`: reasoning-gym's wrapper (`turnrl.rewards.reasoning_gym`) uses the same
  guard, and turnrl.rewards sits below turnrl.envs (rewards may import plugins, never envs).
  gem_server.py keeps its own copy of `is_number`, for the reason above.
- `turnrl.envs.helpers.Helpers`: the per-process cache of helper processes (verifiers' bridges,
  OpenEnv's servers, and the tool box's MCP sessions outside this package), closed at exit.
"""
