"""Synthetic tasks for the embedded default, with fixed seeds and disjoint splits.

`code_tool` task: multiplication of two multi-digit numbers. A model of a million
parameters cannot multiply in its head, but it can copy the factors into `<code>` and the
tool's `<output>` into `<answer>`: the task needs the tool to be solved well.

Rows follow the preprocessed schema of `turnrl.data.sources`: id, prompt, answer, answers,
subject, level, source.
"""
from __future__ import annotations

import random


def _number(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1), 10 ** digits - 1)


def product_rows(count: int, *, min_digits: int, max_digits: int, seed: int, split: str,
                 exclude: set[tuple[int, int]] | None = None) -> list[dict]:
    """`count` distinct multiplication problems; pairs in `exclude` are never produced."""
    rng = random.Random(f"{seed}:{split}")
    seen = set(exclude or ())
    rows: list[dict] = []
    while len(rows) < count:
        a = _number(rng, rng.randint(min_digits, max_digits))
        b = _number(rng, rng.randint(min_digits, max_digits))
        if (a, b) in seen:
            continue
        seen.add((a, b))
        answer = str(a * b)
        rows.append({
            "id": f"product-{split}-{len(rows)}",
            "prompt": f"Compute {a} * {b}.",
            "answer": answer,
            "answers": [answer],
            "subject": "multiplication",
            "level": len(str(a)) + len(str(b)),
            "source": "synthetic_products",
        })
    return rows


def product_splits(train: int, heldout: int, *, min_digits: int, max_digits: int,
                   seed: int) -> tuple[list[dict], list[dict]]:
    """Train and held-out rows; no (a, b) pair occurs in both."""
    heldout_rows = product_rows(heldout, min_digits=min_digits, max_digits=max_digits,
                                seed=seed, split="heldout")
    taken = {_factors(r["prompt"]) for r in heldout_rows}
    train_rows = product_rows(train, min_digits=min_digits, max_digits=max_digits,
                              seed=seed, split="train", exclude=taken)
    return train_rows, heldout_rows


def _factors(prompt: str) -> tuple[int, int]:
    a, b = prompt.removeprefix("Compute ").removesuffix(".").split(" * ")
    return int(a), int(b)


def product_demonstration(row: dict, rng: random.Random, tool_fraction: float) -> list[str]:
    """Scripted policy turns for the warm start: with probability `tool_fraction` the
    demonstration calls the tool and copies its output; otherwise it answers unaided with a
    plausible number of the right length (almost always wrong). RL has to discover that the
    tool pays."""
    a, b = _factors(row["prompt"])
    if rng.random() < tool_fraction:
        return [f"<code>print({a} * {b})</code>", f"<answer>{row['answer']}</answer>"]
    digits = len(row["answer"])
    guess = str(_number(rng, digits))
    return [f"<answer>{guess}</answer>"]
