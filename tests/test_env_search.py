"""search: BM25 retrieval (bm25s), the observation format, step rewards, outcome rewards, the
shared index, and a scripted rollout through the real loop."""
import time

import bm25s
import pytest

from turnrl.envs import search as search_mod
from turnrl.envs.search import SearchEnv, SearchIndex, build_index, clear_index_cache, parse_action
from turnrl.rollout.chat import ChatFormat
from turnrl.rollout.multi_turn import Budgets, run_rollouts

from conftest import ScriptedEngine

CORPUS = [
    {"id": "roentgen", "title": "Wilhelm Röntgen",
     "text": "Wilhelm Conrad Röntgen was a German physicist who discovered X-rays in 1895 and received "
             "the first Nobel Prize in Physics in 1901."},
    {"id": "eiffel", "title": "Eiffel Tower",
     "text": "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
             "It was designed by the engineering company of Gustave Eiffel and completed in 1889."},
    {"id": "everest", "title": "Mount Everest",
     "text": "Mount Everest is Earth's highest mountain above sea level, located in the Himalayas on "
             "the border between Nepal and China."},
    {"id": "python", "title": "Python (programming language)",
     "text": "Python is a high-level programming language created by Guido van Rossum and first "
             "released in 1991."},
    {"id": "amazon", "title": "Amazon River",
     "text": "The Amazon River in South America is the largest river by discharge volume of water in "
             "the world."},
    {"id": "beatles", "title": "The Beatles",
     "text": "The Beatles were an English rock band formed in Liverpool in 1960, often called the Fab Four."},
    {"id": "curie", "title": "Marie Curie",
     "text": "Marie Curie was a Polish and naturalised-French physicist and chemist who conducted "
             "pioneering research on radioactivity. She was the first woman to win a Nobel Prize."},
    {"id": "moon", "title": "Apollo 11",
     "text": "Apollo 11 was the spaceflight that first landed humans on the Moon, on July 20, 1969. "
             "Neil Armstrong and Buzz Aldrin walked on the lunar surface."},
]

XRAY = {"prompt": "Who discovered X-rays?", "answer": "Wilhelm Röntgen",
        "answers": ["Wilhelm Röntgen", "Wilhelm Conrad Röntgen", "Röntgen"]}
BEATLES = {"prompt": "Which band was called the Fab Four?", "answer": "The Beatles"}


@pytest.fixture(scope="module")
def index():
    return build_index(CORPUS)


def make_env(index, **kw):
    return SearchEnv(index=index, **kw)


# ----------------------------------------------------------------------------- parsing, index
@pytest.mark.parametrize("text, expected", [
    ("<search>eiffel tower</search>", ("search", "eiffel tower")),
    ("I should look it up. <search>\n who discovered x-rays \n</search>", ("search", "who discovered x-rays")),
    ("<answer> Paris </answer>", ("answer", "Paris")),
    ("<answer>a</answer><search>b</search>", ("answer", "a")),      # the first complete tag wins
    ("<search>b</search> <answer>a</answer>", ("search", "b")),
    ("<search>unfinished", ("none", None)),
    ("Paris, I think.", ("none", None)),
])
def test_parse_action(text, expected):
    assert parse_action(text) == expected


@pytest.mark.parametrize("query, best", [
    ("who discovered X-rays", "roentgen"),
    ("Eiffel tower Paris", "eiffel"),
    ("highest mountain Himalayas", "everest"),
    ("Guido van Rossum programming language", "python"),
    ("first humans on the Moon", "moon"),
    ("radioactivity research woman Nobel", "curie"),
])
def test_the_right_passage_ranks_first(index, query, best):
    results = index.search(query, 3)
    assert results[0]["id"] == best
    assert [r["score"] for r in results] == sorted((r["score"] for r in results), reverse=True)
    assert set(results[0]) == {"id", "title", "text", "score"}


def test_top_k_is_respected_and_zero_score_passages_are_left_out(index):
    query = "first Paris river band Himalayas"           # every passage has one of these terms
    assert len(index.search(query, 2)) == 2 and len(index.search(query, 5)) == 5
    assert len(index.search(query, 100)) == len(CORPUS)  # k past the corpus size: all, no error
    assert index.search(query, 0) == []
    assert [r["id"] for r in index.search("Liverpool", 3)] == ["beatles"]       # one passage has the term
    assert index.search("zzzz qqqq", 3) == [] and index.search("   ", 3) == [] and index.search("the of", 3) == []


def test_the_index_is_built_once_and_shared(monkeypatch):
    builds = []
    real_index = bm25s.BM25.index
    monkeypatch.setattr(bm25s.BM25, "index", lambda self, *a, **kw: (builds.append(1), real_index(self, *a, **kw))[1])
    clear_index_cache()
    envs = [SearchEnv(corpus=CORPUS) for _ in range(3)] + [SearchEnv(corpus=[dict(p) for p in CORPUS])]
    assert len(builds) == 1
    assert all(env.index is envs[0].index for env in envs)
    assert isinstance(envs[0].index, SearchIndex) and len(envs[0].index) == len(CORPUS)
    SearchEnv(index=envs[0].index)                       # an explicit index: nothing is built
    assert build_index(CORPUS) is envs[0].index and len(builds) == 1
    other = build_index(CORPUS[:5])                      # a different corpus is a different index
    assert other is not envs[0].index and len(builds) == 2


def test_a_corpus_file_is_cached_by_file(tmp_path, monkeypatch):
    import json
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in CORPUS), encoding="utf-8")
    loads = []
    real = search_mod._read_records
    monkeypatch.setattr(search_mod, "_read_records", lambda p: (loads.append(p), real(p))[1])
    a, b = build_index(path), build_index(str(path))
    assert a is b and len(loads) == 1 and a.corpus == CORPUS
    assert a is build_index(CORPUS)                      # same content as the in-memory corpus


# ----------------------------------------------------------------------------- stepping
def test_search_then_answer_step_by_step(index):
    env = make_env(index)
    assert env.reset(XRAY) == "Who discovered X-rays?"
    assert env.observation_role == "tool" and env.stop == ("</search>", "</answer>")

    r = env.step("Let me look this up. <search>who first discovered x-rays</search>")
    assert not r.done
    assert r.observation.startswith("<result>\n[1] Wilhelm Röntgen: Wilhelm Conrad Röntgen was a German physicist")
    assert r.observation.endswith("\n</result>")
    lines = r.observation.split("\n")[1:-1]
    assert [line[:4] for line in lines] == ["[1] ", "[2] ", "[3] "]        # top_k = 3 of 4 matches
    assert lines[1].startswith("[2] Marie Curie: ")
    assert r.info["tool_ok"] is True and r.info["answer_in_results"] == 1.0 and r.info["num_results"] == 3
    assert r.reward == 1.0 == r.info["turn_reward"]       # 0.5 tool ran + 0.5 answer retrieved

    r = env.step("<answer>Wilhelm Conrad Röntgen</answer>")
    assert r.done and r.reward == 0.0
    assert r.info["outcome"] == 1.0 and r.info["reason"] == "answer" and r.info["f1"] == 1.0
    assert r.info["format"] == 1.0 and r.info["xml_wellformed"] == 1.0
    assert r.info["searches"] == 1 and r.info["answer_retrieved"] == 1.0


def test_a_search_that_misses_the_answer_earns_only_the_tool_reward(index):
    env = make_env(index)
    env.reset(XRAY)
    r = env.step("<search>Eiffel Tower</search>")
    assert r.info["tool_ok"] is True and r.info["answer_in_results"] == 0.0 and r.reward == 0.5
    r = env.step("<search>X-rays discovered</search>")
    assert r.info["answer_in_results"] == 1.0 and r.reward == 1.0 and r.info["searches"] == 2


def test_reward_weights_are_configurable(index):
    env = make_env(index, tool_reward=1.0, retrieval_reward=0.0)
    env.reset(XRAY)
    assert env.step("<search>X-rays</search>").reward == 1.0
    env = make_env(index, tool_reward=0.0, retrieval_reward=1.0)
    env.reset(XRAY)
    assert env.step("<search>Eiffel</search>").reward == 0.0


def test_answers_fall_back_to_answer(index):
    env = make_env(index)
    env.reset(BEATLES)                                   # no "answers": [answer] is the gold list
    r = env.step("<search>Fab Four band</search>")
    assert r.info["answer_in_results"] == 1.0
    assert env.step("<answer>the beatles.</answer>").info["outcome"] == 1.0


def test_passages_are_truncated_to_the_character_budget(index):
    env = make_env(index, max_passage_chars=60, top_k=2)
    env.reset(XRAY)
    r = env.step("<search>Nobel Prize physicist</search>")
    entries = [line[4:] for line in r.observation.split("\n")[1:-1]]
    assert len(entries) == 2
    assert all(len(e) <= 60 for e in entries) and all(e.endswith("...") for e in entries)
    assert entries[0].startswith("Wilhelm Röntgen: Wilhelm Conrad")
    assert r.info["answer_in_results"] == 1.0             # "Wilhelm Röntgen" is in the shown title
    full = make_env(index, max_passage_chars=10_000, top_k=2)
    full.reset(XRAY)
    assert "first Nobel Prize in Physics in 1901." in full.step("<search>Nobel Prize physicist</search>").observation


def test_answer_in_results_only_counts_what_the_policy_sees(index):
    env = make_env(index, max_passage_chars=40, top_k=1)
    env.reset({"prompt": "When were X-rays discovered?", "answer": "1895"})
    r = env.step("<search>Röntgen X-rays</search>")
    assert "1895" not in r.observation and r.info["answer_in_results"] == 0.0 and r.reward == 0.5


def test_rank_labels_do_not_count_as_the_answer(index):
    env = make_env(index, top_k=3)
    env.reset({"prompt": "How many?", "answer": "2"})
    r = env.step("<search>Nobel Prize</search>")
    assert "[2]" in r.observation and r.info["answer_in_results"] == 0.0


def test_an_empty_query_is_an_error_observation(index):
    env = make_env(index)
    env.reset(XRAY)
    r = env.step("<search>   </search>")
    assert not r.done and r.reward == 0.0
    assert r.observation.startswith("<result>\nError: empty query") and r.observation.endswith("</result>")
    assert r.info["tool_ok"] is False and r.info["error"] == "empty_query" and r.info["searches"] == 0


def test_a_query_without_results(index):
    env = make_env(index)
    env.reset(XRAY)
    r = env.step("<search>zzzz qqqq</search>")
    assert not r.done and r.reward == 0.0 and r.observation == "<result>\nNo results.\n</result>"
    assert r.info["tool_ok"] is False and r.info["error"] == "no_results"


def test_the_search_limit(index):
    env = make_env(index, max_searches=1)
    env.reset(XRAY)
    assert env.step("<search>X-rays</search>").reward == 1.0
    r = env.step("<search>X-rays</search>")
    assert not r.done and r.reward == 0.0 and r.info["error"] == "max_searches"
    assert "search limit" in r.observation and r.info["searches"] == 1


def test_a_turn_without_action_ends_with_outcome_0(index):
    env = make_env(index)
    env.reset(XRAY)
    r = env.step("I believe it was Röntgen.")
    assert r.done and r.reward == 0.0 and r.observation is None
    assert r.info["outcome"] == 0.0 and r.info["reason"] == "no_action" and r.info["format"] == 0.0


@pytest.mark.parametrize("prediction, em, f1_score", [
    ("Röntgen", 1.0, 1.0),                       # any gold answer counts
    ("wilhelm  röntgen!", 1.0, 1.0),             # normalized
    ("Conrad Röntgen", 0.0, 0.8),                # partial: F1 is the best over golds
    ("Marie Curie", 0.0, 0.0),
])
def test_exact_match_and_f1_over_several_gold_answers(index, prediction, em, f1_score):
    env = make_env(index)
    env.reset(XRAY)
    r = env.step(f"<answer>{prediction}</answer>")
    assert r.done and r.info["outcome"] == em == r.info["exact_match"]
    assert r.info["f1"] == pytest.approx(f1_score)
    assert r.info["prediction"] == prediction.strip()


def test_format_is_judged_over_all_the_policy_turns(index):
    env = make_env(index)
    env.reset(XRAY)
    env.step("<search>X-rays</search>")
    r = env.step("<result>made up</result><answer>Röntgen</answer>")
    assert r.info["format"] == 1.0 and r.info["outcome"] == 1.0
    env.reset(XRAY)
    env.step("<search>X-rays</search>")
    r = env.step("<result>made up <answer>Röntgen</answer>")    # a stray <result> left open
    assert r.info["format"] == 0.0 and r.info["xml_wellformed"] == 0.0 and r.info["outcome"] == 1.0
    env.reset(XRAY)
    r = env.step("<answer>Röntgen</answer>")                     # reset forgets earlier turns
    assert r.info["format"] == 1.0 and r.info["searches"] == 0 and r.info["answer_retrieved"] == 0.0


# ----------------------------------------------------------------------------- through the loop
def test_a_scripted_rollout_through_the_loop(index):
    from turnrl.models.tiny import build_tokenizer
    from turnrl.envs.search import SYSTEM_PROMPT

    turns = ["<search>who discovered x-rays</search>", "<answer>Wilhelm Röntgen</answer>"]
    texts = [SYSTEM_PROMPT, XRAY["prompt"], *turns] + [f"{p['title']}: {p['text']}" for p in CORPUS]
    fmt = ChatFormat(build_tokenizer(texts * 4, 512))
    tok = fmt.tokenizer
    engine = ScriptedEngine(tok, turns)
    [t] = run_rollouts(engine, [XRAY], lambda: SearchEnv(index=index), fmt, Budgets(4, 64, 2000))

    assert engine.calls[0]["stop"] == ("</search>", "</answer>")
    assert t.finish == "answer" and t.outcome == 1.0 and t.turn_rewards == [1.0, 0.0]
    assert t.info["f1"] == 1.0 and t.info["format"] == 1.0
    [obs_text] = t.observations
    assert obs_text.startswith("<result>\n[1] Wilhelm Röntgen:")
    turn1, turn2 = (tok(x, add_special_tokens=False)["input_ids"] for x in turns)
    obs = fmt.observation_ids(obs_text, "tool")
    assert t.response_ids == turn1 + obs + turn2
    assert t.loss_mask == [1] * len(turn1) + [0] * len(obs) + [1] * len(turn2)
    assert t.first_observation == len(turn1)
    # the observation sits in the tool role, between the two assistant messages
    assert tok.decode(obs) == f"<|im_end|>\n<|im_start|>tool\n{obs_text}<|im_end|>\n<|im_start|>assistant\n"
    assert engine.calls[1]["prompts"][0] == t.prompt_ids + turn1 + obs


# ----------------------------------------------------------------------------- the real corpus
def test_nq_questions_retrieve_their_gold_passage(data_dir):
    from turnrl.data.sources import load_rows, load_search_corpus

    corpus = load_search_corpus("nq_open", data_dir=data_dir)
    rows = load_rows("nq_open", data_dir=data_dir)[:50]
    start = time.perf_counter()
    index = SearchIndex(corpus)              # uncached: time a real build
    build_s = time.perf_counter() - start
    hits = 0
    for row in rows:
        gold = (row["passages"][0]["title"], row["passages"][0]["text"])
        hits += any((p["title"], p["text"]) == gold for p in index.search(row["prompt"], 3))
    rate = hits / len(rows)
    print(f"\nNQ index: {len(corpus)} passages built in {build_s:.2f} s; gold passage in top 3 for "
          f"{hits}/{len(rows)} = {rate:.0%} of questions")
    assert rate >= 0.8

    env = SearchEnv(corpus=corpus)           # the env path: cached index, gold answer found
    env.reset(rows[0])
    r = env.step(f"<search>{rows[0]['prompt']}</search>")
    assert r.info["tool_ok"] and r.info["answer_in_results"] == 1.0 and r.reward == 1.0
