#!/usr/bin/env bash
# Create .venv and install fedmq. torch is pinned here (the one place outside the Dockerfiles) and installed
# first, so pip takes the CPU build (2.13.0) and never resolves a newer one with CUDA packages.
#
#   scripts/setup.sh            the runtime only: what `make demo` needs
#   scripts/setup.sh --test     also the test extras, checkov (the deploy tests' scanner) and Flower 1.41
#                               (`fedmq bench flower` and its test), each in a venv of its own (`make test`)
#   --dry-run                   print the commands instead of running them
set -euo pipefail
cd "$(dirname "$0")/.."
TEST=0
DRY=0
for arg in "$@"; do
  case "$arg" in
    --test) TEST=1 ;;
    --dry-run) DRY=1 ;;
    *) echo "scripts/setup.sh: unknown argument $arg; use --test and/or --dry-run" >&2; exit 2 ;;
  esac
done
run() { if [ "$DRY" = 1 ]; then echo "$*"; else "$@"; fi; }
missing() { [ "$DRY" = 1 ] || [ ! -x "$1" ]; }
PY=${PYTHON:-python3}
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if missing .venv/bin/python; then run "$PY" -m venv .venv; fi
run "${PIP[@]}" torch==2.13.0
if [ "$TEST" = 1 ]; then
  run "${PIP[@]}" -e '.[test]'
  # checkov lives in its own venv: it would downgrade packages fedmq uses
  if missing .fedmq-cache/checkov-venv/bin/checkov; then
    run "$PY" -m venv .fedmq-cache/checkov-venv
    run .fedmq-cache/checkov-venv/bin/pip install -q --disable-pip-version-check checkov==3.3.30
  fi
  # Flower 1.41 (the bench extra) lives in its own venv: it pins typer/rich versions fedmq's CLI does not use.
  # `fedmq bench flower` and tests/integration/test_flower_control.py find it there; flwr's script marks it done
  FLOWER=.fedmq-cache/flower-venv
  if missing $FLOWER/bin/flwr; then
    run "$PY" -m venv $FLOWER
    run $FLOWER/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
    run $FLOWER/bin/python -m pip install -q --disable-pip-version-check -e '.[bench]'
  fi
else
  run "${PIP[@]}" -e .
fi
