"""Worker-side delegate of NixlECConnector (runs in every worker rank).

Producer (TP rank 0 only; encoder outputs are identical on all ranks): ``save_caches`` collects
the step's new encoder outputs and the end of the step pins them all in the rank's registered
pool with one pack (one kernel launch on GPUs); a serving endpoint answers consumers from its own
I/O thread, so the engine never has to step for a transfer to progress.

Consumer (every rank loads its own copy): ``start_load_caches`` posts the step's prefetches
(items whose holds were just granted) without waiting, then waits on the ``LoadBarrier`` for the
items this step gathers — usually prefetched a step earlier, so already landed — before anything
is put into ``encoder_cache``; the entries are views into
the pool, released (behind a CUDA event on GPUs) once vLLM drops them. An item that did not land
and whose request carries its media is encoded here in the same step: vLLM runs its encoder on
the step's ``scheduled_encoder_inputs`` right after this hook and before the gather, so adding the
item there turns the failed load into a local encode (the scheduler counts it). Any other item
that did not land is reported to the scheduler, which fails its request; its cache entry is a
zero tensor so the gather cannot crash the engine while that happens.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Optional

import torch

from ec_nixl.barrier import LoadBarrier
from ec_nixl.events import schema as S
from ec_nixl.endpoint import Endpoint
from ec_nixl.states import TicketState
from ec_nixl.tensors import torch_dtype
from ec_nixl.tickets import ItemRef, LoadTicket
from ec_nixl.errors import ConfigError, ECNixlError, LoadFailed
import ec_nixl.vllm.hooks as hooks
from ec_nixl.vllm.cache_events import PoolEvents, make_publisher
from ec_nixl.vllm.metadata import NixlECMetadata, NixlECWorkerMeta
from ec_nixl.vllm.options import NixlECOptions, Placement, compat_fields, endpoint_config

logger = logging.getLogger("ec_nixl.vllm")

REPUBLISH_WAIT_S = 0.05
"""How long the producer may keep such a Get for an item it does not hold (yet): a producer
publishes an encoder-cache hit again one engine step after announcing it."""


class WorkerSide:
    def __init__(self, vllm_config, opts: NixlECOptions, place: Placement):
        self.vllm_config = vllm_config
        self.opts = opts
        self.place = place
        self.endpoint: Optional[Endpoint] = None
        self.barrier: Optional[LoadBarrier] = None
        self._held: dict[str, tuple[LoadTicket, torch.Tensor]] = {}
        self._inflight: dict[str, LoadTicket] = {}  # prefetched, not yet gathered
        self._cache: Optional[dict] = None
        self._loaded: list[tuple[int, str]] = []
        self._failed: list[tuple[int, str, str, str]] = []
        self._rerouted: list[tuple[int, str, str, str]] = []
        self._pool_reported: Optional[tuple] = None
        self._to_publish: list[tuple[str, torch.Tensor]] = []
        self._producer_cache: Optional[dict] = None  # the encoder cache save_caches is handed
        self._reports = None  # vLLM < 0.32: report_channel.ReportOutbox (consumers)
        self.pool_events: Optional[PoolEvents] = None  # a serving producer's pool, as encoder_pool events
        # Fault injection for tests only: publish a corrupted copy, to prove consumers use ours.
        self._corrupt = os.environ.get("EC_NIXL_FAULT_CORRUPT_PUBLISH") == "1"

    def start_services(self) -> None:
        p = self.place
        if not (p.is_consumer or p.serving_rank):
            return  # producer TP rank > 0: rank 0 serves
        cfg = endpoint_config(p, self.opts, compat_fields(self.vllm_config, self.opts), control_only=False)
        self.endpoint = Endpoint(cfg)
        # The step's hand-over pays for nothing but the bytes: read-done messages and telemetry
        # go out in get_finished (end of the step) through progress().
        self.barrier = LoadBarrier(self.endpoint, settle=False)
        if p.serving_rank and self.opts.cache_events.events and self.endpoint.items is not None:
            self.pool_events = PoolEvents(make_publisher(self.opts.cache_events, self.opts, p, S.MEDIUM_POOL))
            self.endpoint.items.listener = self.pool_events
        logger.info("NixlECConnector %s: %s pool of %.1f MiB on %s%s", cfg.name,
                    self.endpoint.pool.arena.mem_type, p.pool_bytes / 2**20, p.device,
                    f", serving on {self.endpoint.address}" if self.endpoint.address else "")
        if p.is_consumer and not hooks.WORKER_REPORTS:
            from ec_nixl.vllm.report_channel import ReportOutbox

            self._reports = ReportOutbox(p.engine_id, p.dp_rank, p.base_port)

    def count_pool_in_budget(self) -> None:
        """vLLM < 0.32 creates the connector before its memory snapshot, so a VRAM pool allocated
        then would be outside ``gpu_memory_utilization`` (vLLM >= 0.32 starts the services after
        the snapshot and counts the pool as non-KV memory). Lower this worker's own utilization
        by the pool's share instead: the instance then takes what it was given, pool included."""
        if self.endpoint is None or not self.place.device.startswith("cuda"):
            return
        cc = self.vllm_config.cache_config
        if getattr(cc, "kv_cache_memory_bytes", None):
            return  # the KV cache is sized in bytes: utilization is not used
        total = torch.cuda.get_device_properties(torch.device(self.place.device)).total_memory
        before = float(cc.gpu_memory_utilization)
        after = before - self.endpoint.pool.arena.size / total
        if after <= 0.01:
            raise ConfigError(f"the {self.endpoint.pool.arena.size / 2**30:.2f} GiB EC pool (ec_buffer_size) takes all "
                              f"of gpu_memory_utilization {before} of this {total / 2**30:.1f} GiB GPU")
        cc.gpu_memory_utilization = after
        logger.info("NixlECConnector: gpu_memory_utilization %.4f -> %.4f in this worker: its %.0f MiB pool counts "
                    "inside the budget (this vLLM allocates the pool before its memory snapshot)", before, after,
                    self.endpoint.pool.arena.size / 2**20)

    # ---------------------------------------------------------------- producer

    def save_caches(self, encoder_cache: dict, mm_hash: str) -> None:
        if not self.place.serving_rank or self.endpoint is None:
            return
        self._producer_cache = encoder_cache
        t = encoder_cache.get(mm_hash)
        if t is not None:
            if self._corrupt:
                t = torch.full_like(t, 3.0)
                logger.warning("EC_NIXL_FAULT_CORRUPT_PUBLISH: publishing a corrupted %s (test fault)", mm_hash)
            self._to_publish.append((mm_hash, t))

    def flush_publish(self) -> None:
        """Pin everything saved this step with one pack, after the encoder has run."""
        batch, self._to_publish = self._to_publish, []
        if not batch or self.endpoint is None:
            return
        t0 = time.monotonic()
        try:
            self.endpoint.publish_many(batch)
            self.endpoint.metrics.phase("publish", time.monotonic() - t0)
        except ECNixlError as e:
            # Consumers will get MISSING and re-encode (or fail) those requests; never crash here.
            logger.error("could not pin %d encoder output(s) for transfer: %s", len(batch), e)

    def start_save_caches(self, encoder_cache: dict, meta: NixlECMetadata) -> None:
        self._producer_cache = encoder_cache
        self.publish_again(meta)

    def publish_again(self, meta: NixlECMetadata) -> None:
        """Items the scheduler announced from the encoder cache (hits): pinned again if they left
        the pool. vLLM >= 0.32 calls this before the encoder runs (``start_save_caches``); older
        ones at the end of the step, from the cache ``save_caches`` was last handed (the same
        dict every step: the model runner's)."""
        if self.pool_events is not None:
            self.pool_events.learn(meta.modalities)  # (the items this step publishes)
        cache = self._producer_cache
        if not self.place.serving_rank or self.endpoint is None or not meta.publish or cache is None:
            return
        published = set(self.endpoint.published())
        for h in meta.publish:
            if h in cache and h not in published:
                self.save_caches(cache, h)
        self.flush_publish()

    # ---------------------------------------------------------------- consumer

    def start_load_caches(self, encoder_cache: dict, meta: NixlECMetadata) -> None:
        self._cache = encoder_cache
        for h in meta.release:
            self._release(h)
        for h in meta.evict:  # a failed load's placeholder, encoded again in this step (vllm/poisoned.py)
            encoder_cache.pop(h, None)
        self._sweep()
        try:
            if self.endpoint is not None:
                if meta.prefetch:
                    self._prefetch(meta)
                if meta.loads:
                    self._load(encoder_cache, meta)
        finally:
            meta.step = None  # used; drop the reference cycle SchedulerOutput <-> metadata

    def _refs(self, specs) -> list[ItemRef]:
        p = self.place
        return [ItemRef(desc=s.desc, producer=s.producer, block=s.block, valid_until=s.valid_until,
                        incarnation=s.incarnation, reader=p.reader, readers=p.readers) for s in specs]

    def _prefetch(self, meta: NixlECMetadata) -> None:
        """Items whose holds were just granted: post them now and do not wait; a later step (or
        this one's ``_load``) finds them landed. Only the first spec of a hash counts."""
        early = {s.desc.mm_hash: s for s in meta.prefetch
                 if s.desc.mm_hash not in self._inflight and s.desc.mm_hash not in self._held}
        if early:
            for t in self.endpoint.load(self._refs(early.values())):
                self._inflight[t.mm_hash] = t
            self.endpoint.metrics.count("prefetched", len(early))

    def _load(self, encoder_cache: dict, meta: NixlECMetadata) -> None:
        specs = {}
        for s in meta.loads:
            if s.desc.mm_hash not in encoder_cache:
                specs.setdefault(s.desc.mm_hash, s)
        if not specs:
            return
        p = self.place
        tickets, fresh = [], []
        for h, s in specs.items():
            t = self._inflight.pop(h, None)
            if t is not None and t.state is TicketState.FAILED:
                t = None  # the prefetch failed (e.g. its producer restarted): load it again now
            if t is None:
                fresh.append(s)
            else:
                tickets.append(t)
        if fresh:
            # An early-admitted load without a place (its Hold had not answered when the step was
            # built) that carries its media waits early_load_wait_s at most, then is encoded here:
            # its producer stopped answering just now (the scheduler admits no more early from
            # it), and the whole step must not wait out load_timeout_s for it. One without media
            # cannot be encoded here: it gets the whole load_timeout_s.
            placed = [s for s in fresh if s.block >= 0]
            if placed:
                tickets += self.endpoint.load(self._refs(placed))
            for media in (True, False):
                unplaced = [s for s in fresh if s.block < 0 and s.has_media == media]
                if unplaced:  # (an encoder-cache hit is published again one producer step after
                    # its announcement: the producer may keep the Get that long for it)
                    wait = self.endpoint.cfg.load_timeout_s
                    tickets += self.endpoint.load(self._refs(unplaced), wait_s=REPUBLISH_WAIT_S,
                                                  timeout=min(self.opts.early_load_wait_s, wait) if media else wait)
        try:
            self.barrier.wait(tickets)
        except LoadFailed:
            pass  # handled per ticket below: landed items are used, failed ones re-encoded or reported
        local = self._encode_here(meta, {t.mm_hash for t in tickets if t.state is not TicketState.LANDED})
        for t in tickets:
            spec = specs[t.mm_hash]
            why = t.error or t.reason
            if t.mm_hash in local:  # vLLM's encoder fills the entry in this step
                if t.state is TicketState.LANDED:
                    t.release()  # another rank's copy failed: every rank encodes it (see _agree)
                else:
                    logger.warning("encoder output %s for request %s did not land (%s): encoding it here",
                                   t.mm_hash, spec.req_id, why)
                    self._rerouted.append((p.reader, spec.req_id, t.mm_hash, why))
            elif t.state is TicketState.LANDED:
                view = t.tensor()
                encoder_cache[t.mm_hash] = view
                self._held[t.mm_hash] = (t, view)
                self._loaded.append((p.reader, t.mm_hash))
            else:
                d = spec.desc
                if not any(s.has_media for s in meta.loads if s.desc.mm_hash == d.mm_hash):
                    why += " (the request carries no media to encode it here)"
                logger.error("encoder output %s for request %s did not land: %s (%r)", d.mm_hash, spec.req_id, why, t)
                encoder_cache[d.mm_hash] = torch.zeros(d.shape, dtype=torch_dtype(d.dtype),
                                                       device=self.endpoint.pool.arena.device)
                self._failed.append((p.reader, spec.req_id, d.mm_hash, why))

    def _encode_here(self, meta: NixlECMetadata, failed: set[str]) -> set[str]:
        """Add failed loads whose request carries the media to this step's encoder inputs.

        Only through the step's own ``SchedulerOutput`` (``meta.step``, which must be the object
        this metadata arrived in: then its ``scheduled_encoder_inputs`` is the very dict the model
        runner encodes from next). The entry stays out of ``encoder_cache`` (MRv2 skips encoding
        what is there). Returns the hashes vLLM will encode; the rest fail as before.
        """
        step = meta.step
        inputs = getattr(step, "scheduled_encoder_inputs", None)
        if self.opts.fallback != "auto" or getattr(step, "ec_connector_metadata", None) is not meta \
                or not isinstance(inputs, dict):
            return set()
        failed = self._agree(meta, failed)
        local = set()
        for h in sorted(failed):
            spec = next((s for s in meta.loads if s.desc.mm_hash == h and s.has_media and s.index >= 0), None)
            if spec is None:
                continue
            ids = inputs.setdefault(spec.req_id, [])
            if spec.index not in ids:
                ids.append(spec.index)
            local.add(h)
        return local

    def _agree(self, meta: NixlECMetadata, failed: set[str]) -> set[str]:
        """With several ranks loading (TP), all must encode the same items (the vision tower may
        run collectives): the union of every rank's failures, over the TP group's CPU group."""
        if self.place.readers <= 1:
            return failed
        hashes = sorted({s.desc.mm_hash for s in meta.loads})
        flags = torch.tensor([1 if h in failed else 0 for h in hashes], dtype=torch.int32)
        from vllm.distributed.parallel_state import get_tp_group

        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=get_tp_group().cpu_group)
        agreed = {h for h, f in zip(hashes, flags.tolist()) if f}
        if agreed - failed:  # the only trace of the agreement on a rank whose own loads landed
            logger.warning("rank %d: encoding %s here too: another rank of the TP group could not load it",
                           self.place.reader, sorted(agreed - failed))
        return agreed

    def _release(self, h: str) -> None:
        """The item is in the KV cache now. vLLM may keep its encoder-cache entry for reuse, so
        the entry becomes a private copy and the pool slot goes back (behind a CUDA event)."""
        early = self._inflight.pop(h, None)
        if early is not None:  # prefetched, never gathered (the request went away)
            self.endpoint.cancel([early], "its request finished before it was gathered")
            early.release()
        held = self._held.pop(h, None)
        if held is None:
            return
        ticket, view = held
        if self._cache is not None and self._cache.get(h) is view:
            self._cache[h] = view.clone()
        ticket.release(self._fence(view))

    @staticmethod
    def _fence(view: torch.Tensor):
        if view.device.type != "cuda":
            return None
        ev = torch.cuda.Event()
        ev.record()  # after every kernel already queued that may read the slot
        return ev

    def _sweep(self) -> None:
        """Give back the slots of entries vLLM has dropped from its encoder cache."""
        if not self._held or self._cache is None:
            return
        for h, (ticket, view) in list(self._held.items()):
            if self._cache.get(h) is not view:
                del self._held[h]
                ticket.release(self._fence(view))

    def get_finished(self) -> None:
        self.flush_publish()  # end of the step's connector scope: the encoder has run
        self._sweep()
        if self.endpoint is not None and self.endpoint.is_owner:
            self.endpoint.progress()  # settle this step's loads (read-done to producers), timers

    def worker_meta(self) -> Optional[NixlECWorkerMeta]:
        stats = None
        if self.endpoint is not None and self.place.is_consumer:
            # (vLLM drops an encode-only producer's worker output: its counters stay in the
            # endpoint, cumulative, for `ec-nixl status`.)
            snap = self.endpoint.metrics.snapshot(reset=True)
            pool = self.endpoint.pool.stats()
            occupancy = (pool.used, pool.slots)
            if any(snap["counters"].values()) or snap["xfer_s"] or occupancy != self._pool_reported:
                self._pool_reported = occupancy
                snap["pool"] = {f"rank{self.place.reader}": {"used": pool.used, "slots": pool.slots,
                                                             "capacity": pool.capacity,
                                                             "mem_type": self.endpoint.pool.arena.mem_type}}
                stats = snap
        if not (self._loaded or self._failed or self._rerouted or stats):
            return None
        meta = NixlECWorkerMeta(self._loaded, self._failed, stats, self._rerouted)
        self._loaded, self._failed, self._rerouted = [], [], []
        return meta

    def send_report(self) -> Optional[NixlECWorkerMeta]:
        """vLLM < 0.32: this step's report goes to the scheduler over ``report_channel`` (returned)."""
        if self._reports is None:
            return None
        report = self.worker_meta()
        self._reports.send(report)
        return report

    def shutdown(self) -> None:
        self._held.clear()
        if self._reports is not None:
            self._reports.close()
            self._reports = None
        if self.pool_events is not None:
            self.pool_events.close()
            self.pool_events = None
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
