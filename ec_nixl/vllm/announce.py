"""The producer's side of the scheduler delegate: what a finished request announces.

``request_finished`` of an encoder returns ``ec_transfer_params`` naming each of the request's
items (shape, dtype, bytes, producer address, vLLM's own placeholder metadata) and returns False
(delay-free would leak the request). Items the request's own step encoded were published in that
step; an encoder-cache hit is published again with the next step's metadata, since it may have
been read and freed since.
"""

from __future__ import annotations

import logging
from typing import Optional

from ec_nixl.vllm.features import FeatureFacts
from ec_nixl.vllm.metadata import build_params
from ec_nixl.vllm.options import NixlECOptions, Placement

logger = logging.getLogger("ec_nixl.vllm")


class Announcer:
    """Items encoded per request, the announcement, and what to publish again."""

    def __init__(self, facts: FeatureFacts, opts: NixlECOptions, place: Placement):
        self.facts, self.opts, self.place = facts, opts, place
        self._publish: list[str] = []
        self._encoded_for: dict[str, set[str]] = {}  # request id -> items encoded (so published) for it

    def encoded(self, req_id: str, mm_hash: str) -> None:
        """The item is computed here in this step (an ec_both engine does not re-serve loads)."""
        self._publish.append(mm_hash)
        self._encoded_for.setdefault(req_id, set()).add(mm_hash)

    def take_publish(self) -> list[str]:
        """What the workers publish (or publish again) with this step's metadata."""
        out, self._publish = self._publish, []
        return out

    def finished(self, request, loaded_here: set[str]) -> Optional[dict]:
        """The ``ec_transfer_params`` of a finished request (None: nothing to announce)."""
        encoded_here = self._encoded_for.pop(request.request_id, set())
        if not self.place.is_producer or not request.mm_features:
            return None
        items = {}
        for f in request.mm_features:
            if f.identifier in loaded_here:
                continue  # ec_both announces what it encoded, not what it loaded
            desc = self.facts.describe(f)
            if desc is None:
                continue
            items[f.identifier] = desc
            if f.identifier not in encoded_here:
                # An encoder-cache hit: published for an earlier request and maybe freed since.
                # Not what this request's own step published: a consumer that asked before we
                # finished (the overlapped flow) may have read and freed it already, and a copy
                # published again would wait, unread, for its lease to end.
                self._publish.append(f.identifier)
        if not items:
            return None
        base = None
        try:
            from vllm.distributed.ec_transfer.ec_connector.utils import collect_ec_item_metadata

            base = collect_ec_item_metadata(request.mm_features, self.facts.resolver())  # item_indices count every item
        except Exception as e:  # metadata for metadata-only consumers is optional
            logger.debug("collect_ec_item_metadata unavailable: %s", e)
        host = self.opts.advertise_host or self.place.ip
        return build_params(items, f"{host}:{self.place.producer_port}", base)
