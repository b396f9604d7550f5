"""Tensors as items: dtype names on the wire, item descriptions, and fences.

Small helpers shared by both sides of an endpoint; no state, no I/O.
"""

from __future__ import annotations

import torch

from ec_nixl import protocol as P
from ec_nixl.errors import ProtocolError
from ec_nixl.pool import Fence

_TORCH_DTYPES = {name: getattr(torch, name) for name in P.DTYPE_SIZES if hasattr(torch, name)}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise ProtocolError(f"unsupported dtype {name!r}") from None


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in P.DTYPE_SIZES:
        raise ProtocolError(f"unsupported dtype {dtype} (known: {sorted(P.DTYPE_SIZES)})")
    return name


def describe(mm_hash: str, t: torch.Tensor) -> P.ItemDesc:
    return P.ItemDesc(mm_hash=mm_hash, shape=list(t.shape), dtype=dtype_name(t.dtype),
                      nbytes=t.numel() * t.element_size())


class Ready:
    """A host-side readiness flag usable as a fence (``query()``); for producers without CUDA."""

    def __init__(self, done: bool = False):
        self._done = done

    def set(self) -> None:
        self._done = True

    def query(self) -> bool:
        return self._done


class Both:
    """A fence that completes when both fences have."""

    def __init__(self, a: Fence, b: Fence):
        self.a, self.b = a, b

    def query(self) -> bool:
        return self.a.query() and self.b.query()
