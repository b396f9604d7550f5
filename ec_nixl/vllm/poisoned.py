"""Encoder-cache entries that hold a failed load's zero placeholder, until vLLM drops them.

When a metadata-only item cannot land after its step was scheduled, the worker gives vLLM's
gather a zero placeholder under the item's hash and the request fails. vLLM's encoder cache keeps
that entry for reuse, and its scheduler serves any later request of the same image from it
without asking the connector: a wrong answer, silently (the same for a request scheduled in that
very step that shared the item). This module remembers those hashes on the PD's scheduler until
vLLM frees them (``free_encoder_mm_hashes``) and decides, for each request that uses one:

* a request that may already have gathered the placeholder (scheduled while the load was in
  flight, and computed past the item's first placeholder token by the time the failure came back)
  fails, naming the item;
* one that has not yet, and carries the item's media, has it encoded again in its step (added to
  the step's ``scheduled_encoder_inputs``; the workers drop the entry first, since Model Runner V2
  encodes only what its cache lacks): the entry is right again from that step on;
* one that has not yet, without media (a router's placeholders), waits while another request's
  re-encode of the item is queued, and otherwise fails before any step gathers it.

vLLM 0.26 has no metadata-only items and encodes a failed load with media in the same step, so no
entry is ever poisoned there.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from ec_nixl.vllm.admission import feature_end

logger = logging.getLogger("ec_nixl.vllm")

_WATCH_STEPS = 64
"""Steps a load's outcome is waited for (its report comes the next step, or two with async scheduling)."""


class PoisonedEntries:
    def __init__(self, has_media: Callable[[Any], bool], may_encode: bool):
        self._has_media = has_media
        self._may_encode = may_encode  # fallback "auto": the PD may encode an item itself
        self._live: dict[str, Any] = {}  # request id -> the request vLLM asked about, until it finished
        self._users: dict[str, set[str]] = {}  # mm_hash -> ids of the live requests with that item
        self._why: dict[str, str] = {}  # mm_hash -> why its entry is a placeholder
        self._reencode: dict[str, dict[str, int]] = {}  # mm_hash -> {request id: item index} that may encode it
        # mm_hash in flight -> (the scheduler step its watch began, the requests that may gather it meanwhile)
        self._watch: dict[str, tuple[int, dict[str, Any]]] = {}

    def __bool__(self) -> bool:
        return bool(self._why)

    # ---------------------------------------------------------------- the scheduler's hooks

    def admits(self, request, num_computed_tokens: int, unavailable: set[str]) -> bool:
        """``ensure_cache_available``: False holds ``request`` back this step (``check``: "wait"),
        or for good, its id added to ``unavailable`` ("fail")."""
        if request.request_id not in self._live:
            self._live[request.request_id] = request
            for f in request.mm_features or ():
                self._users.setdefault(f.identifier, set()).add(request.request_id)
        verdict = self.check(request, num_computed_tokens) if self._why else "go"
        if verdict == "fail":
            unavailable.add(request.request_id)
        return verdict == "go"

    def before_step(self, scheduler_output, loading, step: int) -> list[str]:
        """``build_connector_meta`` of scheduler step ``step``: the hashes the workers drop before
        that step."""
        self.freed(getattr(scheduler_output, "free_encoder_mm_hashes", None))
        self.loading(loading, step)
        return self.step(scheduler_output) if self._why else []

    def reported(self, m) -> set[str]:
        """``update_connector_output``: the requests that must fail with a failed load."""
        doomed = set()
        for _, rid, h, why in m.failed:
            doomed |= self.failed(h, why, rid)
        for h in {h for _, h in m.loaded} | {h for _, _, h, _ in m.rerouted}:
            self.landed(h)
        return doomed

    def finished(self, req_id: str) -> None:
        req = self._live.pop(req_id, None)
        if req is not None:
            for f in req.mm_features or ():
                users = self._users.get(f.identifier)
                if users is not None:
                    users.discard(req_id)
                    if not users:
                        del self._users[f.identifier]
            self.forget(req_id)

    # ---------------------------------------------------------------- the rules

    def loading(self, hashes, step: int) -> None:
        """Each step, for the items loading (this step's and those not reported yet): note the
        live requests that need them and may gather them before their outcome is known. A load
        is reported the step after its own; one never reported (its entry was already there) is
        let go after ``_WATCH_STEPS``."""
        for h in hashes:
            self._watch.setdefault(h, (step, {}))
        for h, (since, watch) in list(self._watch.items()):
            if step - since > _WATCH_STEPS:
                del self._watch[h]
                continue
            for rid in self._users.get(h, ()):
                req = self._live[rid]
                if rid not in watch and any(f.identifier == h and req.num_computed_tokens < feature_end(f)
                                            for f in req.mm_features or ()):
                    watch[rid] = req

    def landed(self, h: str) -> None:
        self._watch.pop(h, None)

    def failed(self, h: str, why: str, failed_req: str) -> set[str]:
        """The load of ``h`` failed (the workers' report): its entry is poisoned. Returns the
        other requests that must fail with it: those that may have gathered the placeholder."""
        self._why.setdefault(h, why)
        doomed = set()
        for rid, req in self._watch.pop(h, (0, {}))[1].items():
            if rid != failed_req and any(f.identifier == h and req.num_computed_tokens > f.mm_position.offset
                                         for f in req.mm_features or ()):
                logger.error("request %s fails: it used encoder output %s, whose load for request %s failed (%s)",
                             rid, h, failed_req, why)
                doomed.add(rid)
        return doomed

    def check(self, request, num_computed_tokens: int) -> str:
        """What ``request`` may do this step: "go" (nothing poisoned it needs, or its own media
        is queued to encode the entry in its step), "wait" (another request's encode of the entry
        is queued) or "fail" (nothing can make the entry right for it)."""
        verdict = "go"
        for i, f in enumerate(request.mm_features or ()):
            why = self._why.get(f.identifier)
            if why is None or feature_end(f) <= num_computed_tokens:
                continue
            if self._may_encode and self._has_media(f):
                self._reencode.setdefault(f.identifier, {}).setdefault(request.request_id, i)
            elif self._reencode.get(f.identifier):
                verdict = "wait"
            else:
                logger.error("request %s fails: encoder output %s in this engine's encoder cache is the placeholder "
                             "of a load that failed (%s), and the request carries no media to encode it again",
                             request.request_id, f.identifier, why)
                return "fail"
        return verdict

    def step(self, scheduler_output) -> list[str]:
        """Queue this step's re-encodes into its encoder inputs (one scheduled request per item);
        returns the hashes the workers must drop from their caches first. Those entries are right
        again after this step."""
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        inputs = getattr(scheduler_output, "scheduled_encoder_inputs", None)
        evict = []
        if not isinstance(inputs, dict):
            return evict
        for h, candidates in list(self._reencode.items()):
            rid = next((r for r in candidates if r in scheduled), None)
            if rid is None:
                continue  # none of them runs in this step: next time
            ids = inputs.setdefault(rid, [])
            if candidates[rid] not in ids:
                ids.append(candidates[rid])
            evict.append(h)
            del self._reencode[h]
            self._why.pop(h, None)
            logger.warning("request %s: encoder output %s was the placeholder of a failed load: encoding it here",
                           rid, h)
        return evict

    def freed(self, hashes) -> None:
        """vLLM dropped these entries: a later request encodes or loads them afresh."""
        for h in hashes or ():
            self._why.pop(h, None)
            self._reencode.pop(h, None)

    def forget(self, req_id: str) -> None:
        for h, candidates in list(self._reencode.items()):
            candidates.pop(req_id, None)
            if not candidates:
                del self._reencode[h]
        for _, watch in self._watch.values():
            watch.pop(req_id, None)
