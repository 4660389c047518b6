"""A teacher of another tokenizer (`reward.teacher.tokenizer`): the policy's tokens mapped to the
teacher's through their text, and the teacher's logprobs mapped back.

    mapping = TextMapping(student_tokenizer, teacher_tokenizer)
    plan = mapping.plan(prompt_ids + response_ids, sampled)   # sampled: 1 per token the policy sampled
    ... ask the teacher for log p(plan.teacher_ids[j] | plan.teacher_ids[:j]) ...
    per_token = mapping.to_student(plan, teacher_logprobs, student_logprobs)

How (documented in docs/post-training.md, "A teacher of another tokenizer"):

1. The policy's ids are decoded, each token to the text it adds (incremental decoding; a
   character split over byte-level tokens belongs to the token that completes it).
2. The text is cut where the policy's sampled tokens start and end (its turns, against the prompt
   and the environment's observations), and each piece is encoded by the teacher's tokenizer on
   its own, so every turn starts and ends on a token boundary of both.
3. Within a turn, the boundaries both tokenizations share cut it into chunks (usually one token
   of each; a word one splits and the other does not is one chunk of several). A chunk's teacher
   logprob is the sum over the teacher's tokens in it, and so the policy's, over its tokens.
4. Each policy token of a chunk gets its own logprob plus an equal share of the chunk's
   difference: `t_i = s_i + (T_chunk - S_chunk) / n_chunk`. So the per-token reverse KL that opd
   trains on, `t_i - s_i`, sums over the chunk to the chunk's exact log-ratio.

A special token the policy sampled is a chunk of its own: the same special token of the teacher's
vocabulary, or, for the policy's end of turn (its eos, or the token its chat template closes a
turn with), the teacher's, so the teacher scores ending the turn there; any other gets no signal. Bytes the policy sampled that are no UTF-8
decode to U+FFFD: their chunk carries no signal either (its tokens get their own logprob); both
counted (Plan.counts). A teacher tokenizer that puts a space before every text it encodes
(SentencePiece's legacy prefix, "▁": Llama 2, Mistral) encodes every piece after the first
without it (`continuing`), so a turn does not read as starting with a space. `plan` reads the
policy's chat rendering as the context (its markup as text the teacher's tokenizer may not know:
fine for a teacher of the same chat format); `plan_rendered` (reward.teacher.chat_template:
teacher) renders the conversation's messages with the teacher's own template instead, the
policy's sampled turns in it. Needs a fast (Rust) teacher tokenizer, for its character offsets.
"""
from __future__ import annotations

import json
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any, Sequence

WINDOW = 6   # tokens of left context decoded with each token (a leading space, a split character)


def token_texts(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """The text each of `ids` adds to their decoding (special tokens as their text); a token that
    ends inside a character adds "" and the one that completes it the whole character. The pieces
    join to the decoding of all `ids`, else ValueError."""
    def decode(part: Sequence[int]) -> str:
        return tokenizer.decode(list(part), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    pieces: list[str] = []
    start = read = 0          # decode ids[start:] for context; ids[read:] not yet given text
    for i in range(len(ids)):
        before, after = decode(ids[start:read]), decode(ids[start:i + 1])
        if after.endswith("\ufffd") and i + 1 < len(ids) and i - read < 3:
            pieces.append("")   # a character still incomplete (UTF-8: at most 4 bytes; longer is no UTF-8)
            continue
        if not after.startswith(before):
            raise ValueError(f"token {i} (id {ids[i]}) changes the text before it when decoded")
        pieces.append(after[len(before):])
        read, start = i + 1, max(0, i + 1 - WINDOW)
    whole = decode(ids)
    if "".join(pieces) != whole:
        raise ValueError("the policy's tokens do not decode piece by piece to their whole text")
    return pieces


def continuing(tokenizer: Any) -> Any:
    """The backend (a `tokenizers.Tokenizer`) of a fast `tokenizer` for a text that continues
    another: without SentencePiece's legacy prefix (a Prepend("▁") normaliser, a Metaspace
    pre-tokenizer that prepends), which would put a space before it. None where the tokenizer
    has neither (byte-level BPE: a piece is encoded as it is)."""
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    found = []

    def strip(component: dict | None, kind: str) -> dict | None:
        if component is None:
            return None
        if component.get("type") == "Sequence":
            component[kind] = [c for c in (strip(c, kind) for c in component[kind]) if c is not None]
        elif component.get("type") == "Prepend":
            found.append(component)
            return None
        elif component.get("type") == "Metaspace" and component.get("prepend_scheme", "always") != "never" \
                and component.get("add_prefix_space", True):
            found.append(component)
            component.update({"prepend_scheme": "never"} if "prepend_scheme" in component else {"add_prefix_space": False})
        return component

    state["normalizer"] = strip(state.get("normalizer"), "normalizers")
    state["pre_tokenizer"] = strip(state.get("pre_tokenizer"), "pretokenizers")
    if not found:
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_str(json.dumps(state))


@dataclass
class Plan:
    """One sequence mapped: the teacher's ids for its text, and per sampled turn the chunks."""
    teacher_ids: list[int]
    # per chunk: (the policy tokens' positions, the teacher tokens' positions) in each sequence; no
    # teacher positions where the text is not what the policy sampled (bytes that are no UTF-8)
    chunks: list[tuple[list[int], list[int]]]

    def counts(self) -> dict[str, int]:
        """Sampled tokens: all, those of a chunk of one token each side (their own teacher logprob),
        and those of a chunk the teacher cannot read (no signal)."""
        return {"tokens": sum(len(m) for m, _ in self.chunks),
                "exact": sum(len(m) for m, t in self.chunks if len(m) == len(t) == 1),
                "unreadable": sum(len(m) for m, t in self.chunks if not t)}


class TextMapping:
    def __init__(self, student_tokenizer: Any, teacher_tokenizer: Any, chat_format: Any = None):
        """`chat_format`: tokenizer -> its chat format (turnrl.rollout.chat.ChatFormat, given by
        the caller: rewards does not import rollout), for the token each template ends a turn
        with and the roles each takes (`plan_rendered`); None: the tokenizers' eos, and the
        messages as they are."""
        if not getattr(teacher_tokenizer, "is_fast", False):
            raise ValueError("reward.teacher.tokenizer: a fast (Rust) tokenizer is needed for its character "
                             "offsets; this one is a slow (Python) tokenizer")
        self.student, self.teacher = student_tokenizer, teacher_tokenizer
        self.teacher_continuing = continuing(teacher_tokenizer)   # pieces after the first (module doc)
        self.teacher_format = chat_format(teacher_tokenizer) if chat_format else None
        # the tokens that end a turn: the policy's eos and the one its chat template closes a turn
        # with; the teacher's template's (else its eos)
        self.student_ends = {student_tokenizer.eos_token_id} - {None}
        self.teacher_end = teacher_tokenizer.eos_token_id
        if chat_format:
            self.student_ends |= {_or_none(lambda: chat_format(student_tokenizer).end_of_turn_id)} - {None}
            end = _or_none(lambda: self.teacher_format.end_of_turn_id)
            self.teacher_end = self.teacher_end if end is None else end   # (an id may be 0)
        self.student_specials, self.teacher_specials = (
            set(tok.all_special_ids) | {i for i, t in getattr(tok, "added_tokens_decoder", {}).items() if t.special}
            for tok in (student_tokenizer, teacher_tokenizer))

    def _encode(self, text: str, first: bool) -> tuple[list[int], list[tuple[int, int]]]:
        """The teacher's ids of `text` and each one's (start, end) characters; `first`: the
        sequence's first piece (encoded as the teacher encodes a whole text)."""
        if first or self.teacher_continuing is None:
            enc = self.teacher(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
            return enc["input_ids"], enc["offset_mapping"]
        enc = self.teacher_continuing.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def plan(self, ids: Sequence[int], sampled: Sequence[int]) -> Plan:
        """`ids`: the policy's whole sequence [n]; `sampled`: 1 where the policy sampled the token
        (its loss mask over the sequence), else 0."""
        texts = token_texts(self.student, ids)
        teacher_ids: list[int] = []
        chunks: list[tuple[list[int], list[int]]] = []
        k = 0
        while k < len(ids):   # runs of equal `sampled`: a turn, or the text between turns
            if sampled[k] and ids[k] in self.student_specials:   # a special token sampled: a run of its own
                teacher_ids += self._special(ids[k], texts[k], k, len(teacher_ids), chunks)
                k += 1
                continue
            end = k
            while end < len(ids) and bool(sampled[end]) == bool(sampled[k]) and not (
                    sampled[end] and ids[end] in self.student_specials):
                end += 1
            text = "".join(texts[k:end])
            ids_k, offsets = self._encode(text, first=k == 0)
            if sampled[k]:
                chunks += _readable(_chunks(texts[k:end], offsets, len(text), range(k, end), len(teacher_ids)), texts)
            teacher_ids += ids_k
            k = end
        return Plan(teacher_ids, chunks)

    def plan_rendered(self, ids: Sequence[int], sampled: Sequence[int], messages: Sequence[dict],
                      tools: Sequence[dict] = ()) -> Plan:
        """`plan` for the teacher's own chat template (reward.teacher.chat_template: teacher): the
        conversation's `messages` rendered by it, each assistant message's content replaced by
        the text the policy sampled in that turn (its sampled tokens but special ones; its tool
        calls are in that text), and the roles adapted as the teacher's template takes them
        (ChatFormat.messages_for_template), so the teacher scores exactly those tokens. The
        sampled turns are the last assistant messages (any before them are context). The
        policy's end of turn maps to the special token the teacher's template puts right after
        the turn, if one; other sampled special tokens get no signal. ValueError where there are
        fewer assistant messages than turns or the template does not keep a turn whole."""
        texts = token_texts(self.student, ids)
        turns: list[list[int]] = []   # the sampled positions of each turn (a run of sampled tokens)
        for i, s in enumerate(sampled):
            if s:
                if not turns or not sampled[i - 1]:
                    turns.append([])
                turns[-1].append(i)
        # the last assistant messages are the sampled turns; any before them were context (an agent
        # program's own, or a call's that started another sample)
        assistant = [k for k, m in enumerate(messages) if m.get("role") == "assistant"][-len(turns):] if turns else []
        if len(assistant) != len(turns):
            raise ValueError(f"{len(turns)} sampled turns against {len(assistant)} assistant messages")
        marks = [f"TURNRLTURN{r}X" for r in range(len(turns))]   # no space, no markup: kept as they are
        shown = [dict(m) for m in messages]
        for k, mark in zip(assistant, marks):   # the turn as sampled: its tool calls are in its text
            shown[k] = {"role": "assistant", "content": mark}
        if self.teacher_format is not None:
            shown = self.teacher_format.messages_for_template(shown)
        rendered = self.teacher.apply_chat_template(shown, tools=list(tools) or None, tokenize=False)
        teacher_ids: list[int] = []
        chunks: list[tuple[list[int], list[int]]] = []
        at = 0
        for r, (positions, mark) in enumerate(zip(turns, marks)):
            start = rendered.find(mark, at)
            if start < 0 or rendered.count(mark) != 1:
                raise ValueError(f"the teacher's chat template does not render assistant turn {r} as one piece")
            body = [i for i in positions if ids[i] not in self.student_specials]
            text = "".join(texts[i] for i in body)
            context, _ = self._encode(rendered[at:start], first=at == 0)
            teacher_ids += context
            if text:
                ids_r, offsets = self._encode(text, first=not teacher_ids)
                chunks += _readable(_chunks([texts[i] for i in body], offsets, len(text), body, len(teacher_ids)),
                                    texts)
                teacher_ids += ids_r
            at = start + len(mark)
            for i in (i for i in positions if ids[i] in self.student_specials):
                after = self._encode(rendered[at:at + 64], first=False)[0][:1]   # what the template puts next
                ends = ids[i] in self.student_ends and after and after[0] in self.teacher_specials
                chunks.append(([i], [len(teacher_ids)] if ends else []))
        teacher_ids += self._encode(rendered[at:], first=at == 0)[0]
        return Plan(teacher_ids, sorted(chunks))

    def _special(self, token: int, text: str, position: int, teacher_position: int,
                 chunks: list[tuple[list[int], list[int]]]) -> list[int]:
        """A special token the policy sampled (its end of turn, say) at `position`: the teacher's
        ids for it, its chunk appended to `chunks`. The same special token in the teacher's
        vocabulary: that one. The policy's end of turn (its eos, or its template's): the
        teacher's (its template's, else its eos), so the teacher says how likely it was to end
        the turn there. Else: its text, for the teacher to read, and no signal (the teacher has
        no such token to score)."""
        ids, _ = self._encode(text, first=position == 0)
        if len(ids) == 1 and ids[0] in self.teacher_specials:
            chunks.append(([position], [teacher_position]))
            return ids
        if token in self.student_ends and self.teacher_end is not None:
            chunks.append(([position], [teacher_position]))
            return [self.teacher_end]
        chunks.append(([position], []))
        return ids

    @staticmethod
    def to_student(plan: Plan, teacher_logprobs: Sequence[float], student_logprobs: Sequence[float]
                   ) -> dict[int, float]:
        """The teacher's logprob for each sampled policy position (module doc, step 4):
        `teacher_logprobs` [len(plan.teacher_ids)] of the teacher's ids, `student_logprobs` the
        policy's own per position of its sequence."""
        out: dict[int, float] = {}
        for mine, theirs in plan.chunks:
            if not theirs:   # text the teacher cannot read (Plan.chunks): no signal
                out.update((i, student_logprobs[i]) for i in mine)
                continue
            gap = sum(teacher_logprobs[j] for j in theirs) - sum(student_logprobs[i] for i in mine)
            for i in mine:
                out[i] = student_logprobs[i] + gap / len(mine)
        return out


def _or_none(read):
    """`read()`, or None where it raises (a tokenizer with no chat template)."""
    try:
        return read()
    except Exception:   # noqa: BLE001
        return None


def _readable(chunks: list[tuple[list[int], list[int]]], texts: Sequence[str]) -> list[tuple[list[int], list[int]]]:
    """`chunks` with no teacher positions where the policy's text is bytes that are no UTF-8: they
    decode to U+FFFD, which the teacher would read as another text (no signal there)."""
    return [(mine, [] if "\ufffd" in "".join(texts[i] for i in mine) else theirs) for mine, theirs in chunks]


def _chunks(pieces: Sequence[str], teacher_spans: Sequence[tuple[int, int]], length: int, positions: Sequence[int],
            teacher_first: int) -> list[tuple[list[int], list[int]]]:
    """A turn's chunks: cut where a policy token and a teacher token end at the same character.
    `pieces`: the policy tokens' texts, at `positions` in its sequence; `teacher_spans`: each
    teacher token's (start, end) characters; `teacher_first`: the turn's first position in the
    teacher's. A token of no width (a byte of a character another token completes) joins the
    chunk of what follows it."""
    mine, at = [], 0
    for piece in pieces:
        mine.append((at, at + len(piece)))
        at += len(piece)
    theirs, top = [], 0
    for start, end in teacher_spans:   # offsets may step back (a token inside another's span): keep them rising
        theirs.append((min(start, max(top, end)), max(top, end)))
        top = max(top, end)
    if theirs:
        theirs[-1] = (theirs[-1][0], length)   # trailing text no teacher token claims joins the last one
    cuts = sorted(({e for _, e in mine} & {e for _, e in theirs}) | {length})

    def chunk_of(start: int, end: int) -> int:   # the chunk holding the token's last character
        return min(bisect_right(cuts, end - 1 if end > start else end), len(cuts) - 1)

    chunks: list[tuple[list[int], list[int]]] = [([], []) for _ in cuts]
    for position, span in zip(positions, mine):
        chunks[chunk_of(*span)][0].append(position)
    for j, span in enumerate(theirs):
        chunks[chunk_of(*span)][1].append(teacher_first + j)
    return [c for c in chunks if c[0]]
