"""The multi-turn rollout loop: all live trajectories generate together each turn.

    for each turn:
        the engine continues every live trajectory by one policy turn (one batched call; with
            two models in one conversation, one call per model)
        each environment reads its turn and answers (tool result, feedback, ...) or ends it
        observation tokens are appended with loss mask 0; ended trajectories drop out

Token in, token out: the ids the engine sampled go into the trajectory unchanged, with the
engine's logprob for each; observations are tokenized once (see `ChatFormat`).
"""
from __future__ import annotations

import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol, Sequence

from tqdm.auto import tqdm

from turnrl.envs.base import Env, StepResult
from turnrl.rollout.chat import ChatFormat


@dataclass
class Sample:
    """One policy turn from an engine."""
    token_ids: list[int]
    logprobs: list[float]   # logprob of each sampled id under the engine's (unscaled) model
    finish: str             # "stop": a stop string or end of sequence; "length": max tokens hit


class Engine(Protocol):
    def generate(self, prompts: Sequence[Sequence[int]], *, max_tokens: Sequence[int],
                 stop: Sequence[str], temperature: float, top_p: float,
                 seeds: Sequence[int]) -> list[Sample]: ...


@dataclass
class Budgets:
    max_turns: int
    max_tokens_per_turn: int
    max_tokens_total: int        # response tokens: policy and observation tokens after the prompt
    max_context: int = 1 << 30   # prompt + response: the engine's context length


@dataclass
class Trajectory:
    example: dict
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)         # 1 = sampled by the policy
    turn_ids: list[int] = field(default_factory=list)          # turn of each response token
    engine_logprobs: list[float] = field(default_factory=list)  # 0.0 where loss_mask is 0
    turn_texts: list[str] = field(default_factory=list)
    observations: list[str] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    outcome: float = 0.0
    finish: str = ""        # answer | no_action | max_turns | token_budget | truncated
    info: dict = field(default_factory=dict)

    @property
    def num_turns(self) -> int:
        return len(self.turn_texts)

    @property
    def first_observation(self) -> int:
        """Index in response_ids of the first observation token (len if none)."""
        return next((i for i, m in enumerate(self.loss_mask) if m == 0), len(self.response_ids))

    def policy_tokens(self) -> int:
        return sum(self.loss_mask)

    def add_turn(self, turn: int, ids: Sequence[int], logprobs: Sequence[float], text: str) -> None:
        """Append a policy turn: the sampled ids exactly, trained on (mask 1)."""
        self.response_ids += ids
        self.loss_mask += [1] * len(ids)
        self.turn_ids += [turn] * len(ids)
        self.engine_logprobs += list(logprobs)
        self.turn_texts.append(text)

    def add_observation(self, turn: int, ids: Sequence[int], text: str) -> None:
        """Append environment tokens after `turn`: never trained on (mask 0)."""
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.turn_ids += [turn] * len(ids)
        self.engine_logprobs += [0.0] * len(ids)
        self.observations.append(text)

    def record(self, result: StepResult) -> bool:
        """Take the environment's answer to the last turn; True when the trajectory ended."""
        self.turn_rewards.append(float(result.reward))
        self.info.update(result.info)
        if result.done:
            self.outcome = float(result.info.get("outcome", result.reward))
            self.finish = str(result.info.get("reason", "done"))
        return result.done


def _seed(base: int, index: int, turn: int) -> int:
    return zlib.crc32(f"{base}:{index}:{turn}".encode()) & 0x7FFFFFFF


def level_of(env: Env, turn: int) -> str:
    """Which model plays policy turn `turn`: an environment with two levels (math_refine's
    solver and feedback) says so with `level(turn)`; any other is played by "low" alone."""
    level = getattr(env, "level", None)
    return level(turn) if level is not None else "low"


def run_rollouts(engine: Engine | Mapping[str, Engine], examples: Sequence[dict], make_env: Callable[[], Env],
                 fmt: ChatFormat, budgets: Budgets, *, n: int = 1, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int | None = None, env_workers: int = 2,
                 progress: bool = False, desc: str = "rollout") -> list[Trajectory]:
    """Roll out `n` trajectories per example; trajectory i belongs to group i // n.

    `engine` is one engine for every turn, or one per level ({"low": solver, "high": feedback
    model}) when two models share a conversation: each turn goes to the engine of its level
    (`level_of`), all live trajectories of a level in one batched call.

    With a `seed`, every (trajectory, turn) samples with its own derived seed, so a rerun
    gives the same trajectories whatever the batching; without one the engine's own
    generator is used (faster on vLLM)."""
    engines = engine if isinstance(engine, Mapping) else None
    envs: list[Env] = []
    trajs: list[Trajectory] = []
    for example in examples:
        for _ in range(n):
            env = make_env()
            first = env.reset(example)
            envs.append(env)
            trajs.append(Trajectory(example=example, prompt_ids=fmt.prompt_ids(env.system_prompt, first)))

    stop = tuple(envs[0].stop) if envs else ()
    live = list(range(len(trajs)))
    bar = tqdm(total=len(trajs), desc=desc, unit="traj", disable=not progress, leave=False)
    with ThreadPoolExecutor(max_workers=env_workers) as pool:
        for turn in range(budgets.max_turns):
            if not live:
                break
            room = {i: min(budgets.max_tokens_per_turn, budgets.max_tokens_total - len(trajs[i].response_ids),
                           budgets.max_context - len(trajs[i].prompt_ids) - len(trajs[i].response_ids))
                    for i in live}
            full = [i for i in live if room[i] <= 0]   # e.g. a prompt longer than the context
            for i in full:
                trajs[i].finish = "token_budget"
            bar.update(len(full))
            live = [i for i in live if room[i] > 0]
            if not live:
                break
            by_engine: dict[str, list[int]] = {}
            for k, i in enumerate(live):
                by_engine.setdefault(level_of(envs[i], turn) if engines is not None else "", []).append(k)
            samples: list[Sample] = [None] * len(live)  # type: ignore[list-item]
            for level, ks in by_engine.items():
                outs = (engines[level] if engines is not None else engine).generate(
                    [trajs[live[k]].prompt_ids + trajs[live[k]].response_ids for k in ks],
                    max_tokens=[room[live[k]] for k in ks], stop=stop, temperature=temperature, top_p=top_p,
                    seeds=[None if seed is None else _seed(seed, live[k], turn) for k in ks])
                for k, out in zip(ks, outs):
                    samples[k] = out
            texts = [fmt.tokenizer.decode(s.token_ids, skip_special_tokens=False) for s in samples]
            for i, sample, text in zip(live, samples, texts):
                trajs[i].add_turn(turn, sample.token_ids, sample.logprobs, text)

            # A turn cut by the token limit has no complete action: it ends the trajectory.
            stepping = [k for k, s in enumerate(samples) if s.finish != "length"]
            results = dict(zip(stepping, pool.map(lambda k: envs[live[k]].step(texts[k]), stepping)))

            still_live = []
            for k, i in enumerate(live):
                t = trajs[i]
                result = results.get(k)
                if result is None:
                    t.turn_rewards.append(0.0)
                    t.finish = "truncated"
                    continue
                if t.record(result):
                    continue
                if turn == budgets.max_turns - 1:
                    t.finish = "max_turns"
                    continue
                obs_ids = fmt.observation_ids(result.observation or "", envs[i].observation_role,
                                              after_eos=fmt.ends_turn(samples[k].token_ids))
                if len(t.response_ids) + len(obs_ids) >= budgets.max_tokens_total:
                    t.finish = "token_budget"
                    continue
                t.add_observation(turn, obs_ids, result.observation or "")
                still_live.append(i)
            bar.update(len(live) - len(still_live))
            live = still_live
    bar.close()
    return trajs


def replay(env: Env, fmt: ChatFormat, example: dict, turns: Sequence[str]) -> Trajectory:
    """A trajectory from scripted policy turns, assembled exactly as `run_rollouts` does:
    used for the warm start's demonstrations and to test environments step by step. A turn
    that does not end with one of the environment's stop strings ends, as a model's would,
    with the end-of-turn token (trained on, like the rest of the turn)."""
    t = Trajectory(example=example, prompt_ids=fmt.prompt_ids(env.system_prompt, env.reset(example)))
    for turn, text in enumerate(turns):
        ids = fmt.encode(text)
        if not text.endswith(tuple(env.stop)) and fmt.eos_id is not None:
            ids.append(fmt.eos_id)
        t.add_turn(turn, ids, [0.0] * len(ids), text)
        result = env.step(text)
        if t.record(result):
            break
        t.add_observation(turn, fmt.observation_ids(result.observation or "", env.observation_role,
                                                    after_eos=fmt.ends_turn(ids)),
                          result.observation or "")
    return t
