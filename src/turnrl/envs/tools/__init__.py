"""`tools`: function calling in the model's own format, with tools from Python functions, HTTP
endpoints and MCP servers.

The tools' JSON schemas go into the prompt through the tokenizer's chat template
(`apply_chat_template(..., tools=...)`, the environment's `tools` attribute), so the policy sees
them as its model family was trained to: Qwen's `<tools>` block, Llama 3.1's JSON, ... A policy
turn is parsed by the family's parser (`parser`):

    hermes   <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number per turn
             (Qwen 2.5 / 3, Hermes, the embedded tiny model)
    llama3   the turn is a JSON object {"name": ..., "parameters": {...}} (after an optional
             <|python_tag|>), several separated by ";" (Llama 3.1 / 3.2 JSON tool calling)
    mistral  [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...], [TOOL_CALLS]name[ARGS]{...} or
             [TOOL_CALLS]name[CALL_ID]id[ARGS]{...}
    module:function   your own: text -> ParsedTurn (or a list of {"name", "arguments"} dicts)

A turn with calls: every call runs (a turn's calls concurrently), and each result comes back as
its own tool message (observation = a list of messages). A turn without a call is the final
answer, graded by `grader` (math-verify on the last <answer> or \\boxed{} by default; `exact`,
or `module:function`), outcome 1.0 or 0.0. Turn reward of a tool turn: the share of its calls
that ran (MT-GRPO's "the call worked").

Nothing a policy writes crashes the rollout: a malformed call (bad JSON, no name, an unclosed
tag), an unknown tool, arguments the tool's schema rejects, a tool that raises, times out or
cannot be reached all come back as an error observation (`Error: ...`) and the trajectory goes
on. Counts per trajectory in `info` (logged every step as `env_<key>_mean`): `tool_calls`,
`tool_errors` and by kind `tool_malformed`, `tool_unknown`, `tool_bad_arguments`,
`tool_raised`, `tool_timeouts`, `tool_transport`; `tool_ok` (every call of the last tool turn
ran: tool_call_rate / tool_success_rate).

Where tools come from (`env.options`):

    functions: [my_pkg.tools:lookup]     Python functions (sync or async), the schema from their
                                         type hints and docstring (transformers' get_json_schema)
    http: [{name, url, description, parameters}]      POST url with the arguments as JSON; the
                                         reply's "result" (or "error"), else its JSON or text
    mcp: [{command: [python, server.py]}, {url: http://host:8000/mcp}]   MCP servers (stdio or
                                         streamable HTTP): every tool they list, or `tools: [...]`

A package of its parts:

    parsers       reading calls from a turn (hermes, llama3, mistral, your own)
    tool          what a tool is, how a call fails, a call's outcome
    functions     Python functions as tools, each sync call in a thread it can abandon
    transports    HTTP endpoints and MCP servers (stdio or streamable HTTP), lost sessions reopened
    toolbox       a process's tools of one configuration: concurrency, timeouts, retries
    environment   the environment (`ToolsEnv`) and its options
    calculator    the default tool and the tiny model's warm-start demonstrations (`tools_task`:
                  the `demonstration` hook's, for tools of one's own)

Whatever a tool does (raises, calls sys.exit, never returns, loses its server), the call ends
within `timeout_s` with an error observation, and later calls work (docs/plugins.md, Tools).
"""
from __future__ import annotations

from turnrl.envs.base import EnvSpec
from turnrl.envs.tools.calculator import TASK, calculator, calculator_demonstration, tools_task
from turnrl.envs.tools.environment import SYSTEM_PROMPT, ToolsEnv, ToolsOptions, make_tools_env
from turnrl.envs.tools.functions import FunctionTool
from turnrl.envs.tools.parsers import (PARSERS, ParsedTurn, ToolCall, parse_hermes, parse_llama3, parse_mistral,
                                       resolve_parser)
from turnrl.envs.tools.tool import ERROR_KINDS, CallOutcome, Tool, ToolError, TransportError
from turnrl.envs.tools.toolbox import ToolBox, close_toolboxes, toolbox
from turnrl.envs.tools.transports import HTTPTool, HTTPToolSpec, MCPServerSpec, MCPSession, MCPTool

ENV = EnvSpec(factory=make_tools_env, options=ToolsOptions, task=TASK, name="tools", task_from_options=tools_task)

__all__ = ["ENV", "ERROR_KINDS", "PARSERS", "SYSTEM_PROMPT", "TASK", "CallOutcome", "FunctionTool", "HTTPTool",
           "HTTPToolSpec", "MCPServerSpec", "MCPSession", "MCPTool", "ParsedTurn", "Tool", "ToolBox", "ToolCall",
           "ToolError", "ToolsEnv", "ToolsOptions", "TransportError", "calculator", "calculator_demonstration",
           "close_toolboxes", "make_tools_env", "parse_hermes", "parse_llama3", "parse_mistral", "resolve_parser",
           "toolbox", "tools_task"]
