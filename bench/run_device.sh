#!/usr/bin/env bash
# ec-nixl benchmarks on the H200 machine. Run from the repo root:  bash bench/run_device.sh
# Assumes the wrapper already did: pip install --no-index --no-deps --target /tmp/site .whl/*.whl
# Writes into $OUT: bench_gpu.json, bench_gpu.png (if matplotlib), micro_gpu.json, bench_cpu.json,
# bench_log.txt (everything printed). Expected ~4 min on one H200; hard-bounded at ~9 min by the
# timeouts below (a bench that hits its --timeout still prints and writes what it measured).
set -uo pipefail
OUT="${OUT:-/tmp/ec-nixl-out}"
mkdir -p "$OUT"
export PYTHONPATH="/tmp/site:.${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
LOG="$OUT/bench_log.txt"
PY="${PYTHON:-python}"
T0=$(date +%s)
elapsed() { echo "[$(( $(date +%s) - T0 )) s]"; }

{
  echo "== ec-nixl device benchmarks $(date -Is) on $(hostname)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 | head -4
  "$PY" -V
  "$PY" - <<'PYEOF' 2>&1
import importlib
for m in ("torch", "nixl", "cupy", "tqdm", "matplotlib", "safetensors", "pytest_benchmark", "ucxx"):
    try:
        mod = importlib.import_module(m)
        print(f"  {m}: {getattr(mod, '__version__', 'ok')}")
    except Exception as e:
        print(f"  {m}: not importable ({type(e).__name__})")
import torch
print("  cuda:", torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
PYEOF
  echo "PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-} UCX_TLS=${UCX_TLS:-}"

  # 1. The end-to-end benchmark on VRAM, every path (raw-nixl-read/-write are the plain-NIXL
  #    floor; their agents get CUDA_IPC_ENABLE_GET_ZCOPY=y unless UCX_CUDA_IPC_ENABLE_GET_ZCOPY is
  #    set), then the idle-cost window (10 s). Slow paths (a READ without zero-copy GET is
  #    TCP-emulated on this box: ~150 ms for 64 MiB) get fewer repeats through the per-case
  #    budget: repeats adapt between 5 and 40 to ~1.5 s per case.
  echo; echo "$(elapsed) == ec-nixl bench --device cuda"
  timeout -k 10 270 "$PY" -m ec_nixl.cli bench --device cuda --budget-s 1.5 --repeats 40 --min-repeats 5 \
      --json "$OUT/bench_gpu.json" --plot "$OUT/bench_gpu.png" --timeout 250
  rc=$?; echo "$(elapsed) bench (cuda) exit code: $rc"  # $? before $(...) resets it

  # 2. The CPU goals (16 MiB across processes vs memcpy, idle cost) on a host with cores to spare.
  echo; echo "$(elapsed) == ec-nixl bench --device cpu (CPU goal sizes only)"
  timeout -k 10 90 "$PY" -m ec_nixl.cli bench --device cpu --sizes 64K,1M,9.8M,16M --items 0 \
      --paths ours-read,ours-write,raw-nixl-read,raw-nixl-write,reference-copy --budget-s 1 --repeats 40 \
      --json "$OUT/bench_cpu.json" --timeout 80
  rc=$?; echo "$(elapsed) bench (cpu) exit code: $rc"

  # 3. The micro-benchmark suite (CPU and CUDA parameters).
  echo; echo "$(elapsed) == pytest bench/"
  timeout -k 10 140 "$PY" -m pytest bench/ -q -p no:cacheprovider --benchmark-json "$OUT/micro_gpu.json" \
      --benchmark-max-time 0.5
  rc=$?; echo "$(elapsed) pytest exit code: $rc"
  ls -la "$OUT"
} 2>&1 | tee "$LOG"
