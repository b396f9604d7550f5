"""Transfer statistics of one endpoint: plain data, safe to ship between processes.

The endpoint records every finished transfer and every notable event here; the vLLM adapter
turns ``snapshot()`` into ``ECConnectorStats`` and Prometheus series. Values are lists of
numbers and dicts of counters only, so they serialise with msgpack as vLLM requires.
"""

from __future__ import annotations

import threading
from collections import Counter

COUNTERS = (
    "transfers",
    "failed_transfers",
    "bytes",
    "descriptors",
    "loads_landed",
    "loads_failed",
    "published",
    "staging_copies",
    "staging_bytes",
    "expired_leases",
    "expired_pins",
    "quarantined",
    "nacks",
    "retries",
    "admission_defers",
    "prefetch_defers",
    "prefetched",
    "local_fallbacks",
    "late_fallbacks",  # of local_fallbacks: loads that failed after admission, encoded in the same step
    "reclaimed_sessions",  # producer: sessions ended because their consumer's connection went away
    "reserve_waits",  # producer: publishes/reserves that waited for space on its way back
    "reserve_failures",  # producer: publishes/reserves that failed for space (PoolExhausted)
    "admitted",  # consumer scheduler: requests with remote items admitted
    "admission_steps",  # consumer scheduler: engine steps those requests waited from first sight
    "early_admissions",  # consumer scheduler: of admitted, admitted before their Holds answered
    "early_reverted",  # consumer scheduler: early items a Hold refused before they were scheduled (gated again)
    "unplaced_loads",  # consumer scheduler: early loads over READ links sent without a place (the workers Get it)
    "holds_parked",  # producer: Holds and Gets that waited for items not published yet (wait_s)
    "pushes_parked",  # producer: Pushes that waited for items not published yet (Push.wait_s)
    "native_pushes",  # producer: of their items, WRITEs the publish started off the GIL (native_handoff)
    "native_answers",  # producer: parked Holds and Gets the publish answered off the GIL (native_answers)
    "native_answers_unsent",  # producer: of those, sends that could not go (answered from Python instead)
    "publish_wakes",  # producer: publishes that woke the I/O thread for waiting requests (none: all native)
    "expected_items",  # consumer scheduler: items asked for before their encoder finished (ec_nixl_expect)
    "malformed_reports",  # consumer scheduler (vLLM < 0.32): workers' step reports dropped (report_channel)
    "encoded",  # scheduler: items vLLM scheduled for this engine's own encoder (E: its encodes; PD: local ones)
    "mm_items",  # consumer scheduler: items its requests needed when first seen (not in the prefix cache)
    "mm_kv_hits",  # consumer scheduler: items already covered by the prefix (KV) cache when first seen
    "mm_cache_hits",  # consumer scheduler: of mm_items, found in vLLM's encoder cache (neither loaded nor encoded)
    "cache_route_misses",  # scheduler: items a cache-aware router sent here as held that were not (ec_nixl_route)
)

PHASES = (
    "admit",  # consumer scheduler: a request's first sight -> admitted (remote items only)
    "hold_rtt",  # consumer scheduler: Hold sent -> its answer received
    "expect_wait",  # consumer scheduler: Hold for items not yet encoded sent -> answered (they were published)
    "hold_seen",  # consumer scheduler: Hold sent -> its answer used by a scheduling step
    "place_wait",  # consumer scheduler: a step's wait for the Holds of its early-admitted loads
    "publish",  # producer worker: a step's outputs pinned (flush_publish)
    "push_post",  # producer: a Push read and its item published (the later) -> its WRITE posted from Python
)
"""Named durations of a request's control path, sampled per occurrence (seconds): together with
the transfer (``xfer_s``) and the barrier (``wait_s``) they say where a request's time goes."""


class Metrics:
    """Counters plus per-transfer samples (seconds), reset on ``snapshot(reset=True)``."""

    def __init__(self, max_samples: int = 4096):
        self._lock = threading.Lock()
        self._max = max_samples
        self._reset()
        self.link_modes: dict[str, str] = {}
        self.link_gbps: dict[str, float] = {}  # producer address -> the link probe's GB/s
        self.link_mode_at: dict[str, str] = {}  # producer address -> the mode its link uses ("read" | "write")

    def _reset(self) -> None:
        self.counters: Counter = Counter()
        self.xfer_s: list[float] = []
        self.post_s: list[float] = []
        self.sizes: list[int] = []
        self.wait_s: list[float] = []
        self.phases: dict[str, list[float]] = {}
        self.reasons: Counter = Counter()

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def fail(self, reason: str) -> None:
        with self._lock:
            self.reasons[reason] += 1

    def transfer(self, nbytes: int, post_s: float, xfer_s: float, descs: int = 1) -> None:
        with self._lock:
            c = self.counters
            c["transfers"] += 1
            c["bytes"] += nbytes
            c["descriptors"] += descs
            if len(self.xfer_s) < self._max:
                self.xfer_s.append(xfer_s)
                self.post_s.append(post_s)
                self.sizes.append(nbytes)

    def wait(self, seconds: float) -> None:
        """One barrier wait (every step's hand-over calls it): no lock, one ``list.append``,
        atomic under the GIL; a ``snapshot(reset=True)`` racing it loses at most this sample."""
        samples = self.wait_s
        if len(samples) < self._max:
            samples.append(seconds)

    def phase(self, name: str, seconds: float) -> None:
        """One sample of control-path phase ``name`` (one of ``PHASES``)."""
        with self._lock:
            samples = self.phases.setdefault(name, [])
            if len(samples) < self._max:
                samples.append(seconds)

    def snapshot(self, reset: bool = False) -> dict:
        with self._lock:
            snap = {
                "counters": {k: int(self.counters.get(k, 0)) for k in COUNTERS},
                "failure_reasons": dict(self.reasons),
                "xfer_s": list(self.xfer_s),
                "post_s": list(self.post_s),
                "sizes": list(self.sizes),
                "wait_s": list(self.wait_s),
                "phases": {k: list(v) for k, v in self.phases.items()},
                "link_modes": dict(self.link_modes),
                "link_gbps": dict(self.link_gbps),
                "link_mode_at": dict(self.link_mode_at),
            }
            if reset:
                self._reset()
            return snap
