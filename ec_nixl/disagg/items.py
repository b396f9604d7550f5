"""A chat body's media items as a cache-aware router needs them: ids it can look up, bodies that
carry only some items, and encoder answers mapped back to the whole body.

* **Content ids.** The engines key their caches by each item's identifier: the part's ``uuid``
  when it has one and the request sets no processor or media-io kwargs (vLLM then hashes the uuid
  with them, ``MultiModalProcessorInputs.get_mm_hashes``), else a hash of the item that only the
  engine can compute. ``with_content_ids`` gives every media part without a uuid one derived
  from its content (sha256 of its URL: a ``data:`` URL is the content itself; an ``http(s)`` URL
  stands for what it points at, as vllm-router's EPD stage assumes), so the router knows each
  item's identifier before any engine saw it. A request with such kwargs keeps its ids unknown
  (None): its items are routed as held nowhere.
* **Subsets.** ``subset_body`` is a body with only some media parts (one user message), for an
  encoder that is to encode only those; ``map_back`` rewrites its answer's ``item_indices`` to the
  positions in the whole body.
"""

from __future__ import annotations

import hashlib
from typing import Any, Optional

from ec_nixl.disagg.placeholders import media_parts

HASH_FACTORS = ("mm_processor_kwargs", "media_io_kwargs")
"""Body keys vLLM folds into an item's identifier along with its uuid."""


def _locator(part: dict[str, Any]) -> Optional[str]:
    """What identifies a media part's content (its URL or inline data), None if it has none."""
    kind = part.get("type")
    value = part.get(kind) if isinstance(kind, str) else None
    if isinstance(value, dict):
        value = value.get("url") if "url" in value else value.get("data")
    return f"{kind}:{value}" if isinstance(value, str) and value else None


def with_content_ids(body: dict[str, Any]) -> tuple[dict[str, Any], list[Optional[str]]]:
    """``body`` with a content-derived ``uuid`` on each media part that has none, and each part's
    identifier as the engines will key it (None where the router cannot know it). ``body`` is not
    changed, nor copied deeper than the lists that change."""
    parts = media_parts(body)
    if not parts:
        return body, []
    factors = any(body.get(k) for k in HASH_FACTORS)
    new: dict[int, dict[str, Any]] = {}
    ids: list[Optional[str]] = []
    for part in parts:
        uid = part.get("uuid") if isinstance(part, dict) else None
        if not isinstance(uid, str) or not uid:
            loc = _locator(part) if isinstance(part, dict) else None
            uid = hashlib.sha256(loc.encode()).hexdigest() if loc is not None else None
            if uid is not None:
                new[id(part)] = dict(part, uuid=uid)
        ids.append(None if factors else uid)
    if not new:
        return body, ids
    messages = [dict(m, content=[new.get(id(p), p) for p in m["content"]])
                if isinstance(m, dict) and isinstance(m.get("content"), list) else m for m in body["messages"]]
    return dict(body, messages=messages), ids


def subset_body(body: dict[str, Any], positions: list[int]) -> dict[str, Any]:
    """``body`` with one user message holding only the media parts at ``positions`` (prompt
    order): what an encoder needs to encode those items and nothing else."""
    parts = media_parts(body)
    return dict(body, messages=[{"role": "user", "content": [parts[i] for i in positions]}])


def map_back(params: Any, positions: list[int]) -> Any:
    """An encoder's ``ec_transfer_params`` for ``subset_body(body, positions)``, with each entry's
    ``item_indices`` turned into positions of ``body`` (entries are copied, never changed)."""
    if not isinstance(params, dict):
        return params
    out: dict[str, Any] = {}
    for h, entry in params.items():
        indices = entry.get("item_indices") if isinstance(entry, dict) else None
        if isinstance(indices, list):
            entry = dict(entry, item_indices=[positions[i] for i in indices
                                              if type(i) is int and 0 <= i < len(positions)])
        out[h] = entry
    return out
