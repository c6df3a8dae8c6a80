#!/usr/bin/env bash
# Run several cells of one experiment side by side on one machine, one process each: on one GPU that they share
# (a GRU-small client's steps are too small to keep a GPU busy alone, so several federations fill it better than
# one), or on the CPU cores.
#
#   scripts/run_cells.sh [options] CELL[:SEED] ...
#
# A cell is one run of an experiment's grid (benchmarks/experiments/grids.py; `--only` of scripts/reproduce.py), e.g.
# ptb-fedavg-c0.1:0 ptb-fedatt-c0.1:0 ptb-fedavg-c0.1:1 (SEED defaults to 0). Each job runs
#
#   python scripts/reproduce.py EXP --scale SCALE --seeds SEED --only CELL --device DEVICE --threads 1 \
#       --out OUT/EXP/seed-SEED/CELL [--set KEY=VALUE ...] [--cohort]
#
# with its log in OUT/EXP/seed-SEED/CELL/log.txt; a job's own folder keeps its results.md apart from the others'.
# At the end the finished jobs' results files (benchmarks/results_file.py) are merged into OUT/EXP/EXP.SCALE.json,
# the file kept in git (under benchmarks/results/), with this command (less --out) as the command that made it.
# Every round is checkpointed, so the same command run again resumes the unfinished jobs from their last round
# (finished ones are kept). Ctrl-C, SIGTERM or --time-limit stop every job with SIGINT: a stop loses at most the
# round in flight.
#
# Options:
#   --exp NAME          the experiment whose cells are named (default table2)
#   --scale S           smoke | cpu | paper (default paper)
#   --device D          cuda | cpu | auto (default cuda)
#   --out DIR           where the jobs' folders go (default runs/cells)
#   --set KEY=VALUE     a job setting for every job (repeatable), e.g. --set lr=0.5
#   --cohort            train each round's selected clients as one batched model (docs: DEVELOPERS.md)
#   --time-limit S      stop every job after S seconds (default: none); rerun to resume
#   --mps               on CUDA, start the CUDA MPS daemon if none runs (stopped again at the end), so that the
#                       jobs' small kernels run concurrently instead of taking turns on the GPU
#
# With DEVICE cuda and nvidia-smi present, OUT/EXP/gpu.txt gets the GPU's memory and utilisation every 30 s.
# Rehearse a command on the CPU first: `--scale smoke --device cpu` runs the same jobs in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }
exp=table2 scale=paper device=cuda out=runs/cells limit=0 cohort=() mps=0
command=(scripts/run_cells.sh)  # as given, less --out: the results file's command
skip=0
for arg in "$@"; do
  if [ "$skip" = 1 ]; then skip=0; elif [ "$arg" = --out ]; then skip=1; else command+=("$arg"); fi
done
sets=()
jobs=()
while [ $# -gt 0 ]; do
  case "$1" in
    --exp) exp=${2:?--exp NAME}; shift 2 ;;
    --scale) scale=${2:?--scale S}; shift 2 ;;
    --device) device=${2:?--device D}; shift 2 ;;
    --out) out=${2:?--out DIR}; shift 2 ;;
    --set) sets+=(--set "${2:?--set KEY=VALUE}"); shift 2 ;;
    --cohort) cohort=(--cohort); shift ;;
    --time-limit) limit=${2:?--time-limit SECONDS}; shift 2 ;;
    --mps) mps=1; shift ;;
    -h | --help) usage ;;
    -*) echo "scripts/run_cells.sh: unknown option $1 (--help)" >&2; exit 2 ;;
    *) jobs+=("$1"); shift ;;
  esac
done
[ ${#jobs[@]} -gt 0 ] || usage
case "$limit" in '' | *[!0-9]*) echo "--time-limit wants whole seconds, got $limit" >&2; exit 2 ;; esac

if [ -n "${PYTHON:-}" ]; then py=$PYTHON; elif [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
export PYTHONUNBUFFERED=1
mkdir -p "$out/$exp"

started_mps=0
watcher=""
if [ "$device" = cuda ]; then
  if [ "$mps" = 1 ]; then
    if nvidia-cuda-mps-control -d 2>/dev/null; then started_mps=1; fi  # fails when a daemon already runs: keep it
    if ! timeout 60 "$py" -c 'import torch; torch.zeros(1, device="cuda")' 2>/dev/null; then
      [ "$started_mps" = 1 ] && { echo quit | nvidia-cuda-mps-control || true; started_mps=0; }
      echo "CUDA does not answer through MPS: running without it" >&2
    fi
  fi
  if command -v nvidia-smi >/dev/null; then
    (while :; do
      echo "$(date -u +%T) $(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader)"
      sleep 30
    done >> "$out/$exp/gpu.txt") &
    watcher=$!
  fi
fi

pids=()
dirs=()
stop() {
  echo "stopping every job (each keeps its last finished round; rerun the command to resume)" >&2
  [ ${#pids[@]} -eq 0 ] || kill -INT "${pids[@]}" 2>/dev/null || true
}
trap stop INT TERM

for job in "${jobs[@]}"; do
  cell=${job%%:*}
  seed=${job#*:}
  [ "$seed" = "$job" ] && seed=0
  dir=$out/$exp/seed-$seed/$cell
  mkdir -p "$dir"
  # timeout forwards SIGINT to the job (and gives it back the default SIGINT handler a background job lacks);
  # a limit of 0 is no limit
  timeout -s INT -k 60 "$limit" "$py" scripts/reproduce.py "$exp" --scale "$scale" --seeds "$seed" \
    --only "$cell" --device "$device" --threads 1 --out "$dir" ${sets[@]+"${sets[@]}"} \
    ${cohort[@]+"${cohort[@]}"} >> "$dir/log.txt" 2>&1 &
  pids+=($!)
  dirs+=("$dir")
  echo "$cell seed $seed: pid $!, log $dir/log.txt"
done

rc=0
codes=()
for i in "${!pids[@]}"; do
  while :; do
    status=0
    wait "${pids[$i]}" || status=$?
    kill -0 "${pids[$i]}" 2>/dev/null || break  # still running: the wait was cut short by a signal
  done
  codes+=("$status")
  [ "$status" -eq 0 ] || rc=$status
done
trap - INT TERM
[ -z "$watcher" ] || kill "$watcher" 2>/dev/null || true
[ "$started_mps" = 0 ] || echo quit | nvidia-cuda-mps-control || true

for i in "${!dirs[@]}"; do
  dir=${dirs[$i]}
  cell=${dir##*/}
  metrics=$dir/$exp/$cell/metrics.jsonl
  rounds=0
  [ -f "$metrics" ] && rounds=$(wc -l < "$metrics")
  if [ -f "$dir/$exp/$cell/summary.json" ]; then
    state=done
  elif [ "${codes[$i]}" -eq 124 ] || [ "${codes[$i]}" -eq 130 ]; then
    state="stopped: rerun to resume"
  else
    state="failed (exit ${codes[$i]}): see $dir/log.txt"
  fi
  echo "${dir#"$out/$exp/"}: $rounds rounds, $state"
done

kept=()
for dir in "${dirs[@]}"; do
  [ -f "$dir/$exp/$exp.$scale.json" ] && kept+=("$dir/$exp/$exp.$scale.json")
done
if [ ${#kept[@]} -gt 0 ]; then
  "$py" -m fedmq.benchmarks.results_file merge --command "${command[*]}" "$out/$exp/$exp.$scale.json" "${kept[@]}" \
    && echo "results file: $out/$exp/$exp.$scale.json (${#kept[@]} of ${#dirs[@]} jobs)"
fi
exit "$rc"
