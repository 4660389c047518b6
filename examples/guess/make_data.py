"""Writes the example's data files (rerun to regenerate them; they are committed):

    python -m examples.guess.make_data
"""
import json
import random
from pathlib import Path

HERE = Path(__file__).parent


def rows(count: int, seed: int, top: tuple[int, ...]) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        hi = rng.choice(top)
        game = f"{seed}{i:04d}"   # prompts differ, so no held-out prompt is also a training prompt
        out.append({"id": f"g{game}", "prompt": f"Game {game}: I picked a number from 1 to {hi}. Guess it.",
                    "answer": str(rng.randint(1, hi))})
    return out


def main() -> None:
    for name, count, seed, top in (("train", 400, 0, (8, 12, 16)), ("heldout", 64, 1, (8, 12, 16))):
        (HERE / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(count, seed, top)))
    # the benchmark file: other field names (mapped in params), wider ranges
    bench = [{"question": r["prompt"], "target": int(r["answer"])} for r in rows(32, 2, (16, 20))]
    (HERE / "bench_wide.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bench))


if __name__ == "__main__":
    main()
