#!/usr/bin/env bash
# troll inside real trainers: TRL's GRPO with troll's loss (python/tests/test_trl.py) and the
# tiny-LM run TROLL vs PPO clip vs DPPO (examples/python/grpo_tiny_lm.py --quick), and the Gaussian
# bandit PPO clip vs projection (examples/python/gaussian_bandit.py --quick). Runs after
# scripts/python-test.sh, in its venv, with the pinned TRL / Hugging Face stack and matplotlib of
# python/requirements-trl.txt (scripts/python-deps.sh --trl; --no-deps: pip never resolves torch
# or the CUDA toolkit).
# No hub access anywhere: the model and tokenizer are built locally, HF_HUB_OFFLINE=1.
#   TROLL_PYTHON_VENV   the environment python-test.sh made (default build/venv)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

venv=${TROLL_PYTHON_VENV:-build/venv}
started=$SECONDS
step() { printf '\n---- [python-trl-test.sh %4ds] %s ----\n' "$((SECONDS - started))" "$*"; }

if ! "$venv/bin/python" -c "import troll.torch" 2>/dev/null; then
  step "no troll in $venv: scripts/python-test.sh first"
  bash scripts/python-test.sh
fi

if [ "${TROLL_PYTHON_DEPS_READY:-0}" != 1 ] || ! "$venv/bin/python" -c "import trl" 2>/dev/null; then
  step "dependencies: scripts/python-deps.sh --trl (python/requirements-trl.txt, --no-deps)"
  bash scripts/python-deps.sh --trl
fi

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1

step "pytest python/tests/test_trl.py (TRL GRPOTrainer + troll, tiny local model)"
(cd python && "../$venv/bin/pytest" -q -p no:cacheprovider tests/test_trl.py)

step "examples/python/grpo_tiny_lm.py --quick"
"$venv/bin/python" examples/python/grpo_tiny_lm.py --quick --out build/grpo_tiny_lm
test -s build/grpo_tiny_lm/metrics.csv
test -s build/grpo_tiny_lm/grpo_tiny_lm.png
step "examples/python/gaussian_bandit.py --quick (Gaussian policy: PPO clip vs troll's projection)"
"$venv/bin/python" examples/python/gaussian_bandit.py --quick --out build/gaussian_bandit
test -s build/gaussian_bandit/metrics.csv
test -s build/gaussian_bandit/gaussian_bandit.png
step "trl tests, the tiny-LM run and the Gaussian bandit passed"
