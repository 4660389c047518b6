"""Training curves: a CSV that `dvc plots` draws, and a PNG that opens offline."""
from __future__ import annotations

import csv
from pathlib import Path

CURVES = [
    ("reward_mean", "reward"),
    ("accuracy", "rollout accuracy"),
    ("kl_ref", "KL(policy || initial)"),
    ("response_tokens_mean", "response tokens"),
    ("step_s", "step seconds"),
    ("logp_gap_max", "max |logp engine - trainer|"),
]


def write_csv(history: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Every key of every step, in order of first appearance: some appear later than step 1
    # (held-out accuracy every train.eval_every steps, a health check's first verdict)
    keys = ["step"] + [k for k in dict.fromkeys(k for h in history for k in h) if k != "step"]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(history)


def render_png(history: list[dict], path: Path, title: str = "turnrl training") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    for ax, (key, label) in zip(axes.flat, CURVES):
        ax.plot(steps, [h.get(key, float("nan")) for h in history], marker=".", linewidth=1)
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if key == "logp_gap_max":
            ax.set_yscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
