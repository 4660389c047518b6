"""A teacher of another tokenizer (reward.teacher.tokenizer): the policy's tokens mapped to the
teacher's through their text (turnrl.rewards.token_mapping), on real byte-level BPE tokenizers of
two vocabularies and two chat families, and through Teacher.annotate against a loopback server."""
from __future__ import annotations

import pytest

from turnrl.config.sections import TeacherCfg
from turnrl.models.miniatures import FAMILIES, build_tokenizer
from turnrl.rewards.teacher import Teacher, check_server_tokenizer, check_tokenizer, teacher_metrics
from turnrl.rewards.token_mapping import TextMapping, token_texts
from turnrl.rollout.multi_turn import Trajectory

from judge_server import TeacherServer

MESSAGES = [
    {"role": "system", "content": "You are careful."},
    {"role": "user", "content": "Ada has 3 apples → and buys 4. How many, café 🙂?"},
    {"role": "assistant", "content": "<code>print(3 + 4)</code>"},
    {"role": "tool", "content": "<output>7</output>"},
    {"role": "assistant", "content": "Ada has 7 apples, naïve 🙂. <answer>7</answer>"},
]


@pytest.fixture(scope="module")
def tokenizers():
    """The policy's (qwen2's chat format, 512 tokens) and two teachers': the same format with
    300 tokens (so words split differently), and llama's format (other special tokens)."""
    return (build_tokenizer(FAMILIES["qwen2"], 512), build_tokenizer(FAMILIES["qwen2"], 300),
            build_tokenizer(FAMILIES["llama"], 400))


def _conversation(tokenizer, messages=MESSAGES) -> tuple[list[int], list[int]]:
    """The rendered conversation's ids and 1 on the assistant's turns' tokens (what the policy sampled)."""
    ids, sampled = [], []
    for k in range(len(messages)):
        upto = tokenizer.apply_chat_template(messages[:k + 1], tokenize=False)
        done = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        new = tokenizer(upto[len(done):], add_special_tokens=False)["input_ids"]
        ids += new
        sampled += [int(messages[k]["role"] == "assistant")] * len(new)
    return ids, sampled


def test_each_token_gets_the_text_it_adds_and_a_split_character_goes_to_the_token_completing_it(tokenizers):
    policy = tokenizers[0]
    ids = policy("café 🙂 → naïve", add_special_tokens=False)["input_ids"]
    pieces = token_texts(policy, ids)
    assert "".join(pieces) == "café 🙂 → naïve" and len(pieces) == len(ids)
    assert "🙂" in pieces and "" in pieces   # the emoji's bytes: "" until the token that completes it
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("teacher", [1, 2], ids=["same-format-other-vocabulary", "llama-format"])
def test_every_chunk_is_the_same_text_in_both_tokenizations_and_holds_each_sampled_token_once(tokenizers, teacher):
    policy, other = tokenizers[0], tokenizers[teacher]
    ids, sampled = _conversation(policy)
    plan = TextMapping(policy, other).plan(ids, sampled)
    pieces = token_texts(policy, ids)
    mine = [i for chunk, _ in plan.chunks for i in chunk]
    assert sorted(mine) == [i for i, s in enumerate(sampled) if s]   # every sampled token, once; nothing else
    assert len(plan.chunks) > 10 and any(len(c[0]) != len(c[1]) for c in plan.chunks)   # the vocabularies differ
    ends = [i for i in mine if ids[i] == policy.eos_token_id]   # the end of each assistant turn, <|im_end|>
    assert len(ends) == 2
    for chunk, theirs in plan.chunks:
        text = "".join(pieces[i] for i in chunk)
        read = other.decode([plan.teacher_ids[j] for j in theirs], skip_special_tokens=False)
        if teacher == 2 and chunk[0] in ends:   # the policy's end of turn: the teacher's own
            assert [plan.teacher_ids[j] for j in theirs] == [other.eos_token_id] and read == "<|eot_id|>"
        elif teacher == 2 and ids[chunk[0]] == policy.convert_tokens_to_ids("<|im_start|>"):
            assert theirs == []   # a special token llama's vocabulary lacks: no signal
        else:
            assert read == text
    # the teacher reads the same text: the whole conversation, in its own tokens (llama's: its own
    # end of turn for the policy's)
    whole = "".join("<|eot_id|>" if teacher == 2 and i in ends else piece for i, piece in enumerate(pieces))
    assert other.decode(plan.teacher_ids, skip_special_tokens=False) == whole
    counts = plan.counts()
    assert counts["unreadable"] == (2 if teacher == 2 else 0)   # the two sampled <|im_start|> llama lacks


def test_a_chunks_teacher_logprobs_come_back_as_its_exact_log_ratio_shared_equally(tokenizers):
    policy, other = tokenizers[0], tokenizers[1]
    ids, sampled = _conversation(policy)
    plan = TextMapping(policy, other).plan(ids, sampled)
    teacher = [-0.01 * (j % 7) - 0.1 for j in range(len(plan.teacher_ids))]
    student = [-0.02 * (i % 5) - 0.05 for i in range(len(ids))]
    mapped = TextMapping.to_student(plan, teacher, student)
    for chunk, theirs in plan.chunks:
        ratios = [mapped[i] - student[i] for i in chunk]
        assert sum(ratios) == pytest.approx(sum(teacher[j] for j in theirs) - sum(student[i] for i in chunk))
        assert max(ratios) == pytest.approx(min(ratios))   # shared equally within the chunk
    # one token each side: the teacher's own logprob, unchanged
    one = [(c, t) for c, t in plan.chunks if len(c) == len(t) == 1]
    assert one and all(mapped[c[0]] == pytest.approx(teacher[t[0]]) for c, t in one)


def test_bytes_that_are_no_utf8_carry_no_signal_and_are_counted(tokenizers):
    policy = tokenizers[0]
    emoji = policy("🙂", add_special_tokens=False)["input_ids"]
    assert len(emoji) > 1   # its bytes are tokens of their own in this vocabulary
    prompt = policy("Say:", add_special_tokens=False)["input_ids"]
    sampled_ids = policy(" ok ", add_special_tokens=False)["input_ids"] + emoji[1:] + \
        policy(" done", add_special_tokens=False)["input_ids"]   # the emoji without its first byte
    ids = prompt + sampled_ids
    plan = TextMapping(policy, tokenizers[1]).plan(ids, [0] * len(prompt) + [1] * len(sampled_ids))
    counts = plan.counts()
    assert counts["tokens"] == len(sampled_ids) and counts["unreadable"] >= len(emoji) - 1
    garbage = emoji[1:] * 100   # bytes that never complete a character: each given its U+FFFD in turn
    assert "".join(token_texts(policy, garbage)) == policy.decode(garbage)
    student = [-1.0] * len(ids)
    mapped = TextMapping.to_student(plan, [-3.0] * len(plan.teacher_ids), student)
    for mine, theirs in plan.chunks:
        if not theirs:
            assert all(mapped[i] == student[i] for i in mine)   # no signal: the policy's own logprob


def _sentencepiece(style: str):
    """A BPE teacher tokenizer of SentencePiece's legacy kind, which puts "▁" (a space) before every
    text it encodes: "metaspace" (a Metaspace pre-tokenizer, prepend_scheme first) or "prepend"
    (Llama 2's tokenizer.json: a Prepend("▁") normaliser, no pre-tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    if style == "metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    else:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    alphabet = [chr(c) for c in range(33, 127)] + ["▁", "\n"]
    corpus = [m["content"] for m in ASCII_MESSAGES] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"], initial_alphabet=alphabet))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


# the conversation without its characters beyond ASCII (the SentencePiece teachers here have no bytes)
ASCII_MESSAGES = [{**m, "content": m["content"].encode("ascii", "ignore").decode()} for m in MESSAGES]


@pytest.mark.parametrize("style", ["metaspace", "prepend"])
def test_a_sentencepiece_teacher_reads_each_turn_without_the_space_it_puts_before_a_text(tokenizers, style):
    """SentencePiece's legacy prefix: the teacher encodes "<code>" as "▁<code>"; each piece after
    the first is encoded without it, so the teacher reads the policy's text, not a space before
    every turn and observation."""
    policy, teacher = tokenizers[0], _sentencepiece(style)
    assert teacher.convert_ids_to_tokens(teacher("<code>", add_special_tokens=False)["input_ids"])[0].startswith("▁")
    ids, sampled = _conversation(policy, ASCII_MESSAGES)
    pieces = token_texts(policy, ids)
    mapping = TextMapping(policy, teacher)
    anchor = teacher.convert_tokens_to_ids("a")   # decoded first, so no decoder strips the text's own leading space

    def read(teacher_ids: list[int]) -> str:
        return teacher.decode([anchor, *teacher_ids])[1:]

    plan = mapping.plan(ids, sampled)
    assert read(plan.teacher_ids) == " " + "".join(pieces)   # the first piece's space: as the whole text encoded
    for chunk, theirs in plan.chunks:
        if theirs:   # (none for the policy's special tokens this teacher lacks: <|im_start|>, <|im_end|>)
            assert read([plan.teacher_ids[j] for j in theirs]) == "".join(pieces[i] for i in chunk)
    assert sum(1 for _, theirs in plan.chunks if theirs) > 10
    mapping.teacher_continuing = None   # each piece encoded alone, as before: a space before every one
    assert read(mapping.plan(ids, sampled).teacher_ids).count(" ") > read(plan.teacher_ids).count(" ")


def _rolled_out(tokenizer, messages=MESSAGES) -> tuple[list[int], list[int]]:
    """The conversation as a rollout holds it: each assistant turn's header in the context (not
    sampled), its content and the eos that ended it sampled."""
    ids, sampled = [], []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        context = tokenizer.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True)
        done = tokenizer.decode(ids, skip_special_tokens=False)
        new = tokenizer(context[len(done):], add_special_tokens=False)["input_ids"]
        turn = tokenizer(message["content"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids, sampled = ids + new + turn, sampled + [0] * len(new) + [1] * len(turn)
    return ids, sampled


def test_the_teachers_chat_template_renders_the_conversation_around_the_policys_turns(tokenizers):
    """chat_template: teacher: a llama-format teacher reads its own rendering of the conversation
    (its headers, its system preamble, its tool role), each assistant turn the policy's sampled
    text, and the policy's eos (<|im_end|>) maps to the token its template ends a turn with."""
    policy, llama = tokenizers[0], tokenizers[2]
    ids, sampled = _rolled_out(policy)
    plan = TextMapping(policy, llama).plan_rendered(ids, sampled, MESSAGES)
    assert llama.decode(plan.teacher_ids, skip_special_tokens=False) == llama.apply_chat_template(MESSAGES, tokenize=False)
    assert sorted(i for chunk, _ in plan.chunks for i in chunk) == [i for i, s in enumerate(sampled) if s]
    pieces, ends = token_texts(policy, ids), 0
    for chunk, theirs in plan.chunks:
        read = llama.decode([plan.teacher_ids[j] for j in theirs], skip_special_tokens=False)
        if ids[chunk[0]] == policy.eos_token_id:
            assert read == "<|eot_id|>"
            ends += 1
        else:
            assert read == "".join(pieces[i] for i in chunk)
    assert ends == 2 and plan.counts()["unreadable"] == 0
    # the policy's text in the turn, not the message's: the teacher scores what was sampled
    edited = [dict(m) for m in MESSAGES]
    edited[2]["content"] = "something else"
    assert TextMapping(policy, llama).plan_rendered(ids, sampled, edited).teacher_ids == plan.teacher_ids
    with pytest.raises(ValueError, match="2 sampled turns against 1 assistant messages"):
        TextMapping(policy, llama).plan_rendered(ids, sampled, MESSAGES[:3])
    # an assistant message before the sampled ones (an agent's own, in its context) is context
    shown = [MESSAGES[0], {"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"},
             *MESSAGES[1:]]
    earlier = TextMapping(policy, llama).plan_rendered(ids, sampled, shown)
    assert llama.decode(earlier.teacher_ids, skip_special_tokens=False) == llama.apply_chat_template(shown, tokenize=False)
    assert [c for c, _ in earlier.chunks] == [c for c, _ in plan.chunks]


def test_a_tool_result_reaches_a_teacher_with_a_tool_role_as_a_tool_message():
    """A code_tool rollout of a policy whose template has no tool role (Mistral's: the tool's
    answer goes as a user message) keeps the tool's answer as a tool message in its conversation;
    a teacher whose template has one (qwen2's <tool_response>) reads it so, and the policy's own
    rendering of that conversation (the sft stage's) is still its rollout's tokens."""
    import random
    from turnrl import envs
    from turnrl.data.conversations import Conversation
    from turnrl.data.synthetic import product_demonstration, product_rows
    from turnrl.gateway.conversations import conversation_samples
    from turnrl.rollout.chat import ChatFormat
    from turnrl.rollout.multi_turn import replay
    policy, teacher = build_tokenizer(FAMILIES["mistral"], 400), build_tokenizer(FAMILIES["qwen2"], 300)
    fmt = ChatFormat(policy)
    assert fmt.rendered_role("tool") == "user" and ChatFormat(teacher).rendered_role("tool") == "tool"
    row = product_rows(8, seed=0, split="train", exclude=set())[0]
    t = replay(envs.resolve("code_tool").factory(), fmt, row, product_demonstration(row, random.Random(0), True).turns)
    assert [m["role"] for m in t.messages] == ["system", "user", "assistant", "tool", "assistant"]
    output = t.messages[3]["content"]
    (sample,) = conversation_samples(Conversation(t.messages, t.tools, "rollout"), fmt, 4096).samples
    assert sample.prompt_ids == t.prompt_ids and sample.response_ids[:len(t.response_ids)] == t.response_ids
    ids = t.prompt_ids + t.response_ids
    sampled = [0] * len(t.prompt_ids) + t.loss_mask
    read = teacher.decode(TextMapping(policy, teacher, ChatFormat).plan_rendered(ids, sampled, t.messages, t.tools)
                          .teacher_ids, skip_special_tokens=False)
    assert f"<tool_response>\n{output}\n</tool_response>" in read
    assert f"<|im_start|>user\n{output}" not in read


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_familys_template_reads_the_conversation_as_it_takes_it(tokenizers, family):
    """chat_template: teacher with each family of the compatibility matrix as the teacher: those
    that refuse a system message (Gemma 2) or a tool message (Mistral, Gemma: roles must alternate)
    get them as their own chat adapts them (ChatFormat.messages_for_template); each sampled token
    reads the same text, and the policy's end of turn maps to the one the family's template writes."""
    from turnrl.rollout.chat import ChatFormat
    policy, teacher = tokenizers[0], build_tokenizer(FAMILIES[family], 400)
    ids, sampled = _rolled_out(policy)
    plan = TextMapping(policy, teacher, ChatFormat).plan_rendered(ids, sampled, MESSAGES)
    read = teacher.decode(plan.teacher_ids, skip_special_tokens=False)
    assert "You are careful." in read and "<output>7</output>" in read   # the system prompt and the tool's answer
    pieces, end = token_texts(policy, ids), ChatFormat(teacher).end_of_turn
    for chunk, theirs in plan.chunks:
        text = teacher.decode([plan.teacher_ids[j] for j in theirs], skip_special_tokens=False)
        assert text == (end if ids[chunk[0]] == policy.eos_token_id else "".join(pieces[i] for i in chunk))


def test_annotate_with_the_teachers_chat_template_and_without_messages(tokenizers, tmp_path):
    """Teacher.annotate sends the teacher's rendering (chat_template: teacher); a sample that
    keeps no messages (an agent program's calls that sent none) ends its trajectory env_error,
    saying why. A teacher tokenizer with no
    chat template is refused before any work."""
    policy, llama = tokenizers[0], tokenizers[2]
    llama.save_pretrained(tmp_path / "teacher_tokenizer")
    ids, sampled = _rolled_out(policy)
    start = sampled.index(1)
    t = Trajectory(example={"id": "row-0"}, prompt_ids=ids[:start], messages=MESSAGES)
    t.response_ids, t.loss_mask = ids[start:], sampled[start:]
    t.engine_logprobs = [-0.5 if s else 0.0 for s in sampled[start:]]
    agent = Trajectory(example={"id": "row-1"}, prompt_ids=ids[:start])
    agent.samples = [Trajectory(example={"id": "row-1"}, prompt_ids=ids[:start], response_ids=ids[start:],
                                loss_mask=sampled[start:], engine_logprobs=list(t.engine_logprobs))]
    cfg = TeacherCfg(base_url="", tokenizer=str(tmp_path / "teacher_tokenizer"), chat_template="teacher")
    server = TeacherServer()   # log p(token) = -token / 100, of the ids it is sent
    try:
        Teacher(cfg.model_copy(update={"base_url": server.url}), policy).annotate([t, agent])
    finally:
        server.close()
    plan = TextMapping(policy, llama).plan_rendered(ids, sampled, MESSAGES)
    expected = TextMapping.to_student(plan, [0.0] + [-tok / 100 for tok in plan.teacher_ids[1:]],
                                      [0.0] * start + t.engine_logprobs)
    assert t.finish != "env_error"
    assert t.teacher_logprobs == pytest.approx([expected.get(start + i, 0.0) for i in range(len(t.response_ids))])
    assert agent.finish == "env_error" and "chat_template = teacher needs the conversation's messages" in str(agent.info)
    assert check_tokenizer(cfg, str(tmp_path)) is None
    from transformers import AutoTokenizer
    bare = AutoTokenizer.from_pretrained(tmp_path / "teacher_tokenizer")   # (the fixture's own stays as it is)
    bare.chat_template = None
    bare.save_pretrained(tmp_path / "no_template")
    refused = check_tokenizer(cfg.model_copy(update={"tokenizer": str(tmp_path / "no_template")}), str(tmp_path))
    assert refused.startswith("reward.teacher.chat_template = teacher: the tokenizer")
    with pytest.raises(ValueError, match="chat_template = teacher renders the conversation"):
        TeacherCfg(base_url="http://t/v1", chat_template="teacher")


def test_the_same_tokenizer_maps_each_token_to_itself(tokenizers):
    policy = tokenizers[0]
    ids, sampled = _conversation(policy)
    plan = TextMapping(policy, policy).plan(ids, sampled)
    assert plan.teacher_ids == ids and all(c == t for c, t in plan.chunks)
    pieces = token_texts(policy, ids)
    # a chunk of several tokens only where they are the bytes of one character
    assert all(len(c) == 1 or len("".join(pieces[i] for i in c)) == 1 for c, _ in plan.chunks)
    assert any(len(c) > 1 for c, _ in plan.chunks)


def test_annotate_sends_the_teachers_tokens_and_maps_its_logprobs_back(tokenizers, tmp_path):
    policy, other = tokenizers[0], tokenizers[1]
    other.save_pretrained(tmp_path / "teacher_tokenizer")
    ids, sampled = _conversation(policy)
    start = sampled.index(1)
    t = Trajectory(example={"id": "row-0"}, prompt_ids=ids[:start])
    t.response_ids, t.loss_mask = ids[start:], sampled[start:]
    t.engine_logprobs = [-0.5 if s else 0.0 for s in sampled[start:]]
    server = TeacherServer()   # log p(token) = -token / 100, of the ids it is sent
    try:
        Teacher(TeacherCfg(base_url=server.url, tokenizer=str(tmp_path / "teacher_tokenizer")), policy).annotate([t])
    finally:
        server.close()
    plan = TextMapping(policy, other).plan(ids, sampled)
    expected = TextMapping.to_student(plan, [0.0] + [-tok / 100 for tok in plan.teacher_ids[1:]],
                                      [0.0] * start + t.engine_logprobs)
    assert t.teacher_logprobs == pytest.approx([expected.get(start + i, 0.0) for i in range(len(t.response_ids))])
    assert all(lp == 0.0 for lp, m in zip(t.teacher_logprobs, t.loss_mask) if not m)   # the tool's output
    assert t.finish != "env_error"
    exact = plan.counts()["exact"] / plan.counts()["tokens"]
    kl = [e - lp for e, lp, m in zip(t.engine_logprobs, t.teacher_logprobs, t.loss_mask) if m]
    assert teacher_metrics([t]) == {"teacher_exact_frac": pytest.approx(exact), "teacher_unreadable_frac": 0.0,
                                    "teacher_reverse_kl": pytest.approx(sum(kl) / len(kl))}
    assert 0.0 < exact < 1.0 and teacher_metrics([Trajectory(example={}, prompt_ids=[1])]) == {}


def test_a_served_teacher_of_another_tokenizer_is_refused_unless_its_tokenizer_is_named(tokenizers, tmp_path):
    tokenizers[0].save_pretrained(tmp_path / "policy")
    tokenizers[1].save_pretrained(tmp_path / "teacher")
    served = TeacherCfg(serve=str(tmp_path / "teacher"))
    assert "reward.teacher.tokenizer=" in check_tokenizer(served, str(tmp_path / "policy"))
    assert check_tokenizer(TeacherCfg(serve=str(tmp_path / "teacher"), tokenizer=str(tmp_path / "teacher")),
                           str(tmp_path / "policy")) is None
    assert check_tokenizer(TeacherCfg(serve=str(tmp_path / "policy")), str(tmp_path / "policy")) is None
    with pytest.raises(ValueError, match="tokenizer = .*nowhere': no such folder"):   # a path: refused in params
        TeacherCfg(base_url="http://t/v1", tokenizer=str(tmp_path / "nowhere"))
    missing = check_tokenizer(TeacherCfg(base_url="http://t/v1", tokenizer="nowhere-relative"), str(tmp_path / "policy"))
    assert missing.startswith("reward.teacher.tokenizer = nowhere-relative: it does not load")


def test_a_teacher_server_of_another_tokenizer_is_refused_once_it_answers(tokenizers, tmp_path):
    """A teacher at base_url: the policy's rendering of a probe conversation is sent to its
    /tokenize; other ids refuse the run naming reward.teacher.tokenizer, the same ids pass, and a
    server without /tokenize is a note (it cannot be checked), not an error."""
    tokenizers[0].save_pretrained(tmp_path / "policy")
    for served, expected in ((tokenizers[1], "tokenizes differently"), (tokenizers[0], None)):
        server = TeacherServer(tokenizer=served)
        try:
            problem, note = check_server_tokenizer(TeacherCfg(base_url=server.url), str(tmp_path / "policy"))
            mapped = check_server_tokenizer(TeacherCfg(base_url=server.url, tokenizer="x"), str(tmp_path / "policy"))
        finally:
            server.close()
        assert note is None and mapped == (None, None)
        assert (problem is None) if expected is None else (expected in problem and "reward.teacher.tokenizer" in problem)
    server = TeacherServer()   # no /tokenize
    try:
        problem, note = check_server_tokenizer(TeacherCfg(base_url=server.url), str(tmp_path / "policy"))
    finally:
        server.close()
    assert problem is None and "could not be checked" in note and "404" in note
