"""What a consumer's scheduler knows of one request, and its first-sight decisions.

A request is seen once (``first_sight``): its ``ec_transfer_params`` are validated then, and each
feature still to be computed is decided remote, local or failed (``decide``). A preempted request
that comes back with fewer computed tokens has the features in between decided again. The Holds,
answers and loads that follow are the scheduler's (``scheduler.SchedulerSide``); this module holds
no engine state beyond the request's own record, so it reads without vLLM's scheduler in mind.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Optional

from ec_nixl.metrics import Metrics
from ec_nixl.params import parse_expect
from ec_nixl.queries import HoldRequest
from ec_nixl.vllm.features import FeatureFacts
from ec_nixl.vllm.metadata import RemoteItem, parse_params

logger = logging.getLogger("ec_nixl.vllm")

OUTCOME_KEY = "ec_nixl_consumer"
"""Key of a consumer's answer ``ec_transfer_params``: {"loaded": [...], "local": [...]} mm hashes."""


@dataclass
class Item:
    remote: RemoteItem
    has_media: bool
    offset_end: int  # placeholder offset + length: consumed once num_computed_tokens passes it
    status: str = "holding"  # holding | ready | local | failed
    early: bool = False  # admitted before its Hold answered (ready with a provisional place until then)
    loaded: bool = False  # handed to the workers as a load (vLLM did not have it cached)
    hold: Optional[HoldRequest] = None
    next_try: float = 0.0
    detail: str = ""


@dataclass
class Admission:
    req_id: str
    items: dict[str, Item]
    floor: int = 0
    """Features whose placeholder ends at or below this many computed tokens are not decided yet
    (the request had them computed when first seen)."""
    remote: dict[str, RemoteItem] = field(default_factory=dict)  # every valid item of its params
    expected: set[str] = field(default_factory=set)  # of remote: not encoded yet (ec_nixl_expect): Holds wait
    errors: dict[str, str] = field(default_factory=dict)  # per-item problems with its params
    t0: float = field(default_factory=time.monotonic)
    failed: str = ""
    deferred_step: int = -1  # the step whose metadata carried this request's prefetches
    first_step: int = 0  # the scheduling step that first saw it (the admission phases count from here)
    t_first: float = field(default_factory=time.monotonic)
    admitted: bool = False


def feature_end(feature) -> int:
    """Placeholder offset + length: the feature is consumed once num_computed_tokens reaches it."""
    return feature.mm_position.offset + feature.mm_position.length


def outcome(adm: Optional[Admission]) -> Optional[dict]:
    """Consumer: which announced items were loaded and which encoded here (the answer's
    ``ec_transfer_params``, non-streamed answers only; for clients, proxies and tests)."""
    if adm is None or not adm.items:
        return None
    items = adm.items.items()
    return {OUTCOME_KEY: {"loaded": sorted(h for h, it in items if it.loaded and it.status == "ready"),
                          "local": sorted(h for h, it in items if it.status == "local")}}


def _expect(adm: Admission, request, params, num_computed_tokens: int, facts: FeatureFacts) -> None:
    """``ec_nixl_expect``: the request reached us while its encoder still runs at the named
    producer. Each of its items not announced otherwise is expected there under its own
    identifier, with the shape this model gives it (rows from the placeholder, width and dtype as
    a producer of this model publishes them); the producer's answer is checked against that like
    any announcement."""
    producer, why = parse_expect(params)
    if why:
        adm.errors.setdefault("*", why)
        return
    if producer is None:
        return
    for f in request.mm_features:
        h = f.identifier
        if h in adm.remote or h in adm.errors or feature_end(f) <= num_computed_tokens:
            continue
        desc = facts.describe(f)
        if desc is not None:
            adm.remote[h] = RemoteItem(desc, producer)
            adm.expected.add(h)


def first_sight(request, num_computed_tokens: int, step: int, facts: FeatureFacts, local_fallback: bool,
                users: dict[str, set[str]], metrics: Metrics) -> Admission:
    """Validate a request's params once and decide what is remote, local or failed.

    A feature that carries no media (a metadata-only placeholder) and has no valid remote item
    cannot be encoded here: its request fails now, with the reason, instead of crashing the engine
    in the encoder later. ``users`` (mm_hash -> request ids) gains this request's remote items.
    """
    rid = request.request_id
    adm = Admission(rid, {}, floor=num_computed_tokens, first_step=step)
    params = getattr(request, "ec_transfer_params", None)
    if params:
        expected = {f.identifier: f.mm_position.get_num_embeds() for f in request.mm_features}
        adm.remote, adm.errors = parse_params(params, expected, facts.dtype)
        _expect(adm, request, params, num_computed_tokens, facts)
        if adm.expected:
            metrics.count("expected_items", len(adm.expected))
    by_id = {f.identifier: f for f in request.mm_features if feature_end(f) > num_computed_tokens}
    for h, why in adm.errors.items():
        f = by_id.get(h)
        msg = f"request {rid}: bad ec_transfer_params for item {h}: {why}"
        if f is not None and facts.has_media(f) and local_fallback:
            logger.warning("%s; encoding it locally", msg)
            metrics.count("local_fallbacks")
        else:
            logger.warning("%s", msg)
    decide(adm, request, num_computed_tokens, None, facts, users)
    return adm


def decide(adm: Admission, request, lo: int, hi: Optional[int], facts: FeatureFacts,
           users: dict[str, set[str]]) -> None:
    """Decide the features whose placeholder ends in (lo, hi]: remote, local or failed
    (``adm.failed`` says why)."""
    rid, added = adm.req_id, False
    for f in request.mm_features:
        end = feature_end(f)
        if end <= lo or (hi is not None and end > hi):
            continue  # already computed, or decided before
        h = f.identifier
        remote = adm.remote.get(h)
        if remote is not None:
            if h not in adm.items:
                adm.items[h] = Item(remote, facts.has_media(f), end)
                users.setdefault(h, set()).add(rid)
                added = True
        elif not facts.has_media(f):
            why = adm.errors.get(h) or adm.errors.get("*") or "no ec_transfer_params for it"
            adm.failed = (f"request {rid}: item {h} carries no media to encode here and "
                          f"cannot be loaded ({why})")
            logger.error("%s; failing the request", adm.failed)
            break
    adm.floor = lo
    if added and hi is not None:
        adm.t0 = time.monotonic()  # the admission deadline runs for the new items from now
