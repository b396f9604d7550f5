"""Scheduler-side delegate of NixlECConnector (runs in the EngineCore process).

Consumer: admission. Every remote item of a request is asked of its producer with a *Hold* (a
lease and the item's place) the moment the request is first seen. What the request waits for
depends on what a miss would cost:

* **Early admission** (the standard E-then-PD flow, and the push flow): when every remote item
  carries its media (a miss costs a local encode, never the request), or carries none but was
  announced by an encoder that answered already (``early_without_media``: a router's
  placeholders; a miss fails it, as it would gated), and its producer answers its control plane,
  the request is admitted at once, in the step a local cache hit would be: ``has_cache_item`` says
  True with a provisional place. ``build_connector_meta`` then gives the step's loads the places
  their Holds answered (waiting ``admission_wait_s`` at most, once per step, for all of them); a
  load whose Hold has not answered yet is fetched by the workers themselves (a Get, one round
  trip, then the READ), and the worker's barrier still keeps it from the gather until it landed.
  A Hold that answers "no" before the request is scheduled turns it back into a gated one (below).
* **Gated admission** (items expected from an encoder still running, metadata-only items with
  ``early_without_media`` off,
  producers not connected yet or silent, loads measured as long on a busy engine): the request
  is admitted only once each item's producer has confirmed, over the control plane, that the item
  is ready and held for us. Only then does ``has_cache_item`` say True, so the scheduler never
  plans an external load that cannot land. As soon as a hold is granted, the item goes to the
  workers as a *prefetch* in the next step's metadata; while other requests run, a request whose
  transfer is measured as long is admitted one step later, so its transfer overlaps that step.

An item that cannot be had is encoded
locally when the request carries its media, otherwise the request fails with a message naming
the item and the reason; it never reaches the gather missing. A load that fails after admission
(its producer died or restarted in between) is encoded by the worker in the same step when the
request carries the media (counted as a late fallback), else its request fails the same way.
The holds go through this process's
own control-only endpoint, not through worker hooks, which vLLM skips on steps with no tokens.

A request may arrive before its encoder has finished (``ec_nixl_expect``: the proxy sent it to
both at once): its items are then expected at the named producer, and their Hold waits there
until they are published, so the request's own preprocessing overlapped the encoder's work.

What the scheduler records of each request, and what it decides at first sight (remote, local,
failed), is ``admission``. Producer: ``request_finished`` announces each encoded item
(``announce.Announcer``). What a consumer's scheduler knows of each producer (Holds in flight,
failures, link probes) is ``producers.ProducerView``; what an item of this model is (shape,
media) is ``features.FeatureFacts``.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Optional

from ec_nixl import protocol as P
from ec_nixl.endpoint import Endpoint
from ec_nixl.errors import ConfigError
from ec_nixl.metrics import Metrics
import ec_nixl.vllm.hooks as hooks
from ec_nixl.vllm.admission import Admission, Item, decide, first_sight, outcome
from ec_nixl.vllm.announce import Announcer
from ec_nixl.vllm.cache_events import SchedulerEvents
from ec_nixl.vllm.features import FeatureFacts
from ec_nixl.vllm.metadata import LoadSpec, NixlECMetadata, NixlECWorkerMeta
from ec_nixl.vllm.options import NixlECOptions, Placement, compat_fields, endpoint_config
from ec_nixl.vllm.producers import ProducerView
from ec_nixl.vllm.poisoned import PoisonedEntries
from ec_nixl.vllm.worker_report import apply as apply_worker_report
from ec_nixl.vllm.stand_ins import SchedulerStandIns
from ec_nixl.vllm.stats import NixlECConnectorStats, StatsBook
from ec_nixl.vllm.transfers import TransferIds

logger = logging.getLogger("ec_nixl.vllm")

_RETRY = {P.Nack.NOT_READY.value, P.Nack.BUSY.value, "TIMEOUT"}
_HOLD_REFRESH_S = 0.5  # re-hold a waiting request's items when less than this fraction of the lease is left
_STEPS_KEPT = 4
"""Metadata objects whose SchedulerOutput reference is kept: more than the steps vLLM has in
flight, so every worker has used it before it is cleared (which breaks the reference cycle)."""


def _runs(scheduler_output) -> bool:
    """Whether a step schedules tokens. vLLM's V1 model runner returns before the EC connector on
    a step that schedules none (the step after a request finished is one; Model Runner V2 still
    runs it): prefetches and releases sent only with it would never reach V1's workers, and a
    released slot would stay taken. So they are sent with such a step and again with the next
    step that runs (workers take a repeat as a no-op: releases go before prefetches and loads)."""
    return int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0) > 0


def _control_endpoint(cfg, stats) -> Endpoint:
    """The scheduler's control-only endpoint; it answers ``ec-nixl status`` with ``stats()`` added.
    A consumer's listens for vLLM EPD routers' control requests; a port already taken (two PDs on
    one host with the same ``ec_port``, which served before routers needed it) is logged, and the
    PD runs without it: only those requests fail."""
    try:
        ep = Endpoint(cfg)
    except ConfigError as e:
        if cfg.listen is None:
            raise
        logger.warning("ec-nixl: %s: vLLM EPD routers' control requests (peers, cancel) to this PD will fail; "
                       "give each PD its own ec_port to have them", e)
        ep = Endpoint(dataclasses.replace(cfg, listen=None))
    ep.stats_extra = stats
    return ep


class SchedulerSide:
    def __init__(self, vllm_config, opts: NixlECOptions, place: Placement):
        self.vllm_config = vllm_config
        self.opts = opts
        self.place = place
        self.facts = FeatureFacts(vllm_config)
        self.metrics = Metrics()
        self.counts = StatsBook(self.metrics, intervals=hooks.STATS)  # this interval's and the running totals
        self.announcer = Announcer(self.facts, opts, place)  # producer: what a finished request announces
        self.cache_events = SchedulerEvents(opts, place, self.metrics, self.facts)  # vLLM's encoder cache
        self.endpoint: Optional[Endpoint] = None
        self.transfers = TransferIds()  # push flow: the transfer ids of our requests' items
        self.producers: Optional[ProducerView] = None
        if place.is_consumer:
            self.endpoint = _control_endpoint(endpoint_config(place, opts, compat_fields(vllm_config, opts),
                                                              control_only=True), self.counts.totals)
            self.producers = ProducerView(self.endpoint, place.readers, opts.prefetch_defer_s)
            if self.endpoint.server is not None:  # the PD's control port: vLLM EPD routers' cancels
                self.endpoint.server.on_cancel = self.transfers.cancel
        self._reqs: dict[str, Admission] = {}
        self._ready: dict[str, LoadSpec] = {}  # mm_hash -> where to load it from (held)
        self._users: dict[str, set[str]] = {}  # mm_hash -> request ids that need it
        self._loads: list[LoadSpec] = []
        self._prefetch: list[LoadSpec] = []  # held items workers start loading at once
        self._prefetched: set[str] = set()  # sent for prefetch, not yet loaded or released
        self._step = 0
        self._busy = False  # the last step scheduled tokens: a new load would stall a batch
        self._idle_blocked_step = -1  # the step in which an idle engine last blocked for a Hold answer
        self._unavailable: set[str] = set()
        self.stand_ins = SchedulerStandIns(place, self.metrics)  # for the hooks this vLLM lacks (< 0.32)
        self._release: list[str] = []
        self._loaded: set[str] = set()  # remote items handed to workers, not yet released
        self._with_step: collections.deque[NixlECMetadata] = collections.deque()
        self.poisoned = PoisonedEntries(self.facts.has_media, opts.fallback == "auto")  # failed loads' entries

    # ================================================================ consumer: admission

    def ensure_cache_available(self, request, num_computed_tokens: int) -> bool:
        if self.endpoint is None:
            return True
        if not self.poisoned.admits(request, num_computed_tokens, self._unavailable):
            return False  # it needs a failed load's placeholder vLLM keeps (it waits, or fails)
        adm = self._reqs.get(request.request_id)
        if adm is None:
            adm = self._admit(request, num_computed_tokens)
            self._send_holds(adm)
            # An early admission waits for nothing here (its loads get their places at the end of
            # the step); an expected item is answered when its encoder is done, not within this wait.
            if not self._admit_early(adm) and self.opts.admission_wait_s > 0 and not adm.expected:
                holds = [it.hold for it in adm.items.values() if it.hold is not None]
                if holds:
                    self.endpoint.wait_for(lambda: all(h.done for h in holds), self.opts.admission_wait_s)
        elif num_computed_tokens < adm.floor and not adm.failed:
            # vLLM >= 0.33 asks with the computed tokens minus the prefix-replay tail
            # (ec_computed_tokens), and a preempted request comes back with fewer: items that
            # were already computed when the request was first seen can be needed again.
            decide(adm, request, num_computed_tokens, adm.floor, self.facts, self._users)
            if adm.failed:
                self._unavailable.add(adm.req_id)
        if not adm.items and not adm.failed:
            return True  # nothing remote: vLLM encodes it (decided once per request)
        if adm.failed:
            return False
        pending = False
        now = time.monotonic()
        for h, it in adm.items.items():
            if it.offset_end <= num_computed_tokens or it.status == "local":
                continue
            if it.status == "ready":
                spec = self._ready.get(h)
                if spec is not None and it.hold is None and spec.block >= 0 and \
                        time.time() > spec.valid_until - self.opts.endpoint.announce_lease_s * _HOLD_REFRESH_S:
                    it.hold = self.producers.hold(it.remote.producer, [h])
                if it.hold is not None and it.hold.done:
                    self._take_answer(adm, h, it, now)
                if it.status == "ready":
                    continue
            self._advance(adm, h, it, now)
            if adm.failed:
                break
            pending |= it.status == "holding"
        if adm.failed:
            self._unavailable.add(adm.req_id)
            return False
        if pending:
            self._send_holds(adm)
            if self._may_block_idle():
                # Nothing else to run: sleep until the producer answers (a few ms at most)
                # instead of letting the engine spin through empty steps, which took a core from
                # the encoder and the front-ends on a small host (the overlapped flow keeps
                # requests waiting while their encoder runs).
                # Any waiting request's answer ends the sleep: this step then admits it.
                holds = [it.hold for a in self._reqs.values() for it in a.items.values()
                         if it.hold is not None and not it.hold.done]
                if holds and self.endpoint.wait_for(lambda: any(h.done for h in holds), self.opts.admission_wait_s):
                    return self.ensure_cache_available(request, num_computed_tokens)
            self.metrics.count("admission_defers")
            return False
        if self._busy and adm.deferred_step < 0 and self.producers.long(  # (this step's prefetches for it)
                [adm.items[s.desc.mm_hash].remote for s in self._prefetch if s.desc.mm_hash in adm.items]):
            # Long loads off the step's critical path: while other requests run, admit this one
            # a step later; the workers start its transfers with this step's metadata, so the
            # step that gathers it only passes the barrier. (An idle engine admits at once: no
            # batch to stall, and a step with no tokens would not run the worker hooks at all.)
            adm.deferred_step = self._step
            self.metrics.count("prefetch_defers")
            return False
        if adm.deferred_step == self._step:
            return False
        if not adm.admitted:
            adm.admitted = True
            self.metrics.count("admitted")
            self.metrics.count("admission_steps", self._step - adm.first_step)
            self.metrics.phase("admit", time.monotonic() - adm.t_first)
        return True

    def _may_block_idle(self) -> bool:
        """Once per scheduling step, and only when the last step ran no tokens: an idle engine
        may block ``admission_wait_s`` for a Hold's answer (a busy one must not stall its batch)."""
        if self._busy or self._idle_blocked_step == self._step or self.opts.admission_wait_s <= 0:
            return False
        self._idle_blocked_step = self._step
        return True

    def _admit_early(self, adm: Admission) -> bool:
        """Admit ``adm`` now, before its Holds answer: every remote item carries its media (a miss
        costs a local encode; ``fallback`` 'auto') or none does (``early_without_media``: a miss fails
        it, as gated), none is expected from an encoder still running, each producer is connected
        and answering (``ProducerView.answering``), and the engine is idle or the transfers are not
        measured as long. Its items become ready with a provisional place (block -1): the end of
        the step gives each load the place its Hold answered (``_place_loads``)."""
        if not self.opts.early_admission or self.opts.fallback != "auto" or adm.failed or adm.expected \
                or not adm.items:
            return False
        items = list(adm.items.values())
        if any(it.status != "holding" or not (it.has_media or self.opts.early_without_media) for it in items):
            return False
        now = time.monotonic()
        if not all(self.producers.answering(p, now) for p in {it.remote.producer for it in items}):
            return False
        if self._busy and self.producers.long([it.remote for it in items]):
            return False
        for h, it in adm.items.items():
            it.status, it.early = "ready", True
            if h not in self._ready:
                self._ready[h] = LoadSpec("", it.remote.desc, it.remote.producer, -1, 0.0)
        self.metrics.count("early_admissions")
        return True

    def _place_loads(self) -> None:
        """The step's loads of early-admitted items get the places their Holds answered. The Holds
        went out when the requests were first seen; those still out are waited for here, all
        together, ``admission_wait_s`` at most (one bounded wait per step, after the whole batch
        was scheduled). A load still without a place goes as it is: the workers ask the producer
        for it (a Get: one round trip, then the READ). Over a WRITE link the workers ask the
        producer to push the item whatever its place: nothing is waited for there."""
        early = []
        for s in self._loads:
            if s.block < 0:
                adm = self._reqs.get(s.req_id)
                it = adm.items.get(s.desc.mm_hash) if adm is not None else None
                if it is not None:
                    early.append((adm, s, it))
        if not early:
            return
        out = [it.hold for _, s, it in early if it.hold is not None and not it.hold.done
               and not self.producers.pushes(s.producer)]
        if out and self.opts.admission_wait_s > 0:
            t0 = time.monotonic()
            self.endpoint.wait_for(lambda: all(h.done for h in out), self.opts.admission_wait_s)
            self.metrics.phase("place_wait", time.monotonic() - t0)
        now = time.monotonic()
        for adm, s, it in early:
            h = s.desc.mm_hash
            if it.hold is not None and it.hold.done:
                self._take_answer(adm, h, it, now)
            spec = self._ready.get(h)
            if spec is not None and spec.block >= 0:
                s.block, s.valid_until, s.incarnation = spec.block, spec.valid_until, spec.incarnation
            elif not self.producers.pushes(s.producer):  # (a pushed item needs no place)
                self.metrics.count("unplaced_loads")

    def _admit(self, request, num_computed_tokens: int) -> Admission:
        """First sight of a request (``admission.first_sight``); the push flow's transfer ids are noted."""
        adm = first_sight(request, num_computed_tokens, self._step, self.facts, self.opts.fallback == "auto",
                          self._users, self.metrics)
        self._reqs[adm.req_id] = adm
        self.cache_events.first_sight(request, num_computed_tokens)
        params = getattr(request, "ec_transfer_params", None)
        if params:
            self.transfers.seen(adm.req_id, params, {f.identifier for f in request.mm_features})
        if adm.failed:
            self._unavailable.add(adm.req_id)
        return adm

    def _send_holds(self, adm: Admission) -> None:
        """One Hold per producer for the items still waiting (and not already asked)."""
        now = time.monotonic()
        by_producer: dict[tuple[str, bool], list[str]] = {}
        for h, it in adm.items.items():
            if it.status == "holding" and it.hold is None and now >= it.next_try:
                by_producer.setdefault((it.remote.producer, h in adm.expected), []).append(h)
        for (producer, expected), hashes in by_producer.items():
            # Expected items are answered at their publish (or the wait's end): no polling.
            wait = max(0.0, self.opts.expect_wait_s - (now - adm.t0)) if expected else 0.0
            hr = self.producers.hold(producer, hashes, timeout=max(1.0, self.opts.endpoint.peer_timeout_s),
                                     wait_s=wait)
            for h in hashes:
                adm.items[h].hold = hr

    def _advance(self, adm: Admission, h: str, it: Item, now: float) -> None:
        if it.hold is None or not it.hold.done:
            if now - adm.t0 > self.opts.admission_timeout_s:
                self._give_up(adm, h, it, f"not ready at its producer after {self.opts.admission_timeout_s:.1f}s")
            return
        hold = it.hold
        state = hold.states[h]
        incarnation, it.hold = hold.incarnation, None
        expected = h in adm.expected
        if h == hold.mm_hashes[0]:  # one sample per Hold
            self.metrics.phase("expect_wait" if expected else "hold_rtt", hold.t_answered - hold.t_asked)
            self.metrics.phase("hold_seen", now - hold.t_asked)
        if state.status == "ready":
            try:
                P.validate_state_matches(state, it.remote.desc)
            except Exception as e:
                return self._give_up(adm, h, it, f"producer answered inconsistently: {e}")
            it.status = "ready"
            spec = self._ready[h] = LoadSpec("", it.remote.desc, it.remote.producer, state.block,
                                             time.time() + max(0.0, state.lease_s - 1.0), incarnation)
            if h not in self._prefetched:
                self._prefetched.add(h)
                self._prefetch.append(LoadSpec(adm.req_id, spec.desc, spec.producer, spec.block,
                                               spec.valid_until, spec.incarnation))
            return
        grace = self.opts.expect_wait_s if expected else self.opts.missing_grace_s
        retry = state.status in _RETRY or (state.status == P.Nack.MISSING.value and now - adm.t0 < grace)
        if retry and now - adm.t0 < self.opts.admission_timeout_s:
            it.next_try = now + min(0.05, 0.002 * (1 + now - adm.t0) * 10)
            it.detail = f"{state.status}: {state.detail}"
            return
        self._give_up(adm, h, it, f"{state.status}: {state.detail}")

    def _take_answer(self, adm: Admission, h: str, it: Item, now: float) -> None:
        """The Hold of a ready item answered: its place (an early item's first, or a renewed
        lease). Any other answer for an early item the scheduler has not handed to the workers
        yet puts it back on the gated path (``_advance``: retries, grace, local encode); once
        handed over, the workers' own Get meets the same answer and the late fallback takes it."""
        hold, it.hold = it.hold, None
        state = hold.states[h]
        spec = self._ready.get(h)
        if state.status == "ready":
            try:
                P.validate_state_matches(state, it.remote.desc)
            except Exception as e:
                state = P.ItemState(mm_hash=h, status="BAD_GRANT", detail=f"producer answered inconsistently: {e}")
            else:
                if it.early and h == hold.mm_hashes[0]:
                    self.metrics.phase("hold_rtt", hold.t_answered - hold.t_asked)
                valid_until = time.time() + max(0.0, state.lease_s - 1.0)
                if spec is not None and spec.producer == it.remote.producer:
                    spec.block, spec.valid_until, spec.incarnation = state.block, valid_until, hold.incarnation
                else:
                    self._ready[h] = LoadSpec("", it.remote.desc, it.remote.producer, state.block, valid_until,
                                              hold.incarnation)
                return
        if not it.early or it.loaded or spec is None or spec.block >= 0:
            return  # a renewal that failed (the place stays valid for its lease), or the workers have it
        del self._ready[h]
        it.status, it.early = "holding", False
        it.next_try, it.detail = now + 0.002, f"{state.status}: {state.detail}"
        self.metrics.count("early_reverted")

    def _give_up(self, adm: Admission, h: str, it: Item, why: str) -> None:
        msg = f"encoder output {h} of request {adm.req_id} from {it.remote.producer} unavailable: {why}"
        if it.has_media and self.opts.fallback == "auto":
            logger.warning("%s; encoding it locally instead", msg)
            it.status = "local"
            self.metrics.count("local_fallbacks")
        else:
            logger.error("%s; failing the request (it carries no media to encode locally)", msg)
            it.status, adm.failed = "failed", msg
            self._unavailable.add(adm.req_id)
        self.metrics.fail(why.split(":")[0])

    def has_cache_item(self, identifier: str) -> bool:
        return identifier in self._ready

    def update_state_after_alloc(self, request, index: int) -> None:
        h = request.mm_features[index].identifier
        spec = self._ready.get(h) if self.place.is_consumer else None
        if spec is not None:
            adm = self._reqs.get(request.request_id)
            it = adm.items.get(h) if adm is not None else None
            media = it.has_media if it is not None else self.facts.has_media(request.mm_features[index])
            if it is not None:
                it.loaded = True
            self._loads.append(LoadSpec(request.request_id, spec.desc, spec.producer, spec.block,
                                        spec.valid_until, spec.incarnation, index,
                                        media and self.opts.fallback == "auto"))
            self._loaded.add(h)
            self._prefetched.discard(h)
            self.stand_ins.loaded(request, index)
        elif self.place.is_producer:
            self.announcer.encoded(request.request_id, h)
        self.cache_events.allocated(request, index, spec)

    def update_state_after_free(self, request, index: int) -> None:
        """The item's embeddings are in the KV cache: workers may give its pool slot back."""
        h = request.mm_features[index].identifier
        if h in self._loaded:
            self._loaded.discard(h)
            self._release.append(h)

    def build_connector_meta(self, scheduler_output) -> NixlECMetadata:
        self.stand_ins.before_step(scheduler_output, self.update_connector_output, self.update_state_after_free)
        self._cancel_waiting()
        self._place_loads()
        evict = self.poisoned.before_step(scheduler_output, [s.desc.mm_hash for s in self._loads], self._step)
        self._busy = _runs(scheduler_output)
        self._step += 1
        publish, modalities = self.cache_events.step(scheduler_output, self.announcer.take_publish())
        if not self._busy and not self._loads:  # kept for the next step that runs (see _runs)
            return NixlECMetadata(prefetch=self._prefetch[:], release=self._release[:], publish=publish, modalities=modalities)
        meta = NixlECMetadata(loads=self._loads, prefetch=self._prefetch, publish=publish, release=self._release,
                              modalities=modalities, evict=evict)
        self._loads, self._prefetch, self._release = [], [], []
        if meta.loads:  # workers may add a failed load to this step's encoder inputs (WorkerSide)
            meta.step = scheduler_output
            self._with_step.append(meta)
            while len(self._with_step) > _STEPS_KEPT:
                self._with_step.popleft().step = None
        return meta

    def _cancel_waiting(self) -> None:
        """The router abandoned these transfers: requests still waiting for them stop waiting (a
        load already handed to the workers ends with its request, behind the barrier's fence)."""
        for rid, hashes in self.transfers.take_cancelled().items():
            adm = self._reqs.get(rid)
            for h, it in (adm.items.items() if adm is not None and not adm.admitted else ()):
                if (h in hashes or None in hashes) and it.status == "holding":
                    self._give_up(adm, h, it, "CANCELLED: the router abandoned its transfer")

    def update_connector_output(self, output) -> None:
        m = getattr(output, "ec_connector_worker_meta", output)  # (or a report_channel report itself)
        if not isinstance(m, NixlECWorkerMeta):
            return
        self._unavailable |= apply_worker_report(m, self._reqs, self.producers, self.metrics, self.poisoned)
        if m.stats:
            self.producers.learn(m.stats)
            self.counts.add_workers(m.stats)

    def take_unavailable_requests(self) -> set[str]:
        out, self._unavailable = self._unavailable, set()
        return out

    # ================================================================ request finished (both roles)

    def request_finished(self, request) -> tuple[bool, Optional[dict]]:
        self.cache_events.finished(request)
        self.poisoned.finished(request.request_id)
        adm = self._reqs.pop(request.request_id, None)
        self.stand_ins.finished(request, self.update_state_after_free)
        self.transfers.forget(request.request_id)
        loaded_here: set[str] = set()  # ec_both: items that came from another producer
        if adm is not None:
            loaded_here = {h for h, it in adm.items.items() if it.status == "ready"}
            unread: dict[str, list[str]] = {}
            for h, it in adm.items.items():
                users = self._users.get(h)
                if users is not None:
                    users.discard(request.request_id)
                    if not users:
                        del self._users[h]
                        self._ready.pop(h, None)
                        if h in self._prefetched:  # prefetched, never loaded: workers drop it
                            self._prefetched.discard(h)
                            self._release.append(h)
                        elif it.early and not it.loaded and h not in self._loaded:
                            # held early, never handed to the workers: the producer may free it now
                            unread.setdefault(it.remote.producer, []).append(h)
            for producer, hashes in unread.items():
                self.endpoint.release(producer, hashes, self.place.readers)
        params = self.announcer.finished(request, loaded_here)
        if not self.place.is_producer or not request.mm_features:
            return False, outcome(adm)
        return False, params

    # ================================================================ both

    def get_stats(self) -> Optional[NixlECConnectorStats]:
        stats = NixlECConnectorStats(self.counts.take_interval())
        return None if stats.is_empty() else stats

    def shutdown(self) -> None:
        self.cache_events.close()
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
        self.stand_ins.close()
