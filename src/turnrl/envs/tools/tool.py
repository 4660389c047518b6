"""What every tool is: a name, a JSON schema the chat template renders and calls are checked
against, and `run(arguments)`; the two ways a call fails (`ToolError`: it ran and failed;
`TransportError`: it could not be reached, retried); and the outcome of one call."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

#: How a call can fail, each counted per trajectory as info["tool_<kind>"].
ERROR_KINDS = ("malformed", "unknown", "bad_arguments", "raised", "timeouts", "transport")
#: The failures of a call that reached a tool (not the policy's malformed or unknown calls, nor
#: arguments its schema rejects): what `tools/<name>/error_frac` counts.
TOOL_FAILURES = ("raised", "timeouts", "transport")


class ToolError(Exception):
    """The tool ran and failed (it raised, or the server reported an error)."""


class TransportError(Exception):
    """The tool could not be reached (retried)."""


def _validation_schema(schema: Any) -> Any:
    """A JSON schema jsonschema can check: transformers marks Optional arguments
    `"nullable": true` (OpenAPI's spelling), JSON Schema says `"type": [t, "null"]`."""
    if isinstance(schema, dict):
        out = {k: _validation_schema(v) for k, v in schema.items() if k != "nullable"}
        if schema.get("nullable") and "type" in out:
            kinds = out["type"] if isinstance(out["type"], list) else [out["type"]]
            out["type"] = [*kinds, "null"] if "null" not in kinds else kinds
        if schema.get("nullable") and isinstance(out.get("enum"), list) and None not in out["enum"]:
            out["enum"] = [*out["enum"], None]   # Optional[Literal[...]]: None is one of its values
        return out
    if isinstance(schema, list):
        return [_validation_schema(v) for v in schema]
    return schema


class Tool:
    """A named tool: its schema (what the chat template renders) and `run(arguments)`."""
    kind = "tool"

    def __init__(self, name: str, description: str, parameters: dict | None, closed: bool = False):
        """`closed`: arguments the schema does not name are refused (a Python function's, whose
        parameters are all there is), where the schema does not say otherwise."""
        self.name, self.description = name, description or ""
        self.parameters = parameters or {"type": "object", "properties": {}}
        import jsonschema
        schema = _validation_schema(self.parameters)
        if closed and isinstance(schema, dict):
            schema.setdefault("additionalProperties", False)
        cls = jsonschema.validators.validator_for(schema)
        self._validator = cls(schema)

    @property
    def schema(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    def check(self, arguments: dict) -> str | None:
        """Why `arguments` do not fit the schema (the first problem), or None."""
        errors = sorted(self._validator.iter_errors(arguments), key=lambda e: list(e.path))
        if not errors:
            return None
        e = errors[0]
        where = ".".join(str(p) for p in e.path)
        return f"{where}: {e.message}" if where else e.message

    async def run(self, arguments: dict, box: Any) -> Any:
        """The call's result; `box` is the ToolBox running it (its HTTP client, its loop)."""
        raise NotImplementedError


@dataclass
class CallOutcome:
    ok: bool
    text: str                   # what goes back to the policy (a result, or "Error: ...")
    error: str | None = None    # one of ERROR_KINDS when not ok
    seconds: float = 0.0
    attempts: int = 1
    tool: str | None = None     # the tool it reached (None: malformed, unknown or not run)


def result_text(value: Any, limit: int) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[:max(0, limit - 3)] + "..."
