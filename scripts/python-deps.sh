#!/usr/bin/env bash
# The Python test environment, without troll itself: a virtual environment this repository owns
# (build/venv, reused between runs; pip's cache is reused too), the pinned build and test
# dependencies and CPU-usable torch (python/requirements-test.txt), and with --trl the pinned TRL /
# Hugging Face stack of python/requirements-trl.txt (--no-deps: pip never resolves torch or the
# CUDA toolkit). scripts/python-test.sh and scripts/python-trl-test.sh call it, or skip it where
# TROLL_PYTHON_DEPS_READY=1 (scripts/test.sh runs it beside other one-core stages first).
#   TROLL_PYTHON_VENV   where the environment lives (default build/venv)
#   TROLL_TORCH_VERSION the torch release to install (default below)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

venv=${TROLL_PYTHON_VENV:-build/venv}
torch_version=${TROLL_TORCH_VERSION:-2.15.0}
python=${PYTHON:-python3}
trl=0
for arg in "$@"; do
  case "$arg" in
    --trl) trl=1 ;;
    *) echo "python-deps.sh: unknown argument '$arg' (only --trl)" >&2; exit 2 ;;
  esac
done
started=$SECONDS
step() { printf '\n---- [python-deps.sh %4ds] %s ----\n' "$((SECONDS - started))" "$*"; }

step "venv: $venv"
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check)

step "test dependencies (pinned; cached wheels are reused)"
"${pip[@]}" install -q -r python/requirements-test.txt
# PyPI's torch is the CUDA build; without --no-deps pip would fetch the whole CUDA toolkit.
"${pip[@]}" install -q --no-deps "torch==$torch_version"
"$venv/bin/python" -c "import torch; torch.zeros(1); print('torch', torch.__version__)"

if [ "$trl" = 1 ]; then
  step "TRL dependencies (python/requirements-trl.txt, --no-deps; cached wheels are reused)"
  "${pip[@]}" install -q --no-deps -r python/requirements-trl.txt
  "$venv/bin/python" -c "import trl, transformers; print('trl', trl.__version__, 'transformers', transformers.__version__)"
fi
step "python dependencies ready"
