"""A reward function for the guessing game, as turnrl's reward.functions calls it."""


def fewer_guesses(prompt: str, completion: str, answer: str, **info) -> float:
    """0.25 x the share of guesses left over when the number was found, else 0: finding it
    in one guess of four earns 0.1875, in four guesses 0."""
    if info.get("outcome", 0.0) <= 0:
        return 0.0
    used = info.get("guesses", 0)
    return 0.25 * (4 - used) / 4
