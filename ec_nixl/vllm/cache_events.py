"""vLLM's side of the encoder-cache events: what the scheduler and a producer's pool publish.

Scheduler (every role; ``SchedulerEvents``): vLLM's ``EncoderCacheManager`` gains an item when it
allocates one for a request (``update_state_after_alloc``: loaded from a producer, or encoded by
this engine) and loses one when it evicts it (the step's ``free_encoder_mm_hashes``, which it
drains for its workers). Those two, and nothing guessed, are its events, medium
``encoder_cache``. It also counts what each request's items cost: covered by the prefix cache
when first seen, found in the encoder cache, loaded, encoded, and the items a cache-aware router
sent here as held (``ec_nixl_route``) that vLLM had to encode or load after all: misroutes.

Producer worker (the serving rank; ``PoolEvents``): its pool's table (``Published.listener``)
says when an item enters and leaves, medium ``encoder_pool``; the modality comes with the step's
metadata (the worker sees only tensors).

Known gap: vLLM's ``reset_encoder_cache`` (a weights update) empties the encoder cache without a
hook; the index keeps those items until each is evicted or misrouted once (the engine encodes
it, the request is answered right, the misroute is counted).
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from typing import Optional

from ec_nixl import protocol as P
from ec_nixl.events import schema as S
from ec_nixl.events.config import EventsConfig, publisher_ports
from ec_nixl.events.publisher import EventPublisher, PublisherConfig
from ec_nixl.metrics import Metrics
from ec_nixl.params import parse_route
from ec_nixl.vllm.features import FeatureFacts
from ec_nixl.vllm.metadata import LoadSpec
from ec_nixl.vllm.options import NixlECOptions, Placement

logger = logging.getLogger("ec_nixl.vllm")

MODALITIES_KEPT = 65536
"""mm_hash -> modality entries a scheduler or worker keeps for its pool's events (oldest go first)."""


def make_publisher(cfg: EventsConfig, opts: NixlECOptions, place: Placement, medium: str) -> EventPublisher:
    """The publisher of ``medium`` for this engine (DP rank), bound where ``events_port`` says."""
    host = cfg.events_host or place.ip
    pub, replay = publisher_ports(cfg, place.base_port, place.dp_rank, medium)
    instance = cfg.events_instance or f"{opts.advertise_host or place.ip}:{place.base_port}"
    p = EventPublisher(PublisherConfig(
        endpoint=f"tcp://{host}:{pub}", replay_endpoint=f"tcp://{host}:{replay}", instance=instance,
        mediums=(medium,), topic=cfg.events_topic, buffer_batches=cfg.events_buffer_batches, hwm=cfg.events_hwm,
        heartbeat_s=cfg.events_heartbeat_s, batch_s=cfg.events_batch_s, data_parallel_rank=place.dp_rank))
    logger.info("ec-nixl: %s events of %s on %s (replay %s)", medium, instance, p.endpoint, p.replay_endpoint)
    return p


class _Modalities:
    """A bounded mm_hash -> modality map."""

    def __init__(self) -> None:
        self._map: collections.OrderedDict[str, str] = collections.OrderedDict()

    def note(self, mm_hash: str, modality: str) -> None:
        self._map[mm_hash] = modality
        self._map.move_to_end(mm_hash)
        if len(self._map) > MODALITIES_KEPT:
            self._map.popitem(last=False)

    def get(self, mm_hash: str) -> str:
        return self._map.get(mm_hash, "unknown")


@dataclass
class _Seen:
    """One request's items as this scheduler met them."""

    needed: dict[str, int] = field(default_factory=dict)  # mm_hash -> placeholder end, not in the prefix cache
    kv_hits: int = 0
    allocated: set[str] = field(default_factory=set)
    held: frozenset[str] = frozenset()  # what a router sent here as held


class SchedulerEvents:
    """vLLM's encoder cache as its scheduler sees it: events and per-request counts."""

    def __init__(self, opts: NixlECOptions, place: Placement, metrics: Metrics, facts: FeatureFacts):
        self.metrics, self.facts = metrics, facts
        self.publisher = make_publisher(opts.cache_events, opts, place, S.MEDIUM_CACHE) \
            if opts.cache_events.events else None
        self._reqs: dict[str, _Seen] = {}
        self.modality = _Modalities()

    def _seen(self, request) -> _Seen:
        seen = self._reqs.get(request.request_id)
        if seen is None:
            seen = self._reqs[request.request_id] = _Seen()
            held, why = parse_route(getattr(request, "ec_transfer_params", None))
            if why:
                logger.warning("request %s: %s; ignored", request.request_id, why)
            seen.held = held
        return seen

    def first_sight(self, request, num_computed_tokens: int) -> None:
        """A consumer's first sight of ``request``: which items it still needs."""
        seen = self._seen(request)
        for f in request.mm_features:
            end = f.mm_position.offset + f.mm_position.length
            if end <= num_computed_tokens:
                seen.kv_hits += 1
            else:
                seen.needed[f.identifier] = end

    def allocated(self, request, index: int, load: Optional[LoadSpec]) -> None:
        """vLLM's encoder cache took item ``index`` of ``request``: loaded from a producer (``load``),
        or to be encoded by this engine in this step."""
        f = request.mm_features[index]
        h, loaded = f.identifier, load is not None
        seen = self._seen(request)
        first = h not in seen.allocated
        seen.allocated.add(h)
        if first and not loaded:
            self.metrics.count("encoded")
        if first and h in seen.held:
            self.metrics.count("cache_route_misses")
            logger.info("request %s: item %s was routed here as held in the encoder cache, but is %s",
                        request.request_id, h, "loaded" if loaded else "encoded")
        if self.publisher is not None:
            self.modality.note(h, f.modality)
            desc = load.desc if load is not None else self.facts.describe(f)  # (the bytes vLLM's cache holds)
            self.publisher.stored(h, f.modality, desc.nbytes if desc is not None else 0, S.MEDIUM_CACHE)

    def step(self, scheduler_output, publish: list[str]) -> tuple[list[str], dict[str, str]]:
        """The end of a scheduling step: what vLLM evicted goes out with what it took. Returns the
        step's ``publish`` list with the modality of each (a producer's pool events name it; none
        without events: the modality map is kept only where events are on)."""
        if self.publisher is None:
            return publish, {}
        for h in getattr(scheduler_output, "free_encoder_mm_hashes", None) or ():
            self.publisher.removed(h, S.MEDIUM_CACHE)
        self.publisher.flush()
        return publish, {h: self.modality.get(h) for h in publish}

    def finished(self, request) -> None:
        """Count what ``request``'s items cost (only those it got to: it may end before)."""
        if self.publisher is not None:
            for f in request.mm_features:
                self.modality.note(f.identifier, f.modality)
        seen = self._reqs.pop(request.request_id, None)
        if seen is None or not seen.needed and not seen.kv_hits:
            return
        done = int(getattr(request, "num_computed_tokens", 0) or 0)
        reached = [h for h, end in seen.needed.items() if end <= done]
        self.metrics.count("mm_kv_hits", seen.kv_hits)
        self.metrics.count("mm_items", len(reached))
        self.metrics.count("mm_cache_hits", sum(1 for h in reached if h not in seen.allocated))

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None


class PoolEvents:
    """A producer's pool table (``Published.listener``) as ``encoder_pool`` events."""

    def __init__(self, publisher: EventPublisher):
        self.publisher = publisher
        self.modality = _Modalities()

    def learn(self, modalities: dict[str, str]) -> None:
        for h, m in modalities.items():
            self.modality.note(h, m)

    def stored(self, desc: P.ItemDesc) -> None:
        self.publisher.stored(desc.mm_hash, self.modality.get(desc.mm_hash), desc.nbytes, S.MEDIUM_POOL)
        self.publisher.flush()

    def removed(self, mm_hash: str) -> None:
        self.publisher.removed(mm_hash, S.MEDIUM_POOL)
        self.publisher.flush()

    def close(self) -> None:
        self.publisher.close()
