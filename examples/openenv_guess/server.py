"""The guessing game behind openenv-core's own FastAPI server: `uvicorn examples.openenv_guess.server:app`."""
from openenv.core.env_server import create_app

from examples.openenv_guess.env import GuessAction, GuessEnvironment, GuessObservation

# one session per concurrent trajectory of a rollout worker (rollout.n x train.prompts_per_step)
app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="openenv_guess", max_concurrent_envs=256)
