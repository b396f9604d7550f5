#!/usr/bin/env bash
# Issue 40's GPU measurements in one lease call (run from the repo root, after the wheel install
# the device README asks for): the hand-off's floor per design, the expect-write / expect-landed
# traces with the native hand-off on and off, and the bench's expect-write A/B. ~7 min on an H100.
# Writes into $OUT: handoff_log.txt (everything printed) and the probes' / bench's JSON.
set -uo pipefail
OUT="${OUT:-/tmp/ec-nixl-out}"
mkdir -p "$OUT"
export PYTHONPATH="/tmp/site:.${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
SIZE="${SIZE:-9.8M}"
T0=$(date +%s)
elapsed() { echo "[$(( $(date +%s) - T0 )) s]"; }

{
  echo "== ec-nixl hand-off measurements $(date -Is) on $(hostname)"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -2
  nproc
  # The native hand-off library: built here when a compiler is present, else the one carried in.
  if command -v c++ >/dev/null; then
    c++ -O2 -shared -fPIC -o ec_nixl/_handoff.so csrc/handoff.cpp -lpthread && echo "built ec_nixl/_handoff.so here"
  else
    echo "no c++ here: using the carried ec_nixl/_handoff.so ($(ls ec_nixl/_handoff*.so 2>&1))"
  fi
  "$PY" -c "from ec_nixl import handoff; lib, why = handoff.load_library(); print('native hand-off library:', 'loaded' if lib else why)"

  trace() {  # $1: label, rest: handoff_trace.py arguments
    local label=$1; shift
    echo; echo "$(elapsed) == handoff_trace $label: $*"
    timeout -k 5 90 "$PY" bench/probes/handoff_trace.py --device cuda --size "$SIZE" --n 100 "$@"
    echo "$(elapsed) exit code: $?"
  }
  for spin in 0 2; do
    trace "expect-write native" --write --spin-ms "$spin"
    trace "expect-write python" --write --python-push --spin-ms "$spin"
    trace "expect-landed native" --spin-ms "$spin"
    trace "expect-landed python" --python-push --spin-ms "$spin"
  done

  echo; echo "$(elapsed) == handoff_floor (designs' floors, publisher idle and busy)"
  timeout -k 5 150 "$PY" bench/probes/handoff_floor.py --device cuda --size "$SIZE" --spin-ms 2 \
      --json "$OUT/handoff_floor.json"
  echo "$(elapsed) exit code: $?"

  echo; echo "$(elapsed) == pytest: the native hand-off and the waiting requests, on VRAM"
  timeout -k 5 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_handoff.py tests/test_expected_items.py -rs 2>&1 | tail -15
  echo "$(elapsed) exit code: $?"

  for native in 1 0; do
    echo; echo "$(elapsed) == ec-nixl bench expect-write, EC_NIXL_NATIVE=$native"
    EC_NIXL_NATIVE=$native timeout -k 5 100 "$PY" -m ec_nixl.cli bench --device cuda --sizes 64K,"$SIZE" \
        --items 0 --paths expect-write,expect-landed,ours-write,raw-nixl-write,reference-copy \
        --budget-s 1 --repeats 40 --idle-s 3 --json "$OUT/bench_expect_native$native.json" --timeout 90
    echo "$(elapsed) exit code: $?"
  done
  ls -la "$OUT"
} 2>&1 | tee "$OUT/handoff_log.txt"
