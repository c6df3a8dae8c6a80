#!/usr/bin/env bash
# Create .venv and install fedmq with its test extras. torch is pinned and installed first so pip takes
# the CPU build (2.13.0) and never resolves a newer one with CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
# checkov (the deploy tests' security scanner) lives in its own venv: it would downgrade packages fedmq uses
[ -x .fedmq-cache/checkov-venv/bin/checkov ] || { "$PY" -m venv .fedmq-cache/checkov-venv && \
  .fedmq-cache/checkov-venv/bin/pip install -q --disable-pip-version-check checkov==3.3.30; }
