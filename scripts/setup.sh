#!/usr/bin/env bash
# Create .venv and install fedmq. torch is pinned here (the one place outside the Dockerfiles) and installed
# first, so pip takes the CPU build (2.13.0) and never resolves a newer one with CUDA packages.
#
#   scripts/setup.sh            the runtime only: what `make demo` needs
#   scripts/setup.sh --test     also the test extras, checkov (the deploy tests' scanner) and Flower 1.41
#                               (`fedmq bench flower` and its test), each in a venv of its own (`make test`);
#                               the three venvs are filled at the same time
#   --dry-run                   print the commands instead of running them (in order, one after the other)
#
# Last, the checkout's own modules are compiled to bytecode once: the test suite starts hundreds of fedmq
# processes, and where PYTHONDONTWRITEBYTECODE is set each of them would compile the package's sources again.
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
# start a step in the background (in order, under --dry-run); `join` waits for them and fails if one failed
JOBS=()
background() { if [ "$DRY" = 1 ]; then "$@"; else "$@" & JOBS+=($!); fi; }
join() { for pid in "${JOBS[@]}"; do wait "$pid"; done; JOBS=(); }
PY=${PYTHON:-python3}
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)

# checkov lives in its own venv: it would downgrade packages fedmq uses
checkov_venv() {
  if missing .fedmq-cache/checkov-venv/bin/checkov; then
    run "$PY" -m venv .fedmq-cache/checkov-venv
    run .fedmq-cache/checkov-venv/bin/pip install -q --disable-pip-version-check checkov==3.3.30
  fi
}
# Flower 1.41 (the bench extra) lives in its own venv: it pins typer/rich versions fedmq's CLI does not use.
# `fedmq bench flower` and tests/integration/test_flower_control.py find it there; flwr's script marks it done.
# Its torch and Flower go in beside .venv's install; fedmq itself (an editable build of this checkout) after it.
FLOWER=.fedmq-cache/flower-venv
FLOWER_PIP=($FLOWER/bin/python -m pip install -q --disable-pip-version-check)
flower_wanted() { missing $FLOWER/bin/flwr; }
flower_venv() {
  run "$PY" -m venv $FLOWER
  run "${FLOWER_PIP[@]}" torch==2.13.0
  run "${FLOWER_PIP[@]}" "$("$PY" -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["bench"])')"
}

if missing .venv/bin/python; then run "$PY" -m venv .venv; fi
FLOWER_NEW=0
if [ "$TEST" = 1 ]; then
  background checkov_venv
  if flower_wanted; then FLOWER_NEW=1; background flower_venv; fi
fi
run "${PIP[@]}" torch==2.13.0
if [ "$TEST" = 1 ]; then
  run "${PIP[@]}" -e '.[test]'
  join
  if [ "$FLOWER_NEW" = 1 ]; then run "${FLOWER_PIP[@]}" -e '.[bench]'; fi
else
  run "${PIP[@]}" -e .
fi
run .venv/bin/python -m compileall -q -j 0 fedmq broker aggregator client_agent cli benchmarks > /dev/null
