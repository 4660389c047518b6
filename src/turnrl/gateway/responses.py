"""OpenAI's Responses API (`POST /v1/responses`) on the gateway, as a translation of the Chat
Completions path it already serves (the OpenAI Agents SDK's default model calls this API, and
LangChain's ChatOpenAI with `use_responses_api`):

    Responses request --chat_request--> Chat Completions request --> the gateway's one path
    Response (or its events) <--response_of / response_events-- the chat completion

`input` items become messages: `message` items by role (developer as system, content parts as
text), `function_call` items the calls of the assistant message before them (a turn's text and
its calls are one message, as the gateway answered them, so the sampled ids are spliced back in
and the next prompt extends the last one token for token), `function_call_output` items tool
results naming `call_id`; `reasoning` items are dropped (a text model wrote none). `instructions`
is the system message. Only function tools: a hosted tool (web_search, file_search, computer)
or an item the gateway cannot render, and `previous_response_id` (the gateway stores no
responses: send the whole conversation, as with `store: false`), are refused with a 400 that
says so. A Response's id is its completion's, so `call_rewards` names it as it names a chat
completion's.
"""
from __future__ import annotations

import json
from typing import Any, Iterator

from turnrl.gateway.render import BadRequest, text_of


def chat_request(body: dict) -> dict:
    """The Chat Completions request that asks what the Responses request `body` asks;
    BadRequest naming the key or `input[k]` that cannot be served."""
    if body.get("previous_response_id") or body.get("conversation"):
        raise BadRequest("previous_response_id / conversation: the gateway stores no responses; send the whole "
                         "conversation in `input` each call (as with store: false)")
    if "input" not in body:
        raise BadRequest("missing `input`: a string or a list of items")
    messages = []
    instructions = body.get("instructions")
    if instructions:
        if not isinstance(instructions, str):
            raise BadRequest("`instructions` must be a string")
        messages.append({"role": "system", "content": instructions})
    messages += _messages(body["input"])
    chat: dict[str, Any] = {"messages": messages, "tools": _tools(body.get("tools") or [])}
    asked = body.get("max_output_tokens")
    if asked is not None and (not isinstance(asked, int) or isinstance(asked, bool) or asked < 1):
        raise BadRequest(f"max_output_tokens = {asked!r}: must be a positive integer")
    choice = body.get("tool_choice", "auto")
    chat["tool_choice"] = "none" if choice == "none" else "auto"
    for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                         ("stream", "stream")):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    include = body.get("include") or []
    if isinstance(include, list) and "message.output_text.logprobs" in include:
        chat["logprobs"] = True
    # the rest (store, metadata, reasoning, truncation, text's format, ...) changes nothing here, as
    # Chat Completions' response_format does not
    return chat


def _messages(given: Any) -> list[dict]:
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise BadRequest("`input` must be a string or a non-empty list of items")
    messages: list[dict] = []
    for k, item in enumerate(given):
        if not isinstance(item, dict):
            raise BadRequest(f"input[{k}]: an item must be an object, got {item!r:.80}")
        kind = item.get("type", "message")
        try:
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "system", "developer", "assistant"):
                    raise BadRequest(f"role {role!r}: must be user, system, developer or assistant")
                messages.append({"role": role, "content": text_of(item.get("content"))})
            elif kind == "function_call":
                call = {"id": _required(item, "call_id"), "type": "function",
                        "function": {"name": _required(item, "name"), "arguments": item.get("arguments") or "{}"}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)   # the turn's text and its calls: one message
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                messages.append({"role": "tool", "tool_call_id": _required(item, "call_id"),
                                 "content": text_of(item.get("output"))})
            elif kind == "reasoning":
                continue   # a reasoning model's summary; a text model wrote none to splice back
            else:
                raise BadRequest(f"items of type {kind!r} are not served: the gateway serves messages and "
                                 "function calls on a text model (send the items, not references to them)")
        except BadRequest as exc:
            raise BadRequest(f"input[{k}]: {exc}") from None
    return messages


def _required(item: dict, key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise BadRequest(f"a {item.get('type')} item needs {key!r} (a string)")
    return value


def _tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise BadRequest("`tools` must be a list of {type: function, name, parameters} objects")
    out = []
    for k, tool in enumerate(tools):
        if isinstance(tool, dict) and tool.get("type") == "function" and not tool.get("name"):
            raise BadRequest(f"tools[{k}]: a function tool needs `name` (and `parameters`, a JSON schema)")
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise BadRequest(f"tools[{k}]: {kind!r} is not served: only function tools ({{type: function, name, "
                             "parameters}}); give the agent a function that does the work of a hosted tool")
        function = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
        if tool.get("description"):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def response_of(completion: dict, body: dict) -> dict:
    """The Response of a chat completion (its first choice) answering `body`."""
    choice = completion["choices"][0]
    message = choice["message"]
    output: list[dict] = []
    suffix = completion["id"].split("_", 1)[-1]
    if message.get("content") or not message.get("tool_calls"):
        part = {"type": "output_text", "text": message.get("content") or "", "annotations": []}
        if choice.get("logprobs"):
            part["logprobs"] = [{"token": t["token"], "logprob": t["logprob"], "bytes": t["bytes"], "top_logprobs": []}
                                for t in choice["logprobs"]["content"]]
        output.append({"type": "message", "id": f"msg_{suffix}", "status": "completed", "role": "assistant",
                       "content": [part]})
    for j, call in enumerate(message.get("tool_calls") or []):
        output.append({"type": "function_call", "id": f"fc_{suffix}_{j}", "call_id": call["id"],
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                       "status": "completed"})
    cut = choice["finish_reason"] == "length"
    usage = completion["usage"]
    return {"id": completion["id"], "object": "response", "created_at": completion["created"],
            "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
            "model": completion["model"], "output": output, "instructions": body.get("instructions"),
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice", "auto"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True), "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "max_output_tokens": body.get("max_output_tokens"),
            "previous_response_id": None, "store": False, "metadata": body.get("metadata") or {},
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "reasoning": None,
            "usage": {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": usage["total_tokens"]}}


def response_events(response: dict) -> Iterator[str]:
    """A whole Response as the Server-Sent Events of a streamed one: created, each output item
    added, its text or arguments in one delta, done, then completed (or incomplete)."""
    sequence = 0

    def event(kind: str, **data) -> str:
        nonlocal sequence
        sequence += 1
        return f"event: {kind}\ndata: " + json.dumps({"type": kind, "sequence_number": sequence - 1, **data}) + "\n\n"

    yield event("response.created", response={**response, "status": "in_progress", "output": [],
                                               "incomplete_details": None})
    yield event("response.in_progress", response={**response, "status": "in_progress", "output": [],
                                                  "incomplete_details": None})
    for index, item in enumerate(response["output"]):
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            yield event("response.output_item.added", output_index=index,
                        item={**item, "status": "in_progress", "content": []})
            for c, part in enumerate(item["content"]):
                yield event("response.content_part.added", **where, content_index=c, part={**part, "text": ""})
                yield event("response.output_text.delta", **where, content_index=c, delta=part["text"],
                            logprobs=part.get("logprobs", []))
                yield event("response.output_text.done", **where, content_index=c, text=part["text"],
                            logprobs=part.get("logprobs", []))
                yield event("response.content_part.done", **where, content_index=c, part=part)
        else:
            yield event("response.output_item.added", output_index=index,
                        item={**item, "status": "in_progress", "arguments": ""})
            yield event("response.function_call_arguments.delta", **where, delta=item["arguments"])
            yield event("response.function_call_arguments.done", **where, arguments=item["arguments"])
        yield event("response.output_item.done", output_index=index, item=item)
    yield event("response.completed" if response["status"] == "completed" else "response.incomplete",
                response=response)
