"""Synthetic tasks for the embedded default, one per environment, with fixed seeds and
disjoint train and held-out splits.

Each task is one a model of a million parameters cannot solve well on its own but can
solve with what its environment offers, so RL has something to discover:

- `code_tool`: multiply two 3-digit numbers. Copy the factors into `<code>`, the tool's
  `<output>` into `<answer>`.
- `search`: 'What is the code of "Agent 48213"?' The codes are random: only the search index
  knows them. Search the name, copy the code from the result.
- `math_refine`: add two 2-digit numbers. The solver's first attempt is a quick guess (a
  million parameters do not add in one shot); the high-level role can work the column sums
  with their carries and state the sum as feedback, which the refinement copies, or approve
  the attempt, which the refinement then keeps.
- `intervention`: the same additions, worked column by column then answered. A policy that
  rambles ("Let me think about it again.") is interrupted and may run out of turns.

Rows follow the preprocessed schema of `turnrl.data.sources`: id, prompt, answer, answers,
subject, level, source. Demonstrations are scripted policy turns for the tiny model's warm
start (`turnrl.pipeline.prepare_model`): `good` ones use the environment well, the others show the habit RL
has to unlearn (guess, skip the feedback, ramble). The warm start's skill phase trains whole
demonstrations (a share `skill_good_fraction` good: where the habit is itself a behaviour the
model must be able to carry on, like rambling until interrupted, it is learned there too);
its prior phase trains good demonstrations whole and of the others only their `choice`, the
point where good and bad part.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from functools import partial
from typing import Callable

__all__ = ["ANSWER_TASK", "Demonstration", "SyntheticTask", "TASKS", "addition_steps", "split_numbers"]


def split_numbers(count: int, *, split: str, exclude: set, start: int = 0) -> list[int]:
    """`count` numbers of `split` that the other split never gets: 2 * (start + i), plus 1 for
    training (held-out even, training odd), skipping any in `exclude`. The episodes of an
    environment without a data set: a game's seeds, a taskset's indices."""
    odd = 0 if split == "heldout" else 1
    numbers, i = [], 0
    while len(numbers) < count:
        number = 2 * (start + i) + odd
        i += 1
        if number not in exclude:
            numbers.append(number)
    return numbers


@dataclass(frozen=True)
class Demonstration:
    turns: list[str]
    # A bad demonstration's (turn, prefix): in the prior phase only the tokens of that policy
    # turn up to `prefix` are trained, the choice of what to do, not what follows (a made-up
    # number, a ramble). None: train every policy token.
    choice: tuple[int, str] | None = None


@dataclass(frozen=True)
class SyntheticTask:
    """An environment's task for the embedded default, each part optional for a plugin:

    rows           (count, *, seed, split, exclude) -> rows: `data.train_set: synthetic`
    key            row -> what must not repeat across the splits (default: the prompt)
    demonstration  (row, rng, good) -> Demonstration (or a list of policy turns): the scripted
                   turns `model.path: tiny` is warm-started on; `good` ones use the environment
                   well, the others show the habit RL must unlearn
    any_row        the demonstration takes any row with a reference answer (`answer`), not only
                   this task's own rows: with `data.train_set` naming a data set (reasoning-gym,
                   a jsonl with answers) the warm start demonstrates that set's training rows
    no_demonstration  without a demonstration: why, and what to set (the line `model.path: tiny`
                   is refused with, before any work, instead of the generic one)
    """
    name: str
    rows: Callable[..., list[dict]] | None = None
    key: Callable[[dict], object] | None = None
    demonstration: Callable[[dict, random.Random, bool], "Demonstration | list[str]"] | None = None
    skill_good_fraction: float = 1.0
    any_row: bool = False
    no_demonstration: str = ""

    def splits(self, train: int, heldout: int, seed: int) -> tuple[list[dict], list[dict]]:
        """Train and held-out rows; no problem occurs in both."""
        if self.rows is None:
            raise ValueError(f"the {self.name} environment has no synthetic rows; set data.train_set to a data set")
        key = self.key or (lambda r: r["prompt"])
        heldout_rows = self.rows(heldout, seed=seed, split="heldout", exclude=set())
        train_rows = self.rows(train, seed=seed, split="train", exclude={key(r) for r in heldout_rows})
        return train_rows, heldout_rows

    def demonstrate(self, row: dict, rng: random.Random, good: bool) -> Demonstration:
        if self.demonstration is None:
            raise ValueError(f"the {self.name} environment gives no demonstrations for the tiny model's warm start")
        demo = self.demonstration(row, rng, good)
        if isinstance(demo, (str, bytes)) or demo is None:
            raise TypeError(f"the demonstration function returned {type(demo).__name__} {demo!r:.60}; it must return "
                            "the policy's turns: a list of strings (one per turn) or a Demonstration")
        demo = demo if isinstance(demo, Demonstration) else Demonstration(list(demo))
        if not all(isinstance(turn, str) for turn in demo.turns):
            kinds = sorted({type(turn).__name__ for turn in demo.turns if not isinstance(turn, str)})
            raise TypeError(f"the demonstration function returned turns of {', '.join(kinds)}; each turn must be "
                            "the policy's text, a string")
        return demo


def demonstration_problem(task: SyntheticTask | None, env_name: str) -> str:
    """Why `model.path: tiny` cannot be warm-started on environment `env_name`'s `task`, one line
    (its own `no_demonstration` where it says why); "" when it can."""
    if task is not None and task.demonstration is not None:
        return ""
    if task is not None and task.no_demonstration:
        return task.no_demonstration
    return (f"the embedded model is warm-started on the environment's demonstrations, and {env_name!r} gives none; "
            "add EnvSpec(task=SyntheticTask(name, demonstration=fn)) (docs/plugins.md, \"The warm start\"), or set "
            "model.path to a checkpoint")


def _number(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1), 10 ** digits - 1)


def _distinct(count: int, seed: int, split: str, exclude: set, draw: Callable[[random.Random], tuple],
              row: Callable[[int, tuple], dict]) -> list[dict]:
    rng = random.Random(f"{seed}:{split}")
    seen = set(exclude)
    rows: list[dict] = []
    while len(rows) < count:
        item = draw(rng)
        if item in seen:
            continue
        seen.add(item)
        rows.append(row(len(rows), item))
    return rows


def _row(task: str, split: str, index: int, prompt: str, answer: str, level: int, **extra) -> dict:
    return {"id": f"{task}-{split}-{index}", "prompt": prompt, "answer": answer, "answers": [answer],
            "subject": task, "level": level, "source": f"synthetic_{task}", **extra}


# --------------------------------------------------------------------------- code_tool
def product_rows(count: int, *, seed: int, split: str, exclude: set, digits: int = 3) -> list[dict]:
    def row(i: int, ab: tuple) -> dict:
        a, b = ab
        return _row("product", split, i, f"Compute {a} * {b}.", str(a * b), 2 * digits, a=a, b=b)
    return _distinct(count, seed, split, exclude, lambda rng: (_number(rng, digits), _number(rng, digits)), row)


def product_demonstration(row: dict, rng: random.Random, good: bool) -> Demonstration:
    """Good: call the tool and copy its output. Otherwise: guess a number of the right length
    (almost always wrong); only the choice to answer at once is trained."""
    if good:
        return Demonstration([f"<code>print({row['a']} * {row['b']})</code>", f"<answer>{row['answer']}</answer>"])
    guess = _number(rng, len(row["answer"]))
    return Demonstration([f"<answer>{guess}</answer>"], choice=(0, "<answer>"))


# --------------------------------------------------------------------------- search
def _name(rng: random.Random) -> str:
    """An agent number, e.g. "Agent 48213": 90,000 names. (Call signs such as "Heron 482" were
    tried first: the tiny model's warm start copies digits far better than words.)"""
    return f"Agent {rng.randint(10000, 99999)}"


def lookup_rows(count: int, *, seed: int, split: str, exclude: set) -> list[dict]:
    """Entities with random 4-digit codes (only the corpus, `lookup_corpus`, states them)."""
    codes = random.Random(f"{seed}:{split}:codes")

    def row(i: int, item: tuple) -> dict:
        (name,) = item
        # quoted, so the name has the same tokens in the question and in a search query (a
        # byte-level BPE gives "Heron" after a space a different token than after '"' or '>')
        return _row("lookup", split, i, f'What is the code of "{name}"?', str(_number(codes, 4)), 1, entity=name)
    return _distinct(count, seed, split, exclude, lambda rng: (_name(rng),), row)


def lookup_corpus(rows: list[dict]) -> list[dict]:
    """The search corpus: one passage per entity of the rows."""
    return [{"id": r["id"], "title": r["entity"], "text": f"The code of {r['entity']} is {r['answer']}."}
            for r in rows]


def lookup_demonstration(row: dict, rng: random.Random, good: bool) -> Demonstration:
    if good:
        return Demonstration([f"<search>{row['entity']}</search>", f"<answer>{row['answer']}</answer>"])
    return Demonstration([f"<answer>{_number(rng, 4)}</answer>"], choice=(0, "<answer>"))


# --------------------------------------------------------------------------- additions
def addition_rows(count: int, *, seed: int, split: str, exclude: set, digits: int = 3) -> list[dict]:
    def row(i: int, ab: tuple) -> dict:
        a, b = ab
        return _row("addition", split, i, f"Compute {a} + {b}.", str(a + b), digits, a=a, b=b)
    return _distinct(count, seed, split, exclude, lambda rng: (_number(rng, digits), _number(rng, digits)), row)


def addition_steps(a: int, b: int) -> str:
    """Column sums from the ones up, each with the carry it receives:
    475 + 382 -> "5+2=7 7+8=15 4+3+1=8" (the answer, 857, is the last digits read backwards)."""
    steps, carry = [], 0
    xs, ys = str(a)[::-1], str(b)[::-1]
    for i in range(max(len(xs), len(ys))):
        x, y = int(xs[i]) if i < len(xs) else 0, int(ys[i]) if i < len(ys) else 0
        total = x + y + carry
        steps.append(f"{x}+{y}{'+1' if carry else ''}={total}")
        carry = total // 10
    return " ".join(steps)


def refine_demonstration(row: dict, rng: random.Random, good: bool) -> Demonstration:
    """math_refine, shared weights: attempt (a guess of the answer's length), feedback (high
    level), refinement. Good feedback works the columns and states the sum they give, which the
    refinement copies; lazy feedback approves and the refinement keeps the guess.

    Tried first, and failed at the warm start: a carry-less digit-wise attempt (the tiny model
    could not learn to write it), and feedback with the columns only (the refinement could not
    assemble the answer from them in a later turn)."""
    attempt = str(_number(rng, len(row["answer"])))
    steps = addition_steps(row["a"], row["b"])
    if good:
        return Demonstration([f"<answer>{attempt}</answer>", f"<feedback>{steps} gives {row['answer']}</feedback>",
                              f"<answer>{row['answer']}</answer>"])
    return Demonstration([f"<answer>{attempt}</answer>", "<feedback>Looks right.</feedback>",
                          f"<answer>{attempt}</answer>"], choice=(1, "<feedback>L"))


RAMBLE = "Let me think about it again."


def intervention_demonstration(row: dict, rng: random.Random, good: bool) -> Demonstration:
    """Good: work the columns and answer in the first turn. Otherwise ramble for one to three
    turns, each interrupted by the environment; with the default three turns, a third ramble
    leaves no turn to answer in. A row that is not an addition (a data set's: reasoning-gym, a
    jsonl) has no columns to work: its good turn is the reference answer."""
    answer = f"<answer>{row['answer']}</answer>"
    worked = f"{addition_steps(row['a'], row['b'])} {answer}" if "a" in row and "b" in row else answer
    if good:
        return Demonstration([worked])
    return Demonstration([RAMBLE] * rng.randint(1, 3) + [worked], choice=(0, RAMBLE[0]))


# --------------------------------------------------------------------------- one answer
def answer_demonstration(row: dict, rng: random.Random, good: bool) -> Demonstration:
    """math_answer, any row with a reference answer. Good: the answer between the tags the
    grader reads. Otherwise the habit RL must unlearn: the answer stated without them, which no
    grader extracts (scored 0); only the choice to start without the tag is trained in the prior."""
    if good:
        return Demonstration([f"<answer>{row['answer']}</answer>"])
    return Demonstration([f"The answer is {row['answer']}."], choice=(0, "The"))


TASKS: dict[str, SyntheticTask] = {
    "code_tool": SyntheticTask("code_tool", product_rows, lambda r: (r["a"], r["b"]), product_demonstration),
    "search": SyntheticTask("search", lookup_rows, lambda r: (r["entity"],), lookup_demonstration),
    # two-digit additions: three columns are more than the tiny model's warm start learns well
    "math_refine": SyntheticTask("math_refine", partial(addition_rows, digits=2), lambda r: (r["a"], r["b"]),
                                 refine_demonstration, skill_good_fraction=0.5),
    "intervention": SyntheticTask("intervention", partial(addition_rows, digits=2), lambda r: (r["a"], r["b"]),
                                  intervention_demonstration, skill_good_fraction=0.5, any_row=True),
}

# math_answer's: no rows of its own (data.train_set names its data); it demonstrates their training rows
ANSWER_TASK = SyntheticTask("math_answer", demonstration=answer_demonstration, skill_good_fraction=0.5, any_row=True)
