"""A judge that behaves like a served judge model, for benchmarks/judge.py: an OpenAI-compatible
Chat Completions server whose verdict is the truth (turnrl's math grader against the reference)
seen through a judge's faults:

- it is wrong on `--flip` of the answers (a judge's disagreement with the verifier);
- it answers after a log-normal delay (`--latency-median` seconds, spread `--latency-sigma`;
  0.5 and 0.6 give p99 ~ 2 s), as a loaded inference server does;
- `--overload` of the requests get HTTP 503 (retried by turnrl), `--babble` an answer with no score.

    python benchmarks/noisy_judge.py --port 8731 --seed 0

The prompt must hold `Reference: <answer> || Response: <the response>` (the benchmark's template);
the answer is a short reasoning and `Score: N` on 0-10. Requests and their delays go to stdout.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from turnrl.rewards.math import grade_any  # noqa: E402

TEMPLATE = "Question: {question} || Reference: {reference} || Response: {response} || Score the response 0-10."
_FIELDS = re.compile(r"Reference: (?P<reference>.*?) \|\| Response: (?P<response>.*?) \|\| Score", re.S)


def verdict(prompt: str, rng: random.Random, flip: float, babble: float) -> str:
    """The judge's answer to one prompt: right with probability 1 - flip."""
    if rng.random() < babble:
        return "The response is hard to assess without more context."
    match = _FIELDS.search(prompt)
    if match is None:
        return "I cannot find the response to grade."
    response = match["response"]
    if "<answer>" in response and "</answer>" not in response:   # the turn ended at its stop string
        response += "</answer>"
    correct = grade_any(response, {"answer": match["reference"]}).correct
    if rng.random() < flip:
        correct = not correct
    score = rng.choice([8, 9, 10]) if correct else rng.choice([0, 1, 2])
    reason = "The final answer matches the reference." if correct else "The final answer does not match."
    return f"{reason} Score: {score}"


def app(seed: int, flip: float, latency_median: float, latency_sigma: float, overload: float, babble: float):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    import math
    rng = random.Random(seed)

    async def chat(request):
        body = await request.json()
        delay = latency_median * math.exp(rng.gauss(0.0, latency_sigma))
        await asyncio.sleep(delay)
        if rng.random() < overload:
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)
        text = verdict(body["messages"][-1]["content"], rng, flip, babble)
        return JSONResponse({"id": "judge", "object": "chat.completion", "model": body.get("model", "judge"),
                             "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                          "finish_reason": "stop"}]})
    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=8731)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--flip", type=float, default=0.1)
    parser.add_argument("--latency-median", type=float, default=0.5)
    parser.add_argument("--latency-sigma", type=float, default=0.6)
    parser.add_argument("--overload", type=float, default=0.02)
    parser.add_argument("--babble", type=float, default=0.01)
    args = parser.parse_args(argv)
    import uvicorn
    uvicorn.run(app(args.seed, args.flip, args.latency_median, args.latency_sigma, args.overload, args.babble),
                host="127.0.0.1", port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
