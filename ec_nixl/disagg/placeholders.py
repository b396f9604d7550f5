"""Metadata-only PD requests: the media the encoder reported, replaced by placeholders.

This is what vllm-router's EPD stage sends a PD (``shared/design/routers.md``): each media part
the encoder's answer describes becomes ``{"type": "<modality>_embeds", "<modality>_embeds":
<the entry's metadata>, "uuid": <its mm_hash>}``, so the PD neither fetches, decodes nor
preprocesses the media, and its item identifier is the encoder's mm_hash. The price: a load that
fails cannot be covered by a local encode (there is nothing to encode), so the request fails.

Unlike the router, a body is rewritten whole or not at all: when any media part has no entry
with metadata (vLLM's ``collect_ec_item_metadata`` leaves it empty for an item whose processed
data the encoder no longer had, e.g. an encoder-cache hit), every part keeps its media, since
vLLM refuses a request that mixes raw media and embeddings of one modality.
"""

from __future__ import annotations

from typing import Any, Optional

TEXT_PART_TYPES = ("text", "input_text")
MEDIA_MODALITY = {"image_url": "image", "video_url": "video", "audio_url": "audio", "input_audio": "audio"}
"""Chat content part type -> vLLM modality (its placeholder part type is ``<modality>_embeds``)."""


def media_parts(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat body's non-text content parts in prompt order (vLLM's ``mm_features`` order); none
    for a body without a ``messages`` list."""
    messages = body.get("messages")
    out: list[dict[str, Any]] = []
    for m in messages if isinstance(messages, list) else []:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            out.extend(p for p in content if not (isinstance(p, dict) and p.get("type") in TEXT_PART_TYPES))
    return out


def hashes_by_position(encoder_params: Any, n: int) -> dict[int, str]:
    """Position -> mm_hash, from the ``item_indices`` of the encoder's ``ec_transfer_params``."""
    out: dict[int, str] = {}
    if isinstance(encoder_params, dict):
        for mm_hash, entry in encoder_params.items():
            indices = entry.get("item_indices") if isinstance(entry, dict) else None
            for i in indices if isinstance(indices, list) else []:
                if type(i) is int and 0 <= i < n:
                    out[i] = mm_hash
    return out


def placeholder_body(body: dict[str, Any], encoder_params: Any) -> Optional[dict[str, Any]]:
    """``body`` with every media part replaced by its placeholder (see the module docstring), or
    None when that cannot be done for every part (the caller then sends the media). ``body`` is
    not changed, nor copied deeper than the lists that change (its media may be megabytes)."""
    parts = media_parts(body)
    if not parts or not isinstance(encoder_params, dict):
        return None
    hashes = hashes_by_position(encoder_params, len(parts))
    new: dict[int, dict[str, Any]] = {}  # id(part) -> its placeholder
    for i, part in enumerate(parts):
        modality = MEDIA_MODALITY.get(part.get("type")) if isinstance(part, dict) else None
        meta = (encoder_params.get(hashes[i]) or {}).get("metadata") if i in hashes else None
        if modality is None or not isinstance(meta, dict) or not meta:
            return None
        new[id(part)] = {"type": f"{modality}_embeds", f"{modality}_embeds": meta, "uuid": hashes[i]}
    messages = [dict(m, content=[new.get(id(p), p) for p in m["content"]])
                if isinstance(m, dict) and isinstance(m.get("content"), list) else m
                for m in body["messages"]]
    return dict(body, messages=messages)
