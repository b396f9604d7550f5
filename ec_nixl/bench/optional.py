"""Optional dependencies of the bench, each behind one import that never raises.

``pip install ec-nixl`` without the ``bench`` extra has none of safetensors (the ``file`` path),
matplotlib (``--plot``), tqdm (the progress bar), ucxx (the ``ucx`` path) or psutil (the idle
case reads /proc instead). A part that needs a missing one is skipped with the one-line reason
:func:`load` returns, and the main job still runs: a bare install must never crash on what it
does not have. (cupy is not the bench's: the VRAM pool falls back without it, see arena.py.)
"""

from __future__ import annotations

import importlib
from typing import Any, Optional

# module to import -> the pip requirement that provides it
_PROVIDERS = {
    "safetensors.torch": "safetensors",
    "matplotlib": "matplotlib",
    "tqdm": "tqdm",
    "ucxx": "ucxx",
    "psutil": "psutil",
}


def load(module: str) -> tuple[Optional[Any], str]:
    """``(module, "")`` or ``(None, why)``; ``why`` names what to install."""
    try:
        return importlib.import_module(module), ""
    except Exception as e:  # ImportError, or a broken install raising anything at import
        pkg = _PROVIDERS.get(module, module.split(".")[0])
        hint = "pip install 'ec-nixl[bench]'" if pkg != "ucxx" else "install ucxx for this CUDA version"
        kind = "not installed" if isinstance(e, ImportError) else f"import failed ({type(e).__name__}: {e})"
        return None, f"{pkg} {kind} ({hint})"
