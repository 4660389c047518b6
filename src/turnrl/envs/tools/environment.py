"""The `tools` environment: one trajectory of function calling, and its options.

A turn with calls: every call runs (a turn's calls concurrently), and each result comes back as
its own tool message. A turn without a call is the final answer, graded by `grader`. Counts per
trajectory in `info`: `tool_calls`, `tool_errors`, one per error kind, `tool_ok`, and
`tool_by_name` ({tool: [calls, failures]}: what `tools/<name>/error_frac` is made of).
"""
from __future__ import annotations

import asyncio
from typing import Annotated, Any, Callable, Sequence

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from turnrl.envs.base import StepResult
from turnrl.envs.tools.functions import FunctionTool
from turnrl.envs.tools.parsers import PARSERS, ParsedTurn, ToolCall, resolve_parser
from turnrl.envs.tools.tool import ERROR_KINDS, TOOL_FAILURES, CallOutcome
from turnrl.envs.tools.toolbox import ToolBox, toolbox
from turnrl.envs.tools.transports import HTTPToolSpec, MCPServerSpec
from turnrl.plugins import is_import_path, load_object
from turnrl.rewards.graders import for_row

SYSTEM_PROMPT = ("Solve the problem. You can call the tools; their results come back as tool messages. "
                 "Give the final answer as <answer>...</answer>.")


class ToolsEnv:
    """One trajectory of function calling (see the module docstring)."""
    observation_role = "tool"
    stop: tuple[str, ...] = ()        # a turn ends with the model's end-of-turn token: it may make several calls

    def __init__(self, box: ToolBox, parser: Callable[[str], ParsedTurn], grade: Callable[[str, dict], Any],
                 max_calls_per_turn: int = 4, system_prompt: str = SYSTEM_PROMPT):
        self.box, self.parse, self.grade = box, parser, grade
        self.max_calls_per_turn = max_calls_per_turn
        self.system_prompt = system_prompt
        self.tools = box.schemas
        self.example: dict = {}
        self.counts = dict.fromkeys(("calls", "errors", *ERROR_KINDS), 0)
        self.by_name: dict[str, list[int]] = {}   # tool -> [calls that reached it, of them failed]

    def reset(self, example: dict) -> str:
        self.example = example
        self.counts = dict.fromkeys(self.counts, 0)
        self.by_name = {}
        return example["prompt"]

    def _info(self) -> dict:
        return {"tool_calls": self.counts["calls"], "tool_errors": self.counts["errors"],
                **{f"tool_{kind}": self.counts[kind] for kind in ERROR_KINDS},
                "tool_by_name": {name: list(c) for name, c in self.by_name.items()}}

    def _count(self, outcomes: list[CallOutcome]) -> None:
        for o in outcomes:
            self.counts["calls"] += 1
            if not o.ok:
                self.counts["errors"] += 1
                self.counts[o.error or "raised"] += 1
            if o.tool is not None and o.error not in ("malformed", "unknown", "bad_arguments"):
                c = self.by_name.setdefault(o.tool, [0, 0])
                c[0] += 1
                c[1] += o.error in TOOL_FAILURES

    async def step(self, text: str) -> StepResult:
        turn = self.parse(text)
        if turn.is_answer:
            g = for_row(self.grade, self.example)(text, self.example)   # a row's own grader wins
            outcome = 1.0 if g.correct else 0.0
            score = getattr(g, "score", None)   # reasoning-gym rows: partial credit is the reward
            return StepResult(None, outcome if score is None else score, True, {
                "outcome": outcome, "reason": "answer", "extracted": g.extracted, **self._info(),
                **({"partial_credit": score} if score is not None else {})})
        async def settle(k: int, item: ToolCall | str) -> CallOutcome:
            if not isinstance(item, ToolCall):
                return CallOutcome(False, f"Error: {item}", "malformed")
            if k >= self.max_calls_per_turn:
                return CallOutcome(False, f"Error: not run: at most {self.max_calls_per_turn} tool calls per turn",
                                   "malformed")
            return await self.box.acall(item.name, item.arguments)
        # the turn's calls at once; their results in the order the calls were written
        ordinals, seen = [], 0
        for item in turn.items:
            ordinals.append(seen)
            seen += isinstance(item, ToolCall)
        outcomes: list[CallOutcome] = list(await asyncio.gather(*(settle(k, c) for k, c in zip(ordinals, turn.items))))
        self._count(outcomes)
        ok = sum(o.ok for o in outcomes)
        errors = [o.error for o in outcomes if not o.ok]
        info = {**self._info(), "tool_ok": ok == len(outcomes), "tool_error": errors[0] if errors else None,
                "tool_seconds": max(o.seconds for o in outcomes),
                # the id each result answers, where the model wrote one: the frame names it (Mistral v0.3)
                "tool_call_ids": [item.id if isinstance(item, ToolCall) else None for item in turn.items]}
        return StepResult([o.text for o in outcomes], ok / len(outcomes), False, info)



def _plain(specs: list[BaseModel]) -> list[dict]:
    return [spec.model_dump() for spec in specs]


class ToolsOptions(BaseModel):
    """`env.options` of `tools`."""
    model_config = ConfigDict(extra="forbid")
    functions: list[str] = Field(default_factory=lambda: ["turnrl.envs.tools:calculator"], description=(
        "Python functions by import path (module:function), each a tool; schema from type hints and docstring"))
    # checked as specs, kept as plain dicts (the resolved options print as YAML and hash as params)
    http: Annotated[list[HTTPToolSpec], AfterValidator(_plain)] = Field(default_factory=list)
    mcp: Annotated[list[MCPServerSpec], AfterValidator(_plain)] = Field(default_factory=list)
    parser: str = Field("hermes", description="how calls are read from a turn: hermes (qwen), llama3, mistral, or "
                                              "module:function")
    grader: str = Field("math", description="the final answer: math (math-verify), exact, or module:function")
    timeout_s: float = Field(10.0, gt=0, description="seconds per call, retries included")
    max_concurrent: int = Field(64, ge=1, description=(
        "calls in flight at once in a process (all trajectories); also the most timed-out calls of one sync "
        "function left running in their threads before it is not run any more"))
    retries: int = Field(2, ge=0, description="retries of a call on transport errors")
    max_calls_per_turn: int = Field(4, ge=1)
    max_result_chars: int = Field(1000, ge=16, description="a tool's result is cut to this length")
    system_prompt: str = SYSTEM_PROMPT
    demonstration: str = Field("", description=(
        "model.path: tiny's warm start with your tools: module:function (row, rng, good) -> the policy turns "
        "(a Demonstration or a list of texts: the calls in the parser's format, then the answer) for a row of "
        "data.train_set (or the synthetic products); empty: the built-in calculator's, which need "
        "turnrl.envs.tools:calculator among functions"))

    @field_validator("demonstration")
    @classmethod
    def _demonstration(cls, value: str) -> str:
        if value:
            if not is_import_path(value):
                raise ValueError(f"{value!r}: an import path is module:function, e.g. my_pkg.tools:demonstrate")
            if not callable(load_object(value, "env.options.demonstration")):
                raise ValueError(f"{value!r} is not a function")
        return value

    @field_validator("functions")
    @classmethod
    def _functions(cls, value: list[str]) -> list[str]:
        """Each imported and its schema made now, so a bad one stops params checking; two of one
        name (the model could not tell them apart) too."""
        named: dict[str, str] = {}
        for i, path in enumerate(value):
            if not is_import_path(path):
                raise ValueError(f"functions[{i}] = {path!r}: an import path is module:function, e.g. my_pkg.tools:lookup")
            fn = load_object(path, f"functions[{i}]")
            if not callable(fn):
                raise ValueError(f"functions[{i}] = {path!r}: {fn!r} is not a function")
            name = FunctionTool(fn, f"functions[{i}] = {path!r}").name
            if name in named:
                raise ValueError(f"functions[{i}] = {path!r}: a tool named {name!r} comes from {named[name]!r} "
                                 "already; the model calls tools by name, so give each its own")
            named[name] = path
        return value

    @field_validator("parser")
    @classmethod
    def _parser(cls, value: str) -> str:
        if value not in PARSERS and not is_import_path(value):
            raise ValueError(f"must be one of {', '.join(PARSERS)} or an import path module:function")
        return value

    @field_validator("grader")
    @classmethod
    def _grader(cls, value: str) -> str:
        from turnrl.rewards.graders import BUILTIN
        if value not in BUILTIN and not is_import_path(value):
            raise ValueError("must be math, exact or an import path module:function")
        return value

    @model_validator(mode="after")
    def _some_tool(self) -> "ToolsOptions":
        if not (self.functions or self.http or self.mcp):
            raise ValueError("no tools: give functions, http or mcp")
        return self


def make_tools_env(*, functions: Sequence[str] = ("turnrl.envs.tools:calculator",),
                   http: Sequence[HTTPToolSpec | dict] = (), mcp: Sequence[MCPServerSpec | dict] = (),
                   parser: str = "hermes", grader: str = "math", timeout_s: float = 10.0, max_concurrent: int = 64,
                   retries: int = 2, max_calls_per_turn: int = 4, max_result_chars: int = 1000,
                   system_prompt: str = SYSTEM_PROMPT, demonstration: str = "") -> ToolsEnv:
    """A `tools` environment; its ToolBox is shared by every environment of the same tools
    (`demonstration` is the warm start's, `tools_task`'s)."""
    from turnrl.rewards.graders import grader as resolve_grader
    http = [h if isinstance(h, HTTPToolSpec) else HTTPToolSpec.model_validate(h) for h in http]
    mcp = [m if isinstance(m, MCPServerSpec) else MCPServerSpec.model_validate(m) for m in mcp]
    box = toolbox(list(functions), http, mcp, timeout_s=timeout_s, max_concurrent=max_concurrent, retries=retries,
                  max_result_chars=max_result_chars)
    return ToolsEnv(box, resolve_parser(parser), resolve_grader(grader, "env.options.grader"),
                    max_calls_per_turn=max_calls_per_turn, system_prompt=system_prompt)
