"""Length shaping, built on the reward-function extension point: DAPO's soft overlong penalty
(Yu et al., 2025, "DAPO", eq. 13) is a reward function like a user's, configured in params
(`reward.overlong`), added to the reward and logged as `reward_overlong_mean`.

    penalty(L) = 0                                       L <= limit - buffer
               = -max_penalty * (L - (limit - buffer)) / buffer     limit - buffer < L <= limit
               = -max_penalty                            L > limit, or the episode's budget ended it

L is the trajectory's response tokens (policy and observation tokens after the prompt: what
`rollout.max_tokens_total`, the limit, counts). A response that nears the budget is penalised
gradually, so a long answer learns to shorten before it is cut off, instead of a cut-off answer
being scored as an ordinary wrong one. A multi-turn episode the total budget ended (finish
`token_budget`: its next observation would not fit, so it stops short of the limit) is the cut
DAPO's L > limit stands for, and gets the whole penalty. Its companion, `train.mask_truncated`, leaves trajectories
the budget cut out of the loss (`truncated_rows`).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

#: why a trajectory ended when a token budget cut it (a turn at its token limit, or the episode's)
CUT_FINISHES = ("truncated", "token_budget")


def soft_overlong_penalty(length: int, limit: int, buffer: int, max_penalty: float = 1.0) -> float:
    """DAPO's soft overlong penalty of a response of `length` tokens (<= 0). `buffer` 0: none."""
    if buffer <= 0:
        return 0.0
    if length > limit:
        return -max_penalty
    start = limit - buffer
    return -max_penalty * max(0, length - start) / buffer


def overlong_reward(limit: int, buffer: int, max_penalty: float) -> Callable[..., float]:
    """The penalty as a reward function `fn(prompt, completion, answer, **info)` reading the
    trajectory's `response_tokens` from its info (turnrl.rewards.functions passes it)."""
    def overlong(prompt: str, completion: str, answer: str, **info: Any) -> float:
        if info.get("finish") == "token_budget" and buffer > 0:   # cut by the budget, a little short of it
            return -max_penalty
        return soft_overlong_penalty(int(info["response_tokens"]), limit, buffer, max_penalty)
    return overlong


def cut_by_budget(finishes: Sequence[str]) -> list[bool]:
    """Which trajectories a token budget cut (their finish is one of CUT_FINISHES)."""
    return [finish in CUT_FINISHES for finish in finishes]
