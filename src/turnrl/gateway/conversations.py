"""A recorded conversation as the training samples RL would make of it (the `sft` stage).

A conversation in the OpenAI messages format is read as if an agent program had sent it to the
gateway call by call: every assistant message is one call, whose prompt is the messages before
it rendered by `Renderer` (the model's chat template, tools included, earlier assistant
messages spliced in as the ids they were "sampled" as) and whose completion is the assistant
message as the template writes it, up to and including the token that closes the turn. The
calls are then merged into samples by the gateway's own `chains` and `sample_trajectory`. So
SFT trains exactly the tokens, and the masks, that RL trains when the same conversation happens
in a rollout: assistant tokens 1; system, user, tool results and the template's framing 0 (and
an assistant message of `"weight": 0`, OpenAI's fine-tuning key for context the model is not
taught).

    user U, assistant A1 (tool call), tool T, assistant A2
    calls    [P(U) -> A1]  [P(U) A1 T' -> A2]            (T': the tool message's frame and text)
    sample   [P(U) | A1 T' A2]   mask [1.. 0.. 1..]

A template that renders earlier turns differently once the conversation goes on (one that drops
earlier reasoning) makes a call that does not extend the last: a sample of its own, as in RL.
"""
from __future__ import annotations

from dataclasses import dataclass

from turnrl.data.conversations import Conversation
from turnrl.data.sources import MalformedDataError
from turnrl.gateway.render import BadRequest, Produced, Renderer, normalize_messages
from turnrl.gateway.samples import Call, chains, sample_trajectory
from turnrl.rollout.chat import ChatFormat
from turnrl.rollout.multi_turn import Trajectory


class ConversationError(MalformedDataError):
    """A conversation the model's template cannot render, or one that cannot be trained on;
    the message names its file and row."""


@dataclass
class Rendered:
    """A conversation's training samples, and how many were cut or dropped at max_length."""
    samples: list[Trajectory]
    truncated: int = 0
    dropped: int = 0


def conversation_samples(conversation: Conversation, fmt: ChatFormat, max_length: int) -> Rendered:
    """The samples of one conversation (see the module doc), each at most `max_length` tokens:
    a longer one is cut at the right (its later tokens dropped), one whose prompt alone fills
    it is dropped. ConversationError naming the row for what cannot be rendered or trained."""
    where = conversation.where
    try:
        messages = normalize_messages(conversation.messages)
    except BadRequest as exc:
        raise ConversationError(f"{where}: {exc}") from None
    renderer = Renderer(fmt, parser=None)
    # each earlier assistant message is spliced in as its own call's ids, found by its place in the
    # conversation (not by tool-call ids, which a file may reuse from turn to turn)
    produced: dict[int, Produced] = {}
    calls: list[Call] = []
    untrained: set[int] = set()   # the calls of assistant messages of weight 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if not any(m["role"] == "user" for m in messages[:i]):
            raise ConversationError(f"{where}: messages[{i}] is an assistant message before any user message; "
                                    "a conversation to learn from starts with a user's request")
        try:
            prompt = renderer.spliced_prompt_ids(messages[:i], conversation.tools, produced)
            text = assistant_text(renderer, messages[:i + 1], conversation.tools)
        except BadRequest as exc:
            raise ConversationError(f"{where}: messages[{i}]: {exc}") from None
        completion = fmt.encode(text)
        if len(completion) > max_length:
            raise ConversationError(f"{where}: messages[{i}], an assistant message of {len(completion)} tokens, does "
                                    f"not fit in sft.max_length = {max_length}; raise it or shorten the message")
        weight = conversation.messages[i].get("weight", 1)
        if weight not in (0, 1):
            raise ConversationError(f"{where}: messages[{i}]: weight = {weight!r}; an assistant message's weight is "
                                    "1 (trained on) or 0 (context only), as in OpenAI's fine-tuning format")
        if weight == 0:
            untrained.add(len(calls))
        calls.append(Call(index=len(calls), prompt_ids=prompt, completion_ids=completion,
                          logprobs=[0.0] * len(completion), version=0, finish="stop", text=text))
        produced[i] = Produced(completion, message)
    if not calls:
        raise ConversationError(f"{where}: no assistant message, nothing to learn")
    example = {"id": where, "prompt": next(m["content"] for m in messages if m["role"] == "user")}
    out = Rendered([])
    for chain in chains(calls):
        sample = sample_trajectory(chain, example, len(calls))
        sample.loss_mask = [0 if turn in untrained else m for m, turn in zip(sample.loss_mask, sample.turn_ids)]
        if not any(sample.loss_mask):   # every assistant message of it weight 0: context for later samples only
            continue
        full = len(sample.prompt_ids) + len(sample.response_ids)
        kept = fit(sample, max_length)
        if kept is None:
            out.dropped += 1
        else:
            out.truncated += len(kept.prompt_ids) + len(kept.response_ids) < full
            out.samples.append(kept)
    return out


def assistant_text(renderer: Renderer, messages: list[dict], tools: list[dict]) -> str:
    """The last of `messages` (an assistant message) as the template writes it after the
    generation prompt, ending with the token that closes the turn (what a model that said it
    would have sampled)."""
    before = renderer.render(messages[:-1], tools)   # ends with the assistant's generation prompt
    after = renderer.render(messages, tools)         # ... the message, closed, and the next generation prompt
    if not after.startswith(before):
        raise BadRequest("the chat template renders the messages before this one differently once it follows them; "
                         "this conversation cannot be split into the calls RL would make")
    text = after[len(before):]
    fmt = renderer.fmt
    if fmt.template_type == "base":   # no closing token in the text: the turn ends with eos
        next_prompt = renderer.render([{"role": "user", "content": ""}], [])
        cut = next_prompt[next_prompt.rfind("\n"):]   # "\nAssistant:"
        return text[:len(text) - len(cut)] + (fmt.eos_token or "")
    end = fmt.end_of_turn
    if not end or end not in text:
        raise BadRequest(f"the chat template does not close the assistant message with {end!r}")
    return text[:text.index(end) + len(end)]


def fit(sample: Trajectory, max_length: int) -> Trajectory | None:
    """`sample` cut to `max_length` tokens at the right; None when nothing trained would remain."""
    room = max_length - len(sample.prompt_ids)
    if room <= 0 or not any(sample.loss_mask[:room]):
        return None
    if len(sample.response_ids) > room:
        sample.response_ids, sample.loss_mask = sample.response_ids[:room], sample.loss_mask[:room]
        sample.turn_ids, sample.engine_logprobs = sample.turn_ids[:room], sample.engine_logprobs[:room]
    return sample
