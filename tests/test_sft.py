"""The `sft` stage: conversations in the OpenAI messages format rendered into the samples RL would
train on (same tokens, same masks), their bad rows as one-line errors, and fine-tuning on the
train stage's machinery (Ray, DeepSpeed ZeRO, the policy's trainer rank) whose loss falls and
whose output loads."""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))   # examples.agents


def tool_conversation(row: dict) -> dict:
    """A row of a conversation file: the calculator agent's task solved with its tool."""
    from examples.agents.calculator_agent import SYSTEM, TOOLS
    call = {"id": "call_0", "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": f"{row['a']} * {row['b']}"})}}
    return {"messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": row["prompt"]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": row["answer"]},
        {"role": "assistant", "content": f"<answer>{row['answer']}</answer>"},
    ], "tools": TOOLS}


@pytest.fixture(scope="module")
def fmt(tiny_model_dir):
    from transformers import AutoTokenizer
    from turnrl.rollout.chat import ChatFormat
    return ChatFormat(AutoTokenizer.from_pretrained(tiny_model_dir))


@pytest.fixture(scope="module")
def rows():
    from turnrl.data.synthetic import product_rows
    return product_rows(64, seed=0, split="train", exclude=set())


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _conversation(record: dict, where: str = "file.jsonl:1"):
    from turnrl.data.conversations import Conversation
    return Conversation(record["messages"], record.get("tools", []), where)


# --------------------------------------------------------------------------- SFT trains what RL trains
def test_a_recorded_tool_conversation_renders_into_the_sample_rl_trains_on(fmt, rows):
    """An agent program's episode through the gateway (the calculator agent, calling its tool, then
    answering), recorded; its conversation as SFT data renders into the very sample RL trained
    on: the same prompt ids, response ids, loss mask and turn ids."""
    from examples.agents.calculator_agent import demonstrate
    from turnrl.gateway.conversations import conversation_samples
    from turnrl.gateway.program import make_program
    from turnrl.gateway.runner import AgentRunner

    class Recording(AgentRunner):
        def _trajectory(self, ep, result, fmt, started):
            self.calls = list(ep.calls)
            return super()._trajectory(ep, result, fmt, started)
    runner = Recording()
    try:
        for row in rows[:3]:
            rl = runner.replay(lambda: make_program(program="examples.agents.calculator_agent:run"), fmt, row,
                               demonstrate(row, random.Random(0), True))
            last = runner.calls[-1]
            recorded = {"messages": [*last.messages, last.message], "tools": last.tools}
            assert [m["role"] for m in recorded["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
            (sample,) = conversation_samples(_conversation(recorded), fmt, 4096).samples
            (trained,) = rl.samples
            assert sample.prompt_ids == trained.prompt_ids
            assert sample.response_ids == trained.response_ids
            assert sample.loss_mask == trained.loss_mask and sample.turn_ids == trained.turn_ids
            # and what carries loss is the two assistant messages, closed, and nothing else
            taught = fmt.tokenizer.decode([t for t, m in zip(sample.response_ids, sample.loss_mask) if m])
            assert "calculator" in taught and f"<answer>{row['answer']}</answer>" in taught
            untaught = fmt.tokenizer.decode([t for t, m in zip(sample.response_ids, sample.loss_mask) if not m])
            assert row["answer"] in untaught and "calculator" not in untaught   # the tool's result
            assert taught.count(fmt.end_of_turn) == 2
    finally:
        runner.close()


def test_a_file_row_with_string_arguments_renders_as_the_model_writes_a_call(fmt, rows):
    """A conversation file as OpenAI writes one (arguments a JSON string): one sample, the first
    prompt the built-in rollouts' own prompt, the tool result in the rollouts' observation frame."""
    from examples.agents.calculator_agent import SYSTEM, TOOLS
    from turnrl.gateway.conversations import conversation_samples
    row = rows[5]
    rendered = conversation_samples(_conversation(tool_conversation(row)), fmt, 4096)
    (s,) = rendered.samples
    assert rendered.truncated == rendered.dropped == 0
    assert s.prompt_ids == fmt.prompt_ids(SYSTEM, row["prompt"], TOOLS)
    frame = fmt.observation_ids(row["answer"], "tool", after_eos=True)
    masked = [t for t, m in zip(s.response_ids, s.loss_mask) if not m]
    assert masked == frame
    first_turn = [t for t, m, k in zip(s.response_ids, s.loss_mask, s.turn_ids) if m and k == 0]
    assert fmt.tokenizer.decode(first_turn).startswith('<tool_call>\n{"name": "calculator"')


def test_a_parquet_file_as_pandas_writes_one_trains_what_its_jsonl_twin_trains(fmt, rows, tmp_path):
    """Parquet of conversations as pandas or `datasets` write one: the messages a list of structs,
    so every message has every key (a user message's tool_calls and tool_call_id are null), here
    with each call's arguments an object. Same samples as the jsonl of the same conversations with
    the arguments as OpenAI writes them (JSON text)."""
    import pandas as pd
    from turnrl.data.conversations import load_conversations
    from turnrl.gateway.conversations import conversation_samples
    records = [tool_conversation(row) for row in rows[:3]]
    for record in records:
        call = record["messages"][2]["tool_calls"][0]["function"]
        call["arguments"] = json.loads(call["arguments"])
    pd.DataFrame(records).to_parquet(tmp_path / "chats.parquet")
    from_parquet = load_conversations(str(tmp_path / "chats.parquet"))
    # the nulls a struct column brings are absent keys; an assistant call's null content stays
    user, call = from_parquet[0].messages[1], from_parquet[0].messages[2]
    assert "tool_calls" not in user and "tool_call_id" not in call and call["content"] is None
    assert from_parquet[0].tools == tool_conversation(rows[0])["tools"]   # not each other's properties as nulls
    from_jsonl = load_conversations(str(write_jsonl(tmp_path / "chats.jsonl", [tool_conversation(r) for r in rows[:3]])))
    for a, b in zip(from_parquet, from_jsonl, strict=True):
        (sa,), (sb,) = conversation_samples(a, fmt, 4096).samples, conversation_samples(b, fmt, 4096).samples
        assert (sa.prompt_ids, sa.response_ids, sa.loss_mask) == (sb.prompt_ids, sb.response_ids, sb.loss_mask)


def test_a_long_conversation_is_cut_at_the_right_and_counted(fmt, rows):
    from turnrl.gateway.conversations import conversation_samples
    conversation = _conversation(tool_conversation(rows[0]))
    whole = conversation_samples(conversation, fmt, 4096).samples[0]
    length = len(whole.prompt_ids) + len(whole.response_ids)
    cut = conversation_samples(conversation, fmt, length - 5)
    assert cut.truncated == 1 and len(cut.samples[0].response_ids) == len(whole.response_ids) - 5
    assert cut.samples[0].loss_mask == whole.loss_mask[:-5]
    prompt_only = conversation_samples(conversation, fmt, len(whole.prompt_ids))
    assert prompt_only.samples == [] and prompt_only.dropped == 1


# --------------------------------------------------------------------------- bad input: one line, file and row
@pytest.mark.parametrize("line, problem", [
    ("{not json", "file.jsonl:2: bad JSON line"),
    ('{"conversation": []}', "file.jsonl:2: field 'messages' must be a non-empty list"),
    ('{"messages": [{"content": "hi"}]}', "file.jsonl:2: messages[0] must be an object with a role"),
    ('{"messages": [{"role": "user", "content": "hi"}], "tools": {"a": 1}}', "file.jsonl:2: field 'tools'"),
])
def test_a_malformed_row_names_the_file_and_row(tmp_path, rows, line, problem):
    from turnrl.data.conversations import load_conversations
    from turnrl.data.sources import MalformedDataError
    path = tmp_path / "file.jsonl"
    path.write_text(json.dumps(tool_conversation(rows[0])) + "\n" + line + "\n")
    with pytest.raises(MalformedDataError) as caught:
        load_conversations(str(path))
    assert str(caught.value).startswith(str(tmp_path / problem.split(":")[0]) + ":" + problem.split(":", 1)[1])


def test_rows_a_template_cannot_train_on_name_the_row(fmt, rows):
    from turnrl.gateway.conversations import ConversationError, conversation_samples
    cases = {
        "an assistant message before any user message": [{"role": "assistant", "content": "hi"}],
        "no assistant message": [{"role": "user", "content": "hi"}],
        "must be an object whose role is system, developer, user, assistant or tool": [
            {"role": "narrator", "content": "hi"}, {"role": "assistant", "content": "ok"}],
        "arguments are not valid JSON": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{x"}}]}],
        "messages[1]: a tool call's function needs a name": [{"role": "user", "content": "hi"}, {
            "role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                                  "function": {"arguments": "{}"}}]}],
        "messages[1]: tool_calls must be a list": [{"role": "user", "content": "hi"}, {
            "role": "assistant", "content": None, "tool_calls": {"id": "c", "type": "function"}}],
        "messages[1]: content must be a string or a list of content parts, not int": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": 6}],
        "messages[1]: weight = 0.5": [{"role": "user", "content": "hi"},
                                      {"role": "assistant", "content": "ok", "weight": 0.5}],
    }
    for problem, messages in cases.items():
        with pytest.raises(ConversationError) as caught:
            conversation_samples(_conversation({"messages": messages}, "data/chat.jsonl:7"), fmt, 4096)
        assert str(caught.value).startswith("data/chat.jsonl:7: ") and problem in str(caught.value), caught.value
    long = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "word " * 400}]}
    with pytest.raises(ConversationError, match=r"data/chat.jsonl:7: messages\[1\], an assistant message of \d+ "
                                                r"tokens, does not fit in sft.max_length = 64"):
        conversation_samples(_conversation(long, "data/chat.jsonl:7"), fmt, 64)


def test_tool_call_ids_a_file_reuses_in_every_turn_train_the_conversation_as_written(fmt, rows):
    """Files often number each turn's calls from call_0: every assistant message is its own turn
    (found by its place), so the conversation is one sample, each turn's call in its place."""
    row = rows[3]
    record = tool_conversation(row)
    calls = record["messages"][2]["tool_calls"]
    second = {"id": "call_0", "type": "function",
              "function": {"name": "calculator", "arguments": json.dumps({"expression": f"{row['answer']} + 1"})}}
    record["messages"][4:4] = [{"role": "assistant", "content": None, "tool_calls": [second]},
                               {"role": "tool", "tool_call_id": "call_0", "content": str(int(row["answer"]) + 1)}]
    distinct = json.loads(json.dumps(record))
    distinct["messages"][4]["tool_calls"][0]["id"] = distinct["messages"][5]["tool_call_id"] = "call_1"
    from turnrl.gateway.conversations import conversation_samples
    (reused,) = conversation_samples(_conversation(record), fmt, 4096).samples
    (as_distinct,) = conversation_samples(_conversation(distinct), fmt, 4096).samples
    assert reused.response_ids == as_distinct.response_ids and reused.loss_mask == as_distinct.loss_mask
    taught = fmt.tokenizer.decode([t for t, m in zip(reused.response_ids, reused.loss_mask) if m])
    assert taught.index(calls[0]["function"]["arguments"][-12:-2]) < taught.index(f"{row['answer']} + 1")


def test_an_assistant_message_of_weight_0_is_context_not_taught(fmt, rows):
    """OpenAI's fine-tuning `weight`: an assistant message of weight 0 stays in the conversation
    (the later turns see it) and carries no loss; weight 1 is the default."""
    from turnrl.gateway.conversations import conversation_samples
    record = tool_conversation(rows[4])
    (whole,) = conversation_samples(_conversation(record), fmt, 4096).samples
    record["messages"][2]["weight"] = 0   # the tool call: context only
    (weighted,) = conversation_samples(_conversation(record), fmt, 4096).samples
    assert weighted.response_ids == whole.response_ids
    assert [m for m, k in zip(weighted.loss_mask, weighted.turn_ids) if k == 0] == \
        [0] * whole.turn_ids.count(0)
    assert [m for m, k in zip(weighted.loss_mask, weighted.turn_ids) if k == 1] == \
        [m for m, k in zip(whole.loss_mask, whole.turn_ids) if k == 1] and any(weighted.loss_mask)
    record["messages"][4]["weight"] = 0   # nothing left to teach: no sample
    assert conversation_samples(_conversation(record), fmt, 4096).samples == []


def test_reasoning_content_goes_to_a_template_that_renders_it(fmt):
    """An assistant message's reasoning_content reaches the chat template: a template with a place
    for it (as Qwen3's <think>) teaches it; the tiny model's ChatML has none and drops it."""
    import copy
    from turnrl.gateway.conversations import conversation_samples
    from turnrl.rollout.chat import ChatFormat
    record = {"messages": [{"role": "user", "content": "Compute 2*3"},
                           {"role": "assistant", "content": "6", "reasoning_content": "2 times 3 is 6."}]}
    thinking = copy.copy(fmt.tokenizer)
    thinking.chat_template = fmt.tokenizer.chat_template.replace(
        "'\n' + (message['content'] or '') }}",
        "'\n' + ('<think>' + message['reasoning_content'] + '</think>' if message.get('reasoning_content') else '')"
        " + (message['content'] or '') }}")
    assert thinking.chat_template != fmt.tokenizer.chat_template
    for tokenizer, taught in ((thinking, "<think>2 times 3 is 6.</think>6"), (fmt.tokenizer, "6")):
        (sample,) = conversation_samples(_conversation(record), ChatFormat(tokenizer), 4096).samples
        text = tokenizer.decode([t for t, m in zip(sample.response_ids, sample.loss_mask) if m])
        assert text == taught + fmt.end_of_turn


@pytest.mark.parametrize("name, write", [
    ("bom.jsonl", lambda p, rec: p.write_bytes(b"\xef\xbb\xbf" + (json.dumps(rec) + "\n").encode())),
    ("bom_list.json", lambda p, rec: p.write_bytes(b"\xef\xbb\xbf" + json.dumps([rec]).encode())),
    ("pretty.json", lambda p, rec: p.write_text(json.dumps(rec, indent=2))),
    ("upper.PARQUET", lambda p, rec: __import__("pandas").DataFrame([rec]).to_parquet(p)),
    ("no_suffix", lambda p, rec: __import__("pandas").DataFrame([rec]).to_parquet(p)),
])
def test_files_as_editors_and_tools_write_them_load(tmp_path, rows, name, write):
    """A UTF-8 byte-order mark (Notepad, PowerShell), one pretty-printed object in a .json file,
    a parquet file named in capitals or without a suffix (its magic bytes say what it is)."""
    from turnrl.data.conversations import load_conversations
    record = tool_conversation(rows[0])
    write(tmp_path / name, record)
    (conversation,) = load_conversations(str(tmp_path / name))
    assert [m["role"] for m in conversation.messages] == [m["role"] for m in record["messages"]]
    assert conversation.messages[-1]["content"] == record["messages"][-1]["content"]
    assert conversation.where == f"{tmp_path / name}:1"


def test_a_missing_file_or_unreachable_dataset_says_what_to_give(tmp_path):
    from turnrl.data.conversations import load_conversations
    from turnrl.data.sources import DataSourceError
    with pytest.raises(DataSourceError, match="no such file; give a jsonl or parquet file of conversations"):
        load_conversations(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataSourceError, match="the Hugging Face dataset could not be loaded"):
        load_conversations("hf:nobody/no-such-dataset-turnrl")


def test_nll_loss_by_hand():
    import torch
    from turnrl.algos import nll_loss
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, -8.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert nll_loss(logp, mask).item() == pytest.approx((2.0 + 3.0 + 0.5) / 3)
    assert nll_loss(logp, torch.zeros_like(mask)).item() == 0.0


def test_the_heldout_split_is_by_conversation_and_seeded():
    from turnrl.training.sft import split_heldout
    items = list(range(100))
    train, held = split_heldout(items, 0.1, seed=3)
    assert len(held) == 10 and sorted(train + held) == items and not set(train) & set(held)
    assert split_heldout(items, 0.1, seed=3) == (train, held) and split_heldout(items, 0.1, seed=4)[1] != held
    assert split_heldout(items[:19], 0.5, seed=3) == (items[:19], [])
    train, held = split_heldout(items[:40], 0.99, seed=3)          # a fraction near 1 leaves some to train on
    assert (len(train), len(held)) == (1, 39)
    train, held = split_heldout(items, 0.01, seed=3, keep=2)      # each of 2 trainer ranks gets a held-out row
    assert (len(train), len(held)) == (98, 2)


class _Ranks:
    """Two trainer ranks' `supervised` results on a held-out chunk: each half, as the real ranks
    split a batch (training.workers refuses a chunk of fewer rows than ranks)."""

    def __init__(self):
        self.chunks = []

    def results(self, method, batch, update):
        rows = batch["loss_mask"].shape[0]
        assert rows >= 2, f"a chunk of {rows} rows for 2 ranks"
        self.chunks.append(rows)
        return [{"loss": 0.5, "tokens": 1.0}, {"loss": 0.5, "tokens": 1.0}]


def test_a_held_out_remainder_smaller_than_the_ranks_joins_the_batch_before():
    from turnrl.rollout.multi_turn import Trajectory
    from turnrl.training.sft import heldout_loss
    sample = Trajectory(example={}, prompt_ids=[1, 2])
    sample.add_turn(0, [3, 4], [0.0, 0.0], "x")
    ranks = _Ranks()
    assert heldout_loss(ranks, [sample] * 17, batch_size=16, pad_id=0, ranks=2) == 1.0
    assert ranks.chunks == [17]


# --------------------------------------------------------------------------- fine-tuning, for real
@pytest.mark.slow
def test_fine_tuning_on_a_conversation_file_lowers_the_loss_and_the_model_loads(tiny_model_dir, rows, tmp_path):
    """The stage's own function on the tiny model: Ray, the policy's DeepSpeed rank (ZeRO-2), 20
    steps on 60 tool conversations (3 held out): training and held-out loss fall; the folder loads
    in transformers and has learnt the calls (the held-out conversations' assistant tokens are
    likelier than under the starting model)."""
    import torch
    from transformers import AutoModelForCausalLM

    from turnrl.config import Config
    from turnrl.pipeline.sft import run_sft
    from turnrl.training.loop import collate
    data = write_jsonl(tmp_path / "chat.jsonl", [tool_conversation(r) for r in rows[:60]])
    cfg = Config.model_validate({"sft": {"data": str(data), "steps": 20, "batch_size": 8, "lr": 3e-3,
                                         "warmup_steps": 2, "lr_schedule": "cosine", "min_lr_ratio": 0.1,
                                         "heldout_fraction": 0.05, "eval_every": 10},
                                 "cluster": {"num_cpus": 2}})
    out = tmp_path / "sft"
    logged = []
    summary = run_sft(cfg, str(tiny_model_dir), out, on_step=lambda step, m: logged.append(m))
    import ray
    ray.shutdown()
    print(f"sft summary: {summary}")
    assert summary["conversations"] == 60 and summary["heldout_conversations"] == 3
    assert summary["samples"] == 57 and summary["steps"] == 20 and [m["step"] for m in logged] == list(range(21))
    assert summary["loss_last"] < 0.5 * summary["loss_first"], summary
    assert summary["heldout_loss_last"] < 0.5 * summary["heldout_loss_start"], summary
    assert [m["step"] for m in logged if "heldout_loss" in m] == [0, 10, 20]   # 0: before the first update
    assert all(m["tokens_per_s"] > 0 for m in logged[1:])
    from turnrl.training.workers import lr_factor   # sft's own schedule over its 20 steps
    assert [m["lr"] for m in logged[1:]] == pytest.approx([3e-3 * lr_factor(k, 2, 20, "cosine", 0.1) for k in range(20)])

    from transformers import AutoTokenizer
    from turnrl.gateway.conversations import conversation_samples
    from turnrl.rollout.chat import ChatFormat
    fmt = ChatFormat(AutoTokenizer.from_pretrained(out))
    held = [s for r in rows[60:64] for s in conversation_samples(_conversation(tool_conversation(r)), fmt, 4096).samples]
    batch = collate(held, 0)

    def nll(folder) -> float:
        model = AutoModelForCausalLM.from_pretrained(folder)
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
        mask = batch["loss_mask"][:, 1:]
        return float(-(logp * mask).sum() / mask.sum())
    assert nll(out) < 0.5 * nll(tiny_model_dir)


def test_a_step_loop_trajectory_s_conversation_renders_back_into_its_tokens(fmt, rows):
    """A built-in environment's trajectory (code_tool, replayed through the real sandbox) keeps its
    conversation (`Trajectory.messages`, in evaluation's generations as `messages`): rendered as SFT
    data, it is the trajectory's own tokens. The one difference is where a turn ended on a stop
    string (`</code>`, `</answer>`): RL's sample has the template's closing token in the next
    message's frame (mask 0), or none after the last turn; SFT teaches it after the turn (mask 1)."""
    from turnrl import envs
    from turnrl.data.synthetic import product_demonstration
    from turnrl.gateway.conversations import conversation_samples
    from turnrl.rollout.multi_turn import replay
    spec = envs.resolve("code_tool")
    end = fmt.end_of_turn_id
    for row in rows[:3]:
        demo = product_demonstration(row, random.Random(0), True)
        t = replay(spec.factory(), fmt, row, demo.turns)
        assert t.outcome == 1.0 and [m["role"] for m in t.messages] == ["system", "user", "assistant", "tool",
                                                                         "assistant"]
        (s,) = conversation_samples(_conversation({"messages": t.messages, "tools": t.tools}), fmt, 4096).samples
        assert s.prompt_ids == t.prompt_ids and s.response_ids == t.response_ids + [end]
        assert s.loss_mask[-1] == 1
        differ = [i for i, (a, b) in enumerate(zip(s.loss_mask, t.loss_mask)) if a != b]
        assert [s.response_ids[i] for i in differ] == [end] and s.loss_mask[differ[0]] == 1
        assert fmt.tokenizer.decode(s.response_ids[:differ[0]]).endswith("</code>")


def test_demonstrations_as_sft_data_are_the_environment_s_good_replays(fmt):
    """`sft.data: demonstrations`: the environment's good demonstrations replayed through it (the
    tiny model's warm-start source, for any checkpoint), a held-out share by demonstration."""
    from turnrl.config import Config
    from turnrl.pipeline.sft import demonstration_split
    cfg = Config.model_validate({"sft": {"data": "demonstrations", "demonstrations": 40, "heldout_fraction": 0.1},
                                 "data": {"train_examples": 64, "heldout_examples": 16}})
    train, heldout, counts = demonstration_split(cfg, fmt)
    assert (len(train), len(heldout)) == (36, 4) and counts["conversations"] == 40
    for s in train + heldout:
        taught = fmt.tokenizer.decode([t for t, m in zip(s.response_ids, s.loss_mask) if m])
        assert "<code>" in taught and "<answer>" in taught and "<output>" not in taught
    longest = max(len(s.prompt_ids) + len(s.response_ids) for s in train)
    short = cfg.model_copy(update={"sft": cfg.sft.model_copy(update={"max_length": longest - 5})})
    cut, _, counts = demonstration_split(short, fmt)                 # sft.max_length holds here too
    assert max(len(s.prompt_ids) + len(s.response_ids) for s in cut) <= longest - 5 and counts["truncated"] >= 1


def test_sft_off_passes_the_model_through(tmp_path, tiny_model_dir):
    import shutil
    from turnrl.training.folders import model_dir
    from turnrl.pipeline.sft import pass_through
    initial = tmp_path / "initial"
    shutil.copytree(tiny_model_dir, initial)
    assert pass_through(initial, tmp_path / "sft") == {"skipped": True, "reason": "sft.data: none"}
    assert (tmp_path / "sft/model.safetensors").read_bytes() == (initial / "model.safetensors").read_bytes()
    pointer = tmp_path / "checkpoint"
    pointer.mkdir()
    (pointer / "turnrl_model.json").write_text(json.dumps({"kind": "checkpoint", "path": str(tiny_model_dir)}))
    pass_through(pointer, tmp_path / "sft2")
    assert sorted(p.name for p in (tmp_path / "sft2").iterdir()) == ["turnrl_model.json"]
    assert model_dir(tmp_path / "sft2") == str(tiny_model_dir)


@pytest.mark.slow
@pytest.mark.long   # ~60 s; LoRA's worker code is RL's (tests/test_lora.py); CI runs the full fine-tuning above
def test_sft_with_lora_trains_the_adapters_and_saves_the_merged_model(tiny_model_dir, rows, tmp_path):
    """model.lora in SFT as in RL: only the adapters train, models/sft is the merged model (what
    the next stages load) with the adapters in adapter/."""
    from transformers import AutoModelForCausalLM

    from turnrl.config import Config
    from turnrl.pipeline.sft import run_sft
    from turnrl.training.workers import ADAPTER_DIR
    data = write_jsonl(tmp_path / "chat.jsonl", [tool_conversation(r) for r in rows[:18]])
    cfg = Config.model_validate({"sft": {"data": str(data), "steps": 15, "batch_size": 8, "lr": 1e-2},
                                 "model": {"lora": {"r": 8, "alpha": 16}}, "cluster": {"num_cpus": 2}})
    summary = run_sft(cfg, str(tiny_model_dir), tmp_path / "sft")
    import ray
    ray.shutdown()
    assert summary["heldout_samples"] == 0 and summary["heldout_loss_last"] is None   # under 20 conversations
    assert summary["loss_last"] < 0.9 * summary["loss_first"], summary   # a rank-8 adapter on a random model: slowly
    assert (tmp_path / "sft" / ADAPTER_DIR / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "sft").state_dict()
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert merged.keys() == start.keys()
    changed = [k for k in merged if not (merged[k] == start[k]).all()]
    assert changed and all("proj" in k for k in changed)   # the adapted linear layers; embeddings untouched


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama", "mistral", "gemma2", "gemma3", "phi3"])
def test_every_family_s_template_gives_one_sample_taught_on_the_assistant_only(family):
    """The miniatures' chat templates (each family's documented format: Qwen's tool results in a
    user turn, Llama's ipython role, Mistral's and Gemma's strict alternation, Phi-3's end token): a
    two-turn conversation with a `tool` message is one sample, its loss on the two assistant
    messages and their closing tokens. A family whose template refuses tool messages (Mistral,
    Gemma) or drops them (Phi-3) gets the tool's result as a user message, as RL's rollouts give it."""
    from turnrl.gateway.conversations import conversation_samples
    from turnrl.models import miniatures
    from turnrl.rollout.chat import ChatFormat
    fmt = ChatFormat(miniatures.build_tokenizer(miniatures.FAMILIES[family]))
    messages = [{"role": "user", "content": "What is 6 times 7?"},
                {"role": "assistant", "content": "<code>print(6 * 7)</code>"},
                {"role": "tool", "content": "<output>42</output>"},
                {"role": "assistant", "content": "<answer>42</answer>"}]
    (s,) = conversation_samples(_conversation({"messages": messages}, "chat.jsonl:3"), fmt, 4096).samples
    runs = [m for k, m in enumerate(s.loss_mask) if k == 0 or m != s.loss_mask[k - 1]]
    assert runs == [1, 0, 1], family                       # assistant, the tool's frame and text, assistant
    taught = fmt.tokenizer.decode([t for t, m in zip(s.response_ids, s.loss_mask) if m])
    untaught = fmt.tokenizer.decode([t for t, m in zip(s.response_ids, s.loss_mask) if not m])
    assert "print(6 * 7)" in taught and "<answer>42</answer>" in taught and "<output>42</output>" in untaught
    assert taught.count(fmt.end_of_turn) == 2 and taught.endswith(fmt.end_of_turn)
    assert s.prompt_ids == fmt.prompt_ids("", messages[0]["content"])
    between = [t for t, m in zip(s.response_ids, s.loss_mask) if not m]
    assert between == fmt.observation_ids("<output>42</output>", "tool", after_eos=True)   # RL's own frame


def test_a_missing_conversation_file_stops_the_stage_before_any_work(tmp_path):
    import subprocess
    import time
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text().replace(
        "  data: none ", "  data: chats/missing.jsonl "))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(ROOT / "stages/sft.py")], cwd=tmp_path, capture_output=True, text=True,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")})
    assert proc.returncode == 2 and time.perf_counter() - start < 60
    assert proc.stderr.strip().splitlines() == [
        f"turnrl sft: sft.data = 'chats/missing.jsonl': no such file (relative to {tmp_path}, where the stages run); "
        "fix the path to a .jsonl/.json/.parquet file of conversations, or none, demonstrations, hf:<dataset id>"]


def test_the_gpu_distillation_preset_places_eight_gpus_and_checks_its_teacher():
    """configs/distill_gpu.yaml: valid over params.yaml, 4 ZeRO-3 trainer ranks and 3 engines on a GPU
    each (7 in the placement group) and the teacher served on its own (the 8th), opd from a teacher
    of the student's family; its sft.data file is checked before the stage works."""
    from turnrl import presets
    from turnrl.config import load_config
    from turnrl.config.checks import stage_problems
    from turnrl.training.cluster import check_cluster, plan_placement, weight_sync_mode
    keys = presets.load("distill_gpu", ROOT / "params.yaml", ROOT / "configs")
    cfg = load_config(ROOT / "params.yaml", [f"{k}={v}" for k, v in keys.items()])
    check_cluster(cfg)
    bundles, _ = plan_placement(cfg)
    assert sum(b.get("GPU", 0) for b in bundles) + cfg.cluster.served_gpus == 8 and weight_sync_mode(cfg) == "nccl"
    assert cfg.algorithm.name == "opd" and cfg.reward.teacher.serve.startswith("Qwen/Qwen2.5-")
    assert cfg.model.path.startswith("Qwen/Qwen2.5-") and cfg.sft.enabled and cfg.train.zero_stage == 3
    assert stage_problems(cfg, "sft") and "sft.data = 'data/teacher_successes.jsonl': no such file" in \
        stage_problems(cfg, "sft")[0]


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama", "mistral", "gemma2", "gemma3", "phi3"])
def test_a_tool_call_is_taught_in_every_family_even_where_the_template_drops_tool_calls(family):
    """A conversation with a system message and an OpenAI tool call. The miniatures' templates (as
    Qwen2's, Gemma's and Phi-3's real ones) neither render `tools=` nor an assistant's
    `tool_calls`: the tools are described in the system text (`tools_text`, the Hermes format) and
    the call is written into the assistant's content in that format, so the tokens taught are a
    call the `hermes` parser reads back, not an empty turn. Gemma 2's template refuses a system
    message: it opens the user's, as in RL's prompts."""
    from examples.agents.calculator_agent import TOOLS
    from turnrl.envs.tools.parsers import parse_hermes
    from turnrl.gateway.conversations import conversation_samples
    from turnrl.models import miniatures
    from turnrl.rollout.chat import ChatFormat, renders_tool_calls
    fmt = ChatFormat(miniatures.build_tokenizer(miniatures.FAMILIES[family]))
    assert not renders_tool_calls(fmt.tokenizer)
    call = {"id": "call_0", "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": "6 * 7"})}}
    messages = [{"role": "system", "content": "You compute."}, {"role": "user", "content": "What is 6 times 7?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "content": "42"},
                {"role": "assistant", "content": "<answer>42</answer>"}]
    (s,) = conversation_samples(_conversation({"messages": messages, "tools": TOOLS}, "chat.jsonl:1"), fmt,
                                4096).samples
    assert s.prompt_ids == fmt.prompt_ids("You compute.", "What is 6 times 7?", TOOLS)   # RL's own prompt
    first = fmt.tokenizer.decode([t for t, m, k in zip(s.response_ids, s.loss_mask, s.turn_ids) if m and k == 0],
                                 skip_special_tokens=True)
    parsed = parse_hermes(first)
    assert not parsed.errors and [(c.name, c.arguments) for c in parsed.calls] == [("calculator", {"expression": "6 * 7"})]


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama", "mistral", "gemma2", "gemma3", "phi3"])
def test_parallel_calls_results_are_the_frame_rl_gives_them_in_every_family(family):
    """Two calls in one assistant message, two tool results: the results are masked and are
    exactly the tokens the `tools` environment's rollouts put after such a turn
    (`observation_ids` of the two results). Where the template cannot render two user messages
    in a row (Mistral, Gemma), both are one message, a line each; RL's rollouts raised there."""
    from turnrl.gateway.conversations import conversation_samples
    from turnrl.models import miniatures
    from turnrl.rollout.chat import ChatFormat
    fmt = ChatFormat(miniatures.build_tokenizer(miniatures.FAMILIES[family]))
    calls = [{"id": f"call_{k}", "type": "function",
              "function": {"name": "calculator", "arguments": json.dumps({"expression": e})}}
             for k, e in enumerate(["2 * 3", "4 * 5"])]
    messages = [{"role": "user", "content": "What are 2 times 3 and 4 times 5?"},
                {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_0", "content": "6"},
                {"role": "tool", "tool_call_id": "call_1", "content": "20"},
                {"role": "assistant", "content": "<answer>6 and 20</answer>"}]
    (s,) = conversation_samples(_conversation({"messages": messages}, "chat.jsonl:1"), fmt, 4096).samples
    runs = [m for k, m in enumerate(s.loss_mask) if k == 0 or m != s.loss_mask[k - 1]]
    assert runs == [1, 0, 1]
    assert [t for t, m in zip(s.response_ids, s.loss_mask) if not m] == \
        fmt.observation_ids(["6", "20"], "tool", after_eos=True)


def test_an_sft_batch_smaller_than_the_trainer_ranks_is_a_params_problem():
    from turnrl.config import Config
    from turnrl.config.checks import sft_problems
    cfg = Config.model_validate({"sft": {"data": "demonstrations", "batch_size": 1}, "cluster": {"trainer_ranks": 2}})
    assert sft_problems(cfg) == ["sft.batch_size = 1: fewer samples than cluster.trainer_ranks = 2, each of which "
                                 "takes a share of a batch; set sft.batch_size to at least 2"]
    assert sft_problems(cfg.model_copy(update={"sft": cfg.sft.model_copy(update={"batch_size": 2})})) == []


def test_an_sft_warmup_as_long_as_the_run_is_refused_naming_both_keys():
    from turnrl.config import ConfigError, parse_config
    with pytest.raises(ConfigError, match=r"sft: warmup_steps = 10 with steps = 3: the rate would never reach lr"):
        parse_config({"sft": {"data": "demonstrations", "steps": 3, "warmup_steps": 10}}, plugins=False)
    assert parse_config({"sft": {"steps": 3, "warmup_steps": 10}}, plugins=False).sft.data == "none"   # off: moot
