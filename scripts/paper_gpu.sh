#!/usr/bin/env bash
# Paper-scale LM cells on a lent GPU machine (the device tool), resumable across its 10-minute calls.
#
# The GPU machine is bare, reaches nothing, and gets only the working tree plus carried ignored paths; its
# Python has torch, msgpack, typer, sacrebleu, ... but not pika, zstandard or structlog; files come back from
# $OUT as at most 8 files of 16 MiB. So:
#
#   here, once:   scripts/paper_gpu.sh prepare
#                 -> .whl/ (wheels for the GPU machine's Python 3.12) and .gpudata/ (PTB and WikiText-2)
#   there:        bash scripts/paper_gpu.sh run CELLS SECONDS [SCALE] [DEVICE]
#                 (device run, carry [".whl", ".gpudata", "runs/paper"]): runs
#                 `reproduce.py table2 --scale paper --only CELLS`, stops it after SECONDS (each round is
#                 checkpointed: a stop loses at most the round in flight), and packs runs/paper into
#                 $OUT/state.tgz.NN (15 MiB parts) plus $OUT/progress.txt
#   here, after:  scripts/paper_gpu.sh unpack FOLDER   (FOLDER = the call's files_at)
#                 -> runs/paper restored; the next `run` call carries it and the same command resumes
#
# SCALE (default paper) and DEVICE (default cuda) exist so that the round trip can be rehearsed on the CPU:
# `OUT=/tmp/o bash scripts/paper_gpu.sh run ptb-fedavg-c0.5 60 smoke cpu` (then `unpack /tmp/o`).
set -euo pipefail
cd "$(dirname "$0")/.."
cmd=${1:-}
case "$cmd" in
  prepare)
    mkdir -p .git/info .whl .gpudata
    for p in /.whl/ /.gpudata/; do grep -qxF "$p" .git/info/exclude 2>/dev/null || echo "$p" >> .git/info/exclude; done
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .whl pika==1.4.4 zstandard==0.25.0 structlog==26.1.0
    cp -r ../shared/data/ptb ../shared/data/wikitext-2 .gpudata/
    du -sh .whl .gpudata
    ;;
  run)
    cells=${2:?cells: comma-separated run names, e.g. ptb-fedavg-c0.1}
    seconds=${3:?seconds to run before stopping and packing}
    scale=${4:-paper}
    device=${5:-cuda}
    out=${OUT:?OUT must name the folder whose files come back}
    export FEDMQ_DATA=$PWD/.gpudata PYTHONUNBUFFERED=1
    if [ -x .venv/bin/python ]; then  # a rehearsal here
      py=.venv/bin/python
    else  # the GPU machine: its python3 holds torch; add what it lacks
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
      export PYTHONPATH=/tmp/site:$PWD
      py=python3
    fi
    mkdir -p runs/paper
    rc=0
    timeout -s INT -k 30 "$seconds" "$py" scripts/reproduce.py table2 --scale "$scale" --seeds 0 \
      --device "$device" --threads 8 --only "$cells" --out runs/paper > runs/paper/log.txt 2>&1 || rc=$?
    {
      echo "exit $rc after at most $seconds s ($(date -u +%FT%TZ)); cells $cells; scale $scale; device $device"
      for m in runs/paper/table2/*/metrics.jsonl; do
        [ -f "$m" ] && echo "$(dirname "$m" | xargs basename): $(wc -l < "$m") rounds; last: $(tail -n 1 "$m" | cut -c1-300)"
      done
      tail -n 5 runs/paper/log.txt
    } > "$out/progress.txt"
    tar -czf - -C runs paper | split -b 15M -d - "$out/state.tgz."
    ls -la "$out"
    ;;
  unpack)
    from=${2:?the folder holding state.tgz.NN}
    rm -rf runs/paper
    mkdir -p runs
    cat "$from"/state.tgz.* | tar -xzf - -C runs
    cat "$from/progress.txt"
    ;;
  *)
    echo "usage: scripts/paper_gpu.sh prepare | run CELLS SECONDS [SCALE] [DEVICE] | unpack FOLDER" >&2
    exit 2
    ;;
esac
