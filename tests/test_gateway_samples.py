"""An agent episode's calls as training samples, and how the algorithms see an episode of several
samples: pure functions (turnrl.gateway.samples) and the training loop's `episode_advantages`."""
import pytest
import torch

from turnrl.config import AlgorithmCfg
from turnrl.gateway.samples import Call, chains, episode_trajectory, episode_view, training_rows
from turnrl.rollout.multi_turn import Trajectory
from turnrl.training.loop import advantages_for, collate, episode_advantages


def call(index, prompt, completion, version=0):
    return Call(index=index, prompt_ids=list(prompt), completion_ids=list(completion),
                logprobs=[-0.5] * len(completion), version=version, finish="stop", text=f"c{index}",
                completion_id=f"id{index}")


def test_calls_that_extend_the_previous_prompt_and_completion_merge_and_an_edit_starts_a_sample():
    c0 = call(0, [1, 2, 3], [10, 11])
    c1 = call(1, [1, 2, 3, 10, 11, 50, 51], [12])          # + the tool result (50, 51)
    c2 = call(2, [1, 2, 3, 60], [13])                       # the context edited: the call dropped
    c3 = call(3, [1, 2, 3, 60, 13, 70], [14, 15])           # continues c2's sample
    assert [[c.index for c in chain] for chain in chains([c0, c1, c2, c3])] == [[0, 1], [2, 3]]
    # one token off anywhere in the prefix: no merge (a re-tokenization is never trained as the same sample)
    assert len(chains([c0, call(1, [1, 2, 3, 10, 99, 50], [12])])) == 2
    # two answers to one prompt (n = 2) are two samples; a call extending one of them joins that one only
    a, b = call(0, [1, 2], [5]), call(1, [1, 2], [6])
    assert [[c.index for c in ch] for ch in chains([a, b, call(2, [1, 2, 6, 7], [8])])] == [[0], [1, 2]]


def test_a_merged_sample_trains_exactly_the_sampled_tokens():
    t = episode_trajectory({"prompt": "p"}, [call(0, [1, 2, 3], [10, 11], version=4),
                                             call(1, [1, 2, 3, 10, 11, 50, 51], [12], version=5)],
                           outcome=1.0, finish="answer")
    (sample,) = t.samples
    assert sample.prompt_ids == [1, 2, 3] and sample.response_ids == [10, 11, 50, 51, 12]
    assert sample.loss_mask == [1, 1, 0, 0, 1] and sample.turn_ids == [0, 0, 0, 0, 1]
    assert sample.engine_logprobs == [-0.5, -0.5, 0.0, 0.0, -0.5]
    assert t.turn_versions == [4, 5] and sample.turn_versions == [4, 5]
    assert t.info["calls"] == 2 and t.info["samples"] == 1 and t.info["merged_frac"] == 1.0
    rows, episode_of = training_rows([t, Trajectory(example={}, prompt_ids=[7], response_ids=[8], loss_mask=[1])])
    assert rows[0] is sample and episode_of == [0, 1]


def test_a_sample_keeps_its_last_calls_conversation():
    """A sample's messages: its last call's request and the answer (reward.teacher.chat_template:
    teacher renders them); calls that sent none leave them empty."""
    first, second = call(0, [1, 2, 3], [10, 11]), call(1, [1, 2, 3, 10, 11, 50], [12])
    asked = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "c0"}, {"role": "tool", "content": "r"}]
    second.messages, second.message = asked, {"role": "assistant", "content": "c1"}
    second.tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    (sample,) = episode_trajectory({}, [first, second], outcome=1.0, finish="answer").samples
    assert sample.messages == [*asked, {"role": "assistant", "content": "c1"}] and sample.tools == second.tools
    assert episode_trajectory({}, [call(0, [1], [2])], outcome=0.0, finish="answer").samples[0].messages == []


def test_the_episode_view_lays_samples_end_to_end_with_a_mark_where_the_context_was_edited():
    t = episode_trajectory({"prompt": "p"}, [call(0, [1, 2, 3], [10, 11]), call(1, [1, 2, 60], [12, 13])],
                           outcome=1.0, finish="answer")
    views, placement = episode_view([t])
    (view,) = views
    assert view.response_ids == [10, 11, 0, 12, 13] and view.loss_mask == [1, 1, 0, 1, 1]
    assert view.turn_ids == [0, 0, 0, 1, 1] and placement == [(0, 0), (0, 3)]
    assert view.first_observation == 2     # turn-level algorithms find the first turn's end here


def test_the_teachers_top_k_follows_the_samples_into_the_view_and_the_batch():
    """reward.teacher.top_k on an episode of two samples: the view lays each sample's top tokens
    where its tokens went (none at the edit's mark), and collate makes them [B, L, k] tensors, 0
    where the policy did not sample."""
    t = episode_trajectory({"prompt": "p"}, [call(0, [1, 2, 3], [10, 11]), call(1, [1, 2, 60], [12])],
                           outcome=1.0, finish="answer")
    first, second = t.samples
    first.teacher_logprobs, second.teacher_logprobs = [-0.1, -0.2], [-0.3]
    first.teacher_top_ids, first.teacher_top_logprobs = [[5, 6], [7, 8]], [[-0.1, -0.9], [-0.2, -0.8]]
    second.teacher_top_ids, second.teacher_top_logprobs = [[9, 4]], [[-0.3, -0.7]]
    (view,), _ = episode_view([t])
    assert view.teacher_top_ids == [[5, 6], [7, 8], [], [9, 4]]
    assert view.teacher_top_logprobs == [[-0.1, -0.9], [-0.2, -0.8], [], [-0.3, -0.7]]
    other = Trajectory(example={}, prompt_ids=[7])   # no top k of its own (e.g. the teacher failed on it)
    other.add_turn(0, [8], [-1.0], "x")
    batch = collate([view, other], pad_id=0)
    assert batch["teacher_top_ids"].shape == (2, 7, 2)   # 3 prompt + 4 response tokens, k = 2
    assert batch["teacher_top_ids"][0, 3:].tolist() == [[5, 6], [7, 8], [0, 0], [9, 4]]
    assert torch.allclose(batch["teacher_top_logprobs"][0, 6], torch.tensor([-0.3, -0.7]))
    assert batch["teacher_top_ids"][0, :3].abs().sum() == 0 and batch["teacher_top_ids"][1].abs().sum() == 0


def _episode(reward, samples):
    """An episode whose calls i each form a sample of their own (len(samples) == calls)."""
    calls = [call(i, [1, 2, 100 + i], completion) for i, completion in enumerate(samples)]
    return episode_trajectory({"prompt": "p"}, calls, outcome=reward, finish="answer")


def test_grpo_normalises_per_episode_and_every_sample_gets_its_episodes_advantage():
    # group of two episodes: one of three samples rewarded 1, one of one sample rewarded 0
    trajs = [_episode(1.0, [[5, 6], [7], [8, 9, 10]]), _episode(0.0, [[11, 12]])]
    rows, _ = training_rows(trajs)
    batch = collate(rows, pad_id=0)
    adv = episode_advantages(AlgorithmCfg(name="grpo"), 2, trajs, rows, batch)
    assert adv.shape == batch["loss_mask"].shape
    trained = [adv[r][batch["loss_mask"][r].bool()] for r in range(len(rows))]
    # each episode counts once: +1/-1 (std-normalised over two episodes), not weighted by its three samples
    for r in range(3):
        assert torch.allclose(trained[r], torch.full_like(trained[r], trained[0][0].item()))
    assert trained[0][0].item() == pytest.approx(0.7071, abs=1e-3)
    assert trained[3][0].item() == pytest.approx(-0.7071, abs=1e-3)
    assert (adv[batch["loss_mask"] == 0] == 0).all()


def test_episodes_of_one_sample_give_exactly_the_built_in_advantages():
    trajs = [_episode(1.0, [[5, 6]]), _episode(0.0, [[7]])]
    for t in trajs:      # a one-sample episode is a trajectory like any built-in one
        t.samples = []
    rows, _ = training_rows(trajs)
    batch = collate(rows, pad_id=0)
    cfg = AlgorithmCfg(name="mt_grpo")
    assert torch.equal(episode_advantages(cfg, 2, trajs, rows, batch), advantages_for(cfg, 2, trajs, batch))


def test_a_replayed_agent_episode_is_the_built_in_tools_environments_trajectory_token_for_token(tiny_model_dir):
    """The same demonstration through the real openai-SDK agent (the gateway answering it) and
    through the `tools` environment with the agent's own functions: the same prompt, sampled
    tokens, tool-result tokens and masks. So the two warm starts and rollouts see the same tokens."""
    import random
    import sys

    from transformers import AutoTokenizer

    from conftest import ROOT
    sys.path.insert(0, str(ROOT))
    from examples.agents.calculator_agent import demonstrate
    from turnrl import envs
    from turnrl.data.synthetic import product_rows
    from turnrl.gateway import make_program
    from turnrl.gateway.runner import AgentRunner
    from turnrl.rollout.chat import ChatFormat
    from turnrl.rollout.episodes import StepRunner

    fmt = ChatFormat(AutoTokenizer.from_pretrained(tiny_model_dir))
    functions = ["examples.agents.calculator_agent:calculator", "examples.agents.calculator_agent:count_digits"]
    runner = AgentRunner()
    try:
        for row in product_rows(3, seed=0, split="train", exclude=set()):
            for good in (True, False):
                turns = demonstrate(row, random.Random(0), good)
                agent = runner.replay(lambda: make_program(program="examples.agents.calculator_agent:run"), fmt, row,
                                      turns)
                (sample,) = agent.samples
                builtin = StepRunner().replay(lambda: envs.make("tools", functions=functions), fmt, row, turns)
                assert sample.prompt_ids == builtin.prompt_ids
                assert sample.response_ids == builtin.response_ids and sample.loss_mask == builtin.loss_mask
                assert agent.outcome == builtin.outcome == (1.0 if good else agent.outcome)
    finally:
        runner.close()


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama", "mistral", "gemma2", "gemma3", "phi3"])
def test_a_request_with_a_system_message_and_tools_is_the_rollouts_prompt_in_every_family(family):
    """What an agent program sends first (a system message, the user's task, its tools) is
    rendered into the prompt the built-in rollouts give the same task, in every family's
    template: tools in the system text where the template has no `tools=`, and the system text
    opening the user's message where the template refuses a system message (Gemma 2's raises:
    the gateway answered 400)."""
    from turnrl.gateway.render import Renderer, normalize_messages
    from turnrl.models import miniatures
    from turnrl.rollout.chat import ChatFormat
    fmt = ChatFormat(miniatures.build_tokenizer(miniatures.FAMILIES[family]))
    tools = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate an expression.",
              "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]
    messages = normalize_messages([{"role": "system", "content": "You compute."},
                                   {"role": "user", "content": "What is 6 times 7?"}])
    assert Renderer(fmt, parser=None).prompt_ids(messages, tools) == fmt.prompt_ids("You compute.", "What is 6 times 7?",
                                                                                    tools)
