"""The rollout actor: a rollout engine (vLLM, or transformers) plus the environments. Runs the
multi-turn loop for its share of a step's prompts and takes new weights without restarting.
With a second model for the high level (`levels.high_model: separate`) it holds that model's
engine too: the loop batches each level's turns on its own engine in this process, with no
round trip to another actor per turn. In asynchronous training (`train.mode: async`) it rolls
out continuously instead (`start_stream`, `feed`, `take_groups`), and weights pushed meanwhile
are loaded between two engine steps.
"""
from __future__ import annotations

import random
import threading
import time
from typing import Any

import torch

from turnrl.training.weight_export import unpack_tensors
from turnrl.training.workers import RolloutParams, actor_location


class RolloutWorker:
    def __init__(self, model_dir: str, params: RolloutParams, data_dir: str, engine_options: dict | None = None,
                 high_model_dir: str | None = None):
        """`engine_options` go to the engine (vLLM: e.g. gpu_memory_utilization,
        enable_sleep_mode, weight_transfer_config on GPUs). `high_model_dir`: a second engine,
        from that folder, plays the high-level (feedback) turns."""
        from transformers import AutoTokenizer

        from turnrl.rollout.chat import ChatFormat
        from turnrl.rollout.engines import context_length, make_engine
        self.params = params
        r = params.rollout
        self.engines = {level: make_engine(r.engine, folder, dtype=self.params.model.dtype, seed=self.params.seed,
                                           kv_cache_gib=r.kv_cache_gib, max_model_len=context_length(folder),
                                           prefix_caching=r.prefix_caching, kv_block_size=r.kv_block_size,
                                           **(engine_options or {}))
                        for level, folder in (("low", model_dir), ("high", high_model_dir)) if folder}
        self.engine = self.engines["low"]
        self.fmt = ChatFormat(AutoTokenizer.from_pretrained(model_dir), self.params.model.template_type)
        from turnrl import envs
        from turnrl.rewards.functions import from_config as reward_functions
        from turnrl.rollout.episodes import runner_for
        self.make_env = params.env.factory(max_turns=params.rollout.max_turns, seed=params.seed, data_dir=data_dir)
        # the step loop, the agent gateway or a game's tables, told the policy's folder (a game's past selves)
        self.runner = runner_for(envs.resolve(params.env.name), model_dir)
        self.reward_functions = reward_functions(self.params.reward, self.params.rollout)
        from turnrl.rewards.teacher import Teacher
        self.teacher = (Teacher(params.reward.teacher, self.fmt.tokenizer, chat_format=ChatFormat)
                        if params.reward.teacher.enabled else None)
        self.decode = lambda ids: self.fmt.tokenizer.decode(ids, skip_special_tokens=True)
        self.stream = None    # asynchronous training: the continuous rollouts (start_stream)
        self.pushes = 0       # weight pushes received: the policy version the engine will hold

    def where(self) -> dict[str, Any]:
        return actor_location()

    def timed_rollout(self, *args, **kwargs) -> tuple[list, float]:
        """`rollout`, and the seconds this actor spent on it."""
        start = time.perf_counter()
        return self.rollout(*args, **kwargs), time.perf_counter() - start

    def rollout(self, examples: list[dict], n: int, seed: int | None = None,
                temperature: float | None = None, generator_seed: int | None = None) -> list:
        """`n` trajectories per example. `generator_seed` seeds this process's generators
        first: vLLM's CPU sampler (and transformers' sampling) draw from torch's global
        generator, and the engine runs in this process, so the batch samples the same tokens
        for the same seed, weights and prompts however many batches came before."""
        if self.stream is not None:   # asynchronous training: beside the groups in flight, under the current weights
            trajs = self.stream.roll_out(examples, n)
            self.reward_functions.score(trajs, self.decode)
            return trajs
        if generator_seed is not None:
            torch.manual_seed(generator_seed)
            random.seed(generator_seed)
        r = self.params.rollout
        from turnrl.rollout.episodes import scoring_unit
        from turnrl.rollout.scored import scored_as_they_finish
        self.reward_functions.new_step()
        # each trajectory (or group) scored on a thread as it ends (a judge's seconds overlap the rest of the batch)
        return scored_as_they_finish(
            lambda **hook: self.runner.run(
                self.engines if len(self.engines) > 1 else self.engine, examples, self.make_env, self.fmt,
                self.budgets(), n=n, temperature=r.temperature if temperature is None else temperature, top_p=r.top_p,
                seed=seed, env_workers=self.params.env.workers, observation_lag=r.observation_lag, rejoin=r.rejoin,
                **hook),
            self.score, scoring_unit(self.runner, self.reward_functions.by_group))

    def score(self, trajs: list) -> None:
        """The reward functions' (judges') scores and the teacher's logprobs, where configured."""
        self.reward_functions.score(trajs, self.decode)
        if self.teacher is not None:
            self.teacher.annotate(trajs)

    def budgets(self):
        from turnrl.rollout.multi_turn import Budgets
        r = self.params.rollout
        return Budgets(r.max_turns, r.max_tokens_per_turn, r.max_tokens_total,
                       getattr(self.engine, "max_model_len", 1 << 30), self.params.env.step_timeout_s)

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """log p(token t | tokens < t) of each sequence under the engine's weights (entry 0 is 0)."""
        return self.engine.prompt_logprobs(sequences)

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self.engine.load_weights(weights.items())

    def load_weight_buckets(self, buckets: list, level: str = "low") -> None:
        """New weights as object-store refs, one per bucket of named tensors: streamed into
        `level`'s engine bucket by bucket (one fetched at a time). The runner is handed them
        again as `tensors` (the policy's, not the high level's): a game's past selves copy them."""
        import ray

        from turnrl.rollout.episodes import hand_weights

        def tensors():
            for ref in buckets:
                yield from unpack_tensors(ray.get(ref))
        self.pushes += 1
        if self.stream is not None:   # the stream's next samples are the new policy's: asked anew
            self.reward_functions.new_step()
        # (a stream's generating thread loads them before its next engine step; the agent gateway's
        # engine thread between two engine steps; the step loop and a game's tables at once)
        hand_weights(self.stream if self.stream is not None else self.runner, self.pushes,
                     lambda: self.engines[level].load_weights(tensors()), tensors if level == "low" else None)

    # ----------------------------------------------------------------------- asynchronous training
    def start_stream(self, n: int, max_groups: int, generator_seed: int, version: int) -> None:
        """Roll out continuously on a thread of this actor (`turnrl.rollout.stream`): groups of
        `n`, at most `max_groups` in flight, under weights of policy `version` (the updates the
        trainer has pushed; a resumed run's included). The actor then runs with max_concurrency
        > 1, so feed, take_groups and weight loads reach it while it generates."""
        torch.manual_seed(generator_seed)
        random.seed(generator_seed)
        r = self.params.rollout
        self.pushes = version
        self.stream = self.runner.stream(self.engines if len(self.engines) > 1 else self.engine, self.make_env,
                                         self.fmt, self.budgets(), n=n, max_groups=max_groups,
                                         temperature=r.temperature, top_p=r.top_p,
                                         env_workers=self.params.env.workers, version=self.pushes)
        self._stream_thread = threading.Thread(target=self.stream.run, name="turnrl-stream", daemon=True)
        self._stream_thread.start()
        # each finished group is scored on a thread of its own as it comes (a judge's seconds overlap generation)
        from turnrl.rollout.scored import ScoredStream
        self.scored = ScoredStream(self.stream, self.score)

    def feed(self, examples: list[dict]) -> None:
        self.stream.feed(examples)

    def take_groups(self, max_groups: int, timeout_s: float) -> tuple[list[list], dict[str, float]]:
        """Up to `max_groups` finished groups, scored by the reward functions, and the stream's
        state: the engine's busy seconds so far, its queue counts and weight version."""
        groups = self.scored.take_groups(max_groups, timeout_s)
        return groups, {"busy_s": self.stream.busy_s, "version": self.stream.version, **self.scored.counts()}

    def stop_stream(self) -> None:
        if self.stream is not None:
            self.scored.stop()
            self.stream.stop()
            self._stream_thread.join(timeout=60)
            self.stream = None

    # vLLM's weight-transfer control plane (NCCL on GPUs): RayVLLMWeightSyncClient calls these.
    def init_weight_transfer_engine(self, request) -> None:
        self.engine.llm.init_weight_transfer_engine(request)

    def start_weight_update(self) -> None:
        self.engine.llm.start_weight_update()

    def update_weights(self, request) -> None:
        self.engine.llm.update_weights(request)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        from turnrl.rollout.engines import forget_older_kv
        self.engine.llm.finish_weight_update(weight_version)
        forget_older_kv(self.engine.llm)

    def shutdown_weight_transfer_engine(self) -> None:
        self.engine.llm.shutdown_weight_transfer_engine()

    # Colocated on a GPU: free the device for the trainer while it trains.
    def sleep(self) -> None:
        for engine in self.engines.values():
            engine.llm.sleep(level=1)

    def wake_up(self) -> None:
        for engine in self.engines.values():
            engine.llm.wake_up()
