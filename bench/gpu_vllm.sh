#!/usr/bin/env bash
# Real vLLM on a GPU host, NixlECConnector with VRAM pools: the end-to-end check, the load race,
# and the serving benchmark. Any GPU host with vLLM and ec-nixl importable (here: the repo root on
# PYTHONPATH, or `pip install -e .`); on the lent GPU, after ../shared/tools/gpu-vllm's chunks:
#   bash .vw/assemble.sh && export PYTHONPATH=/tmp/vsite:/tmp/site:. && bash bench/gpu_vllm.sh e2e
#
#   bash bench/gpu_vllm.sh e2e          ec-nixl bench e2e (tiny Qwen2-VL: colocated vs E -> PD, 22 requests,
#                                       the PD's vision tower corrupted), then the race rows of
#                                       scripts/check_guards.py against it: WRITE, WRITE with E's posts
#                                       50 ms late (only where the plain row is not caught), READ; each
#                                       in what is left of CALL_S=590 s (~5 min + ~2 min a row on an H100)
#   bash bench/gpu_vllm.sh micro        ec-nixl bench of one 9.8 MB item on this GPU (what serve's PD load compares with)
#   bash bench/gpu_vllm.sh serve TAG    ec-nixl bench serve, Qwen2.5-VL-7B's shapes (dummy weights), 1024x1024
#                                       images: colocated, ECExample (its files on this host's disk), NixlEC
#                                       standard flow; concurrency 1,4,8 x 1,2 images; one round (~7 min);
#                                       run it again with another TAG for more rounds, then merge them:
#                                       ec-nixl bench serve --merge serve_*.json
# Everything goes to $OUT (default /tmp/ec-nixl-out): e2e.json, e2e_log.txt, race_log.txt,
# race_ROW.json, micro.json, micro_log.txt, serve_TAG.json, serve_TAG_log.txt. DEPLOYMENTS,
# CONCURRENCY, IMAGES (a short lease: CONCURRENCY=1 alone), PROMPTS, POOL_MB and SERVE_TIMEOUT change
# serve's; E2E_EAGER, CALL_S, RACE_ONLY (the rows alone), RACE_DELAYED_ONLY (the delayed WRITE row
# alone), RACE_DELAY_MS and RACE_TIMEOUT change e2e's.
set -uo pipefail
OUT=${OUT:-/tmp/ec-nixl-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# The checkout by its absolute path first, so that every vLLM process runs its code (and its native
# hand-off, built below) whatever its working directory.
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
# vLLM 0.26 runs every EC instance on its V1 model runner: the colocated reference too (the same
# kernels, so greedy tokens can be equal). FlashInfer's sampler kernels are not carried to the lent GPU.
export VLLM_USE_V2_MODEL_RUNNER=${VLLM_USE_V2_MODEL_RUNNER:-0} VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
# Encoders load the vision tower only and keep no prefix cache (they have no KV cache): vLLM 0.26
# asks for both (its ECExample encoder fails at start with prefix caching on); 0.32+ does it itself.
E_ARGS="--mm-encoder-only --no-enable-prefix-caching"
# The race rows' settings (bench e2e's GPU defaults, eager: no compile, no graphs to capture); the
# e2e itself too with E2E_EAGER=1 (a minute sooner; its answers are then the rows' exact reference).
# The image limit in vLLM's dotted form: these args are shlex-split twice on the way to a race row's
# servers (EC_NIXL_E2E_ARGS, then --vllm-args), which strips a JSON value's quotes.
EAGER_ARGS='--max-model-len 2048 --max-num-seqs 8 --dtype bfloat16 --enforce-eager --limit-mm-per-prompt.image 4 --limit-mm-per-prompt.video 0'

# The plugin's entry point, so that every vLLM process loads it (bench serve's request traces come
# with it): where it is not installed, the package (metadata and a copy) goes to /tmp/ecsite, AFTER
# the checkout on the path, so the checkout's code is what runs.
if ! "$PY" -c "import sys; from importlib.metadata import entry_points as e; sys.exit(not any(p.value.startswith('ec_nixl.vllm') for p in e(group='vllm.general_plugins')))" 2>/dev/null; then
  EC_NIXL_NO_EXT=1 timeout 120 "$PY" -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/ecsite . \
      >/tmp/ecsite.log 2>&1 && export PYTHONPATH="${PYTHONPATH:-}:/tmp/ecsite" || echo "plugin not installed (see /tmp/ecsite.log): no request traces"
fi

# The native hand-off (E answers and pushes off the GIL while its engine encodes): a few seconds to
# build where a compiler is; else E runs the Python fallback, and `info` says which ran. (The pack
# kernel's torch extension needs nvcc and minutes: the Python pack stands in; its copies are few.)
if ! ls ec_nixl/_handoff*.so >/dev/null 2>&1 && command -v c++ >/dev/null; then
  c++ -O2 -shared -fPIC -o ec_nixl/_handoff.so csrc/handoff.cpp -lpthread 2>/tmp/handoff_build.log ||
    echo "native hand-off not built (/tmp/handoff_build.log): Python fallback"
fi

info() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -2
  "$PY" -c "import vllm, torch, nixl; print('vllm', vllm.__version__, '| torch', torch.__version__, '| cuda', torch.cuda.is_available())" 2>&1 | tail -1
  "$PY" -c "from ec_nixl import handoff, native; lib, why = handoff.load_library(); print('native hand-off:', 'loaded' if lib else why, '| pack:', native.IMPL)" 2>&1 | tail -1
  df -T /tmp | tail -1
}

case "${1:-e2e}" in
e2e)
  info
  el "ec-nixl bench e2e ($([ -n "${E2E_EAGER:-}" ] && echo "eager: E2E_EAGER" || echo "CUDA graphs on"))"
  [ "${RACE_ONLY:-0}" = 1 ] && el "(RACE_ONLY=1: the race rows alone, against an earlier e2e as their baseline)" ||
  timeout -k 10 330 "$PY" -m ec_nixl.cli bench e2e --out /tmp/e2e --json "$OUT/e2e.json" \
      --encoder-vllm-args="$E_ARGS" ${E2E_EAGER:+--vllm-args="$EAGER_ARGS"} 2>&1 | tee "$OUT/e2e_log.txt"
  rc=${PIPESTATUS[0]}
  el "exit $rc"
  [ -f "$OUT/e2e.json" ] && cp "$OUT/e2e.json" /tmp/e2e/reference.json  # (a later RACE_ONLY=1 call's $OUT is empty)
  # The race rows: each runs the same check against a copy whose load barrier is broken (eager, to
  # save the compile), with the run above as baseline and reference: its colocated answers and model
  # (--reference: no colocated server per row). A row is caught only by wrong answers (the test
  # asserts token identity alone); race_ROW.json says how many differed and how many failed.
  [ "$rc" -eq 0 ] || [ "${RACE_ONLY:-0}" = 1 ] || { el "race rows not run: the unbroken e2e did not pass"; exit "$rc"; }
  race_row() {  # FILTER TAG [extra bench e2e args]: one row of scripts/check_guards.py, in what is left of CALL_S
    local budget=$(( ${CALL_S:-590} - ($(date +%s) - T0) ))
    [ "$budget" -ge 100 ] || { el "race row $2 not run: ${budget} s left of this call"; return 3; }
    el "check_guards --marker gpu -k $1 ($2)"
    # Without an earlier e2e here (RACE_ONLY=1 on a fresh machine) the row builds its own tiny model
    # and starts its own colocated server: a minute more, the same check.
    # (A cold first row on a fresh H100, with its own colocated server, took over 200 s; 144 s warm.)
    local ref="" tmo=${RACE_TIMEOUT:-320}
    [ -f /tmp/e2e/reference.json ] && ref="--model /tmp/e2e/tiny-vl --reference /tmp/e2e/reference.json" tmo=${RACE_TIMEOUT:-200}
    EC_NIXL_E2E_ARGS="$ref --encoder-vllm-args='$E_ARGS' --vllm-args='$EAGER_ARGS' --extra-config '{\"announce_lease_s\": 5}' ${3:-}" \
    EC_NIXL_E2E_REPORT="$OUT/race_$2.json" \
      timeout -k 10 $(( budget < tmo ? budget : tmo )) "$PY" scripts/check_guards.py \
        --marker gpu -k "$1" --no-baseline --timeout $(( tmo - 20 )) 2>&1 | tee -a "$OUT/race_log.txt"
    local r=${PIPESTATUS[0]}
    "$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); q=d['requests']
print(f'  {sys.argv[2]}: {sum(not r[\"equal\"] and not r[\"error\"] for r in q)} of {len(q)} answers differ, {sum(bool(r[\"error\"]) for r in q)} failed; delay_push_ms {d[\"info\"].get(\"delay_push_ms\")}')" \
      "$OUT/race_$2.json" "$2" 2>/dev/null || echo "  $2: no report"
    el "exit $r"
    return "$r"
  }
  # WRITE (the mode of a shared GPU): landed when the push is asked for. If the tiny model's WRITE
  # lands before vLLM's gather reads anyway, the row runs again with E posting each WRITE 50 ms late.
  # RACE_DELAYED_ONLY=1: the delayed WRITE row alone (a short lease: the one row sure to decide).
  DELAYED="--delay-push-ms ${RACE_DELAY_MS:-50} --extra-config '{\"native_handoff\": false}'"
  if [ -n "${RACE_DELAYED_ONLY:-}" ]; then race_row race-write write-delayed "$DELAYED"; exit; fi
  race_row race-write write || race_row race-write write-delayed "$DELAYED"
  race_row race-read read
  ;;
serve)
  TAG=${2:-r0}
  info
  el "ec-nixl bench serve $TAG"
  timeout -k 10 ${SERVE_TIMEOUT:-560} "$PY" -m ec_nixl.cli bench serve --out "/tmp/serve-$TAG" --model-shape qwen2.5-vl-7b \
      --deployments ${DEPLOYMENTS:-colocated,example,nixl-seq} --reference ${REFERENCE:-example} --rounds 1 \
      --concurrency ${CONCURRENCY:-1,4,8} --images ${IMAGES:-1,2} --prompts ${PROMPTS:-16} --image-sizes 1024x1024 --input-len 32 --output-len 16 \
      --vllm-args "--max-model-len 4096 --max-num-seqs 16 --max-num-batched-tokens 8192 --enforce-eager --dtype bfloat16 --limit-mm-per-prompt {\"image\":2,\"video\":0}" \
      --colocated-vllm-args "--gpu-memory-utilization 0.85" \
      --encoder-vllm-args "--gpu-memory-utilization 0.15 $E_ARGS" --pd-vllm-args "--gpu-memory-utilization 0.7" \
      --pool-mb ${POOL_MB:-1024} --port 18000 --json "$OUT/serve_$TAG.json" 2>&1 | tee "$OUT/serve_${TAG}_log.txt"
  el "exit ${PIPESTATUS[0]}"
  ;;
micro)
  # ec-nixl bench on this GPU, one 9.8 MB item (a 1024x1024 image on Qwen2.5-VL-7B): what the PD's
  # load inside vLLM (serve's "PD xfer") is compared with
  info
  el "ec-nixl bench --sizes 9.8M"
  timeout -k 10 ${MICRO_TIMEOUT:-120} "$PY" -m ec_nixl.cli bench --sizes 9.8M --items 0 --paths ours-read,ours-write,raw-nixl-read,raw-nixl-write \
      --idle-s 0 --budget-s 1 --json "$OUT/micro.json" 2>&1 | tee "$OUT/micro_log.txt"
  el "exit ${PIPESTATUS[0]}"
  ;;
*)
  echo "usage: bash bench/gpu_vllm.sh {e2e|serve TAG|micro}" >&2
  exit 2
  ;;
esac
