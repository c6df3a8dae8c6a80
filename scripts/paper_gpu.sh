#!/usr/bin/env bash
# Paper-scale LM cells on a lent GPU machine (the device tool), resumable across its 10-minute calls.
#
# The GPU machine is bare, reaches nothing, and gets only the working tree plus carried ignored paths; its
# Python has torch, msgpack, typer, sacrebleu, ... but not pika, zstandard or structlog; files come back from
# $OUT as at most 8 files of 16 MiB. So:
#
#   here, once:   scripts/paper_gpu.sh prepare
#                 -> .whl/ (wheels for the GPU machine's Python 3.12) and .gpudata/ (PTB and WikiText-2)
#   there:        [EXP=NAME] [SET="KEY=VALUE ..."] [COHORT=1] bash scripts/paper_gpu.sh run JOBS SECONDS [SCALE] [DEVICE]
#                 (device run, carry [".whl", ".gpudata"]): JOBS is a comma-separated list of CELL:SEED (e.g.
#                 ptb-fedavg-c0.1:0,ptb-fedatt-c0.1:0) of experiment EXP (default table2); each job is its own
#                 process, `reproduce.py EXP --scale paper --seeds SEED --only CELL [--set KEY=VALUE ...]
#                 --out runs/paper/EXP[-KEY-VALUE...]/seed-SEED/CELL`,
#                 all at once on the one GPU (a GRU client's steps are too small to keep it busy alone), each
#                 stopped after SECONDS (every round is checkpointed: a stop loses at most the round in flight).
#                 COHORT=1 adds --cohort: each federation trains a round's selected clients as one batched model.
#                 What comes back is small: $OUT/results.tgz (metrics, summaries, specs, configs, logs; no
#                 weights), $OUT/progress.txt and $OUT/gpu.txt (nvidia-smi every 30 s). The weights and
#                 checkpoints stay on that machine, so the same command resumes the unfinished jobs (federations
#                 and centralized baselines alike) only while it is still warm (30 s after a call: issue the next
#                 call at once, analyse after); on a fresh machine they start again from round 1.
#                 Two experiments in one call: `run` the first in the background, and the second a minute later
#                 (once the first has installed the wheels and started MPS) with OUT=$OUT/NAME, then `wait`.
#                 BENCH="ptb wikitext-2" first runs `fedmq bench cohort` on each corpus (BENCH_S seconds at most each,
#                 default 120; BENCH_COHORT sizes, default 10,50; BENCH_ARGS more options) into $OUT/bench.txt, and
#                 the jobs get what is left of SECONDS.
#   here, after:  scripts/paper_gpu.sh unpack FOLDER   (FOLDER = the call's files_at) -> merged into runs/paper
#
# SCALE (default paper) and DEVICE (default cuda) exist so that the round trip can be rehearsed on the CPU:
# `OUT=/tmp/o bash scripts/paper_gpu.sh run wikitext-2-fedavg-c0.5:0 60 smoke cpu` (then `unpack /tmp/o`).
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
    jobs=${2:?jobs: comma-separated CELL:SEED, e.g. ptb-fedavg-c0.1:0}
    seconds=${3:?seconds to run before stopping}
    scale=${4:-paper}
    device=${5:-cuda}
    out=${OUT:?OUT must name the folder whose files come back}
    exp=${EXP:-table2}  # the experiment whose cells JOBS names (e.g. EXP=sweep)
    sets=""
    for kv in ${SET:-}; do sets="$sets --set $kv"; done  # SET="lr=0.5 momentum=0.5": job settings for every job
    export FEDMQ_DATA=$PWD/.gpudata PYTHONUNBUFFERED=1
    if [ -x .venv/bin/python ]; then  # a rehearsal here
      py=.venv/bin/python
    else  # the GPU machine: its python3 holds torch; add what it lacks
      # once a machine: a second invocation beside a running one (another EXP in the same call) must not rewrite
      # the packages under the first one's processes
      [ -d /tmp/site/pika ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
      export PYTHONPATH=/tmp/site:$PWD
      py=python3
      # CUDA MPS lets the jobs' small kernels run side by side instead of taking turns on the GPU. A warm
      # machine may still run the daemon from the last call ("already running": keep it); if CUDA does not
      # answer through it, stop it and go on without.
      nvidia-cuda-mps-control -d 2>/dev/null || true
      if ! timeout 60 python3 -c 'import torch; torch.zeros(1, device="cuda")' 2>/dev/null; then
        echo quit | nvidia-cuda-mps-control 2>/dev/null || true
        echo "MPS off: CUDA did not answer through it" >&2
      fi
      # GPU memory and utilisation every 30 s, returned as $OUT/gpu.txt
      (while :; do echo "$(date -u +%T) $(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader)"
        sleep 30; done >> "$out/gpu.txt") &
      watcher=$!
    fi
    started=$SECONDS  # BENCH first (see the header); the jobs get what is left of SECONDS
    todo=$jobs
    for corpus in ${BENCH:-}; do
      echo "== bench cohort $corpus ($(date -u +%T))" >> "$out/bench.txt"
      timeout -k 10 "${BENCH_S:-120}" "$py" -m fedmq.cli.app bench cohort --data ".gpudata/$corpus" --cohort "${BENCH_COHORT:-10,50}" \
        --epochs 1 --repeats 1 --device "$device" ${BENCH_ARGS:-} >> "$out/bench.txt" 2>&1 || echo "bench cohort $corpus: exit $?" >> "$out/bench.txt"
    done
    seconds=$((seconds - (SECONDS - started)))
    if [ "$seconds" -lt 30 ]; then echo "no time left for the jobs after the bench" >&2; todo=""; fi
    pids=()
    for job in ${todo//,/ }; do
      cell=${job%%:*}; seed=${job#*:}; [ "$seed" = "$job" ] && seed=0
      dir=runs/paper/$exp${SET:+-${SET//[ =]/-}}/seed-$seed/$cell
      mkdir -p "$dir"
      # shellcheck disable=SC2086  # $sets is a list of options
      timeout -s INT -k 30 "$seconds" "$py" scripts/reproduce.py "$exp" --scale "$scale" --seeds "$seed" \
        --device "$device" --threads 1 --only "$cell" --out "$dir" $sets ${COHORT:+--cohort} >> "$dir/log.txt" 2>&1 &
      pids+=($!)
    done
    rc=0
    for p in "${pids[@]}"; do wait "$p" || rc=$?; done
    [ -n "${watcher:-}" ] && kill "$watcher" 2>/dev/null
    {
      echo "last exit $rc after at most $seconds s ($(date -u +%FT%TZ)); $exp jobs $jobs; set ${SET:-nothing}; scale $scale; device $device"
      for m in runs/paper/"$exp"*/seed-*/*/"$exp"/*/metrics.jsonl; do
        [ -f "$m" ] || continue
        d=$(dirname "$m")
        echo "$d: $(wc -l < "$m") rounds$([ -f "$d/summary.json" ] && echo ', done'); last: $(tail -n 1 "$m" | cut -c1-200)"
      done
      for l in runs/paper/"$exp"*/seed-*/*/log.txt; do [ -f "$l" ] || continue; echo "== $l"; tail -n 3 "$l"; done
    } > "$out/progress.txt"
    mkdir -p runs/paper
    (cd runs && find paper \( -name metrics.jsonl -o -name summary.json -o -name spec.json -o -name config.json \
      -o -name results.json -o -name log.txt \) -print0 | tar -czf "$out/results.tgz" --null -T -)
    ls -la "$out"
    ;;
  unpack)
    from=${2:?the folder holding results.tgz}
    mkdir -p runs
    tar -xzf "$from/results.tgz" -C runs
    cat "$from/progress.txt"
    if [ -f "$from/bench.txt" ]; then cat "$from/bench.txt"; fi
    ;;
  *)
    echo "usage: scripts/paper_gpu.sh prepare | run CELLS SECONDS [SCALE] [DEVICE] | unpack FOLDER" >&2
    exit 2
    ;;
esac
