"""Mistral v0.3's function-calling format: tools in [AVAILABLE_TOOLS], calls as
`[TOOL_CALLS] [{"name", "arguments", "id"}]`, results in [TOOL_RESULTS] naming the call's id,
and a template that refuses any id but nine alphanumerics. A conversation file with OpenAI's ids
(`call_0`) trains; an agent program's call gets the id the model wrote, and its next request
extends the last prompt token for token."""
from __future__ import annotations

import json

import pytest

from turnrl.rollout.chat import nine_char_id

# Written here to Mistral v0.3's documented format (a miniature of it, not the checkpoint's file):
# the tools before the last user message, the system text opening it, the call's id inside the
# call, the result naming it, and the id check the real template raises on.
V3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}"
    "{%- set messages = messages[1:] %}{%- endif %}"
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{%- if tools and loop.index0 == ns.last_user %}"
    "{{- '[AVAILABLE_TOOLS] ' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{%- if system is defined and loop.index0 == ns.last_user %}"
    "{{- '[INST] ' + system + '\\n\\n' + message.content + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message.content + '[/INST]' }}{%- endif %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '[TOOL_CALLS] [' }}"
    "{%- for call in message.tool_calls %}"
    "{%- if call.id is not defined or call.id is none or call.id | length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "{{- '{\"name\": ' + call.function.name | tojson + ', \"arguments\": ' + call.function.arguments | tojson"
    " + ', \"id\": \"' + call.id + '\"}' }}"
    "{%- if not loop.last %}{{- ', ' }}{%- endif %}"
    "{%- endfor %}"
    "{{- ']' + eos_token }}"
    "{%- elif message.role == 'assistant' %}{{- ' ' + message.content | trim + eos_token }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if message.tool_call_id is not defined or message.tool_call_id is none "
    "or message.tool_call_id | length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "{{- '[TOOL_RESULTS] {\"content\": ' + message.content | tojson + ', \"call_id\": \"' + message.tool_call_id"
    " + '\"}[/TOOL_RESULTS]' }}"
    "{%- else %}{{- raise_exception('Only user, assistant and tool roles are supported') }}{%- endif %}"
    "{%- endfor %}"
)
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
CONTROL = ["[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"]


@pytest.fixture(scope="module")
def fmt():
    """The Mistral miniature's tokenizer with v0.3's control tokens (special, as in the real
    tokenizer: a plain decode drops them) and the template above."""
    from turnrl.models import miniatures
    from turnrl.rollout.chat import ChatFormat
    tokenizer = miniatures.build_tokenizer(miniatures.FAMILIES["mistral"])
    tokenizer.add_special_tokens({"additional_special_tokens": CONTROL})
    tokenizer.chat_template = V3_TEMPLATE
    return ChatFormat(tokenizer)


def _call(call_id, expression: str = "6 * 7") -> dict:
    return {"id": call_id, "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})}}


def _decoded(fmt, ids) -> str:
    return fmt.tokenizer.decode(ids, skip_special_tokens=False)


def test_a_conversation_with_openai_call_ids_trains_with_nine_character_ids(fmt):
    """`call_0` (OpenAI's style) would make the template raise: each call's id becomes nine
    alphanumerics, the same in the call the model is taught and in the result it reads; a result
    without an id answers its call; ids already nine alphanumerics are kept."""
    from turnrl.data.conversations import Conversation
    from turnrl.envs.tools.parsers import parse_mistral
    from turnrl.gateway.conversations import conversation_samples
    from turnrl.rollout.chat import nine_char_id, renders_tool_calls
    assert renders_tool_calls(fmt.tokenizer)   # the calls are the template's own, not Hermes text
    messages = [{"role": "system", "content": "You compute."},
                {"role": "user", "content": "What is 6 times 7, 2 times 3?"},
                {"role": "assistant", "content": None, "tool_calls": [_call("call_0"), _call(None, "2 * 3")]},
                {"role": "tool", "tool_call_id": "call_0", "content": "42"},
                {"role": "tool", "content": "6"},
                {"role": "assistant", "content": None, "tool_calls": [_call("Abc123xyz", "42 + 6")]},
                {"role": "tool", "tool_call_id": "Abc123xyz", "content": "48"},
                {"role": "assistant", "content": "<answer>42 and 6</answer>"}]
    (s,) = conversation_samples(Conversation(messages, TOOLS, "chat.jsonl:1"), fmt, 4096).samples
    taught = [[t for t, m, k in zip(s.response_ids, s.loss_mask, s.turn_ids) if m and k == turn] for turn in range(3)]
    first, second = parse_mistral(_decoded(fmt, taught[0])), parse_mistral(_decoded(fmt, taught[1]))
    ids = [c.id for c in first.calls]
    assert [c.arguments["expression"] for c in first.calls] == ["6 * 7", "2 * 3"]
    assert ids[0] == nine_char_id("call_0") and all(len(i) == 9 and i.isalnum() for i in ids) and ids[0] != ids[1]
    assert [c.id for c in second.calls] == ["Abc123xyz"]   # already nine alphanumerics: kept
    results = _decoded(fmt, [t for t, m in zip(s.response_ids, s.loss_mask) if not m])
    assert f'"42", "call_id": "{ids[0]}"' in results and f'"6", "call_id": "{ids[1]}"' in results
    assert '"call_id": "Abc123xyz"' in results and "[INST]" not in results   # results in the tool format
    assert _decoded(fmt, taught[2]).strip() == "<answer>42 and 6</answer></s>"


def test_the_gateway_answers_with_the_model_s_own_call_id_and_the_next_request_extends_the_prompt(fmt):
    """An agent program on a Mistral v0.3 policy: the sampled `[TOOL_CALLS]` (a special token
    a plain decode drops) is parsed, the call returned with the id the model wrote; the program
    sends it back with the result, and the prompt is the last prompt + the sampled ids + the
    result's tokens. A model that repeats an earlier id gets the gateway's own id instead."""
    from turnrl.envs.tools.parsers import parse_mistral
    from turnrl.gateway.render import Produced, Renderer, normalize_messages
    renderer = Renderer(fmt, parse_mistral)
    first = normalize_messages([{"role": "user", "content": "What is 6 times 7?"}])
    prompt = renderer.prompt_ids(first, TOOLS)
    sampled = fmt.encode('[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "6 * 7"}, '
                         '"id": "Kx7Qp2mZ9"}]</s>')
    message = renderer.answer(sampled, parse_tools=True, call_id=lambda k: f"call_gateway_{k}")
    assert [c["id"] for c in message["tool_calls"]] == ["Kx7Qp2mZ9"]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"expression": "6 * 7"}
    again = renderer.answer(sampled, parse_tools=True, call_id=lambda k: f"call_gateway_{k}", taken_ids=["Kx7Qp2mZ9"])
    assert [c["id"] for c in again["tool_calls"]] == ["call_gateway_0"]

    second = normalize_messages([*first, message, {"role": "tool", "tool_call_id": "Kx7Qp2mZ9", "content": "42"}])
    following = renderer.prompt_ids(second, TOOLS, [Produced(list(sampled), message)])
    assert following[:len(prompt) + len(sampled)] == prompt + sampled
    assert _decoded(fmt, following[len(prompt) + len(sampled):]) == \
        '[TOOL_RESULTS] {"content": "42", "call_id": "Kx7Qp2mZ9"}[/TOOL_RESULTS]'


def test_a_tools_rollout_s_results_are_rendered_in_the_tool_format(fmt):
    """The `tools` environment's frame for a result: [TOOL_RESULTS], not the [INST] of a user
    turn (the template raised on a result without an id, so it fell back to one)."""
    assert fmt.rendered_role("tool") == "tool"
    text = fmt.observation_text(["42", "6"], "tool", after_eos=True)
    assert text.count("[TOOL_RESULTS]") == 2 and "[INST]" not in text and '"42"' in text


def test_each_result_names_the_id_of_the_call_it_answers(fmt):
    """Given the calls' ids, the frame writes each in its result's place (as nine alphanumerics,
    in one pass: an id that looks like a probe's is not rewritten again); an unknown one stays
    the probe's, and a template that names no ids is untouched."""
    text = fmt.observation_text(["42", "6", "1"], "tool", after_eos=True,
                                call_ids=["turnrl003", "call_0", None])
    results = text.split("[/TOOL_RESULTS]")[:3]
    assert '"call_id": "turnrl003"' in results[0]
    assert f'"call_id": "{nine_char_id("call_0")}"' in results[1]
    assert '"call_id": "turnrl003"' in results[2]   # the third's own probe id, kept
    assert fmt.observation_text(["42"], "tool", True, ["Kx7Qp2mZ9"]).count("Kx7Qp2mZ9") == 1


def test_a_tools_rollout_s_results_name_the_model_s_call_ids(fmt):
    """A `tools` rollout on the v0.3 format: the model's own call id reaches its result, in the
    tokens the policy is trained on and in the conversation's messages, and the results' tokens
    are the template's own render of the same calls and results."""
    from turnrl.envs.tools import make_tools_env
    from turnrl.rollout.multi_turn import replay
    env = make_tools_env(parser="mistral")
    call = ('[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "6 * 7"}, "id": "Kx7Qp2mZ9"}, '
            '{"name": "calculator", "arguments": {"expression": "2 + 4"}}]')
    # each turn closed, as a model's, by the end-of-turn token
    t = replay(env, fmt, {"prompt": "What is 6 * 7?", "answer": "42"}, [call, "<answer>42</answer>"])
    assert t.reward == 1.0
    start = t.first_observation
    end = t.loss_mask.index(1, start)
    observation = _decoded(fmt, t.response_ids[start:end])
    assert observation == ('[TOOL_RESULTS] {"content": "42", "call_id": "Kx7Qp2mZ9"}[/TOOL_RESULTS]'
                           '[TOOL_RESULTS] {"content": "6", "call_id": "turnrl002"}[/TOOL_RESULTS]')
    assert [m.get("tool_call_id") for m in t.messages if m["role"] == "tool"] == ["Kx7Qp2mZ9", None]
    # the template's render of that call and its results, from the end of the call on
    rendered = fmt.tokenizer.apply_chat_template([
        {"role": "user", "content": "What is 6 * 7?"},
        {"role": "assistant", "content": "", "tool_calls": [_call("Kx7Qp2mZ9"), _call("turnrl002", "2 + 4")]},
        {"role": "tool", "tool_call_id": "Kx7Qp2mZ9", "content": "42"},
        {"role": "tool", "tool_call_id": "turnrl002", "content": "6"}], tokenize=False)
    assert rendered.endswith(observation)


def test_the_doctor_says_how_call_ids_reach_the_template(fmt):
    from turnrl.models.template_checks import template_checks
    results, _ = template_checks(fmt.tokenizer)
    (template,) = [r for r in results if r.name == "template"]
    assert "tool observations in the tool role" in template.detail and "tool_calls rendered" in template.detail
    assert "call ids of nine alphanumerics only" in template.detail
