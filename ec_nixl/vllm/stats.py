"""vLLM metrics for NixlECConnector: ``ECConnectorStats`` and Prometheus series.

``data`` is the plain dict of ``ec_nixl.metrics.Metrics.snapshot()`` (counters, per-transfer
samples in seconds, link modes) merged with scheduler-side counters; vLLM ships it msgpack'd
to the front-end process, where ``reduce()`` makes the periodic log line and ``NixlECPromMetrics``
feeds Prometheus with per-engine labels.
"""

from __future__ import annotations

import collections
import statistics
import threading
from typing import Any, Optional

from ec_nixl.metrics import COUNTERS, PHASES
import ec_nixl.vllm.hooks as hooks

if hooks.STATS:
    from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorPromMetrics, ECConnectorStats
else:  # vLLM 0.26: no connector stats anywhere; ours still aggregate (ec-nixl status reads them)
    from dataclasses import dataclass, field

    @dataclass
    class ECConnectorStats:  # type: ignore[no-redef]
        data: dict[str, Any] = field(default_factory=dict)

    class ECConnectorPromMetrics:  # type: ignore[no-redef]
        def __init__(self, *_args, **_kw):
            raise NotImplementedError("this vLLM has no EC connector Prometheus metrics (vLLM >= 0.32 has)")

_LISTS = ("xfer_s", "post_s", "sizes", "wait_s")


def empty_data() -> dict:
    return {"counters": {}, "xfer_s": [], "post_s": [], "sizes": [], "wait_s": [], "phases": {}, "link_modes": {},
            "link_gbps": {}, "link_mode_at": {}, "failure_reasons": {}, "pool": {}}


def _extend_capped(dst: list, src, cap: int) -> None:
    dst.extend(list(src or [])[:max(0, cap - len(dst))])


def merge_data(a: Optional[dict], b: Optional[dict], cap: int = 8192) -> dict:
    """Sum counters, concatenate samples (capped), union link modes."""
    out = empty_data()
    for src in (a, b):
        if not src:
            continue
        for k, v in (src.get("counters") or {}).items():
            out["counters"][k] = out["counters"].get(k, 0) + int(v)
        for k, v in (src.get("failure_reasons") or {}).items():
            out["failure_reasons"][k] = out["failure_reasons"].get(k, 0) + int(v)
        for k in _LISTS:
            _extend_capped(out[k], src.get(k), cap)
        for k, v in (src.get("phases") or {}).items():
            _extend_capped(out["phases"].setdefault(k, []), v, cap)
        out["link_modes"].update(src.get("link_modes") or {})
        out["link_gbps"].update(src.get("link_gbps") or {})
        out["link_mode_at"].update(src.get("link_mode_at") or {})
        out["pool"].update(src.get("pool") or {})  # latest occupancy per rank
    return out


class StatsBook:
    """A scheduler's counters and its workers', per interval (what vLLM takes with
    ``get_ec_connector_stats``, every step) and since start (what ``ec-nixl status`` shows: vLLM
    < 0.32 has no other place to show them). The totals are kept in place: counters summed, link
    modes and pool occupancy the latest, the last ``KEEP`` samples of each series with the count
    ever seen (so that a reader can take what came since its last look). Adding an interval costs
    what the interval holds, never what the totals hold. The endpoint's I/O thread reads the
    totals: one lock."""

    KEEP = 4096

    def __init__(self, metrics, intervals: bool = True) -> None:
        """``intervals``: vLLM takes intervals (>= 0.32); else workers' reports go straight to the totals."""
        self._metrics = metrics
        self._intervals = intervals
        self._lock = threading.Lock()
        self._workers: Optional[dict] = None  # reported since the last interval was taken
        self._totals = empty_data()
        self._seen: dict[str, int] = {}  # series -> samples ever added

    def add_workers(self, data: dict) -> None:
        with self._lock:
            if self._intervals:
                self._workers = merge_data(self._workers, data)
            else:
                self._add(data)

    def take_interval(self) -> dict:
        with self._lock:
            data = merge_data(self._metrics.snapshot(reset=True), self._workers)
            self._workers = None
            self._add(data)
        return data

    def totals(self) -> dict:
        """Everything since start (the scheduler's own interval not yet taken included), with
        ``seen``: how many samples each series ever had (its list holds the last ``KEEP``)."""
        with self._lock:
            pending = merge_data(self._metrics.snapshot(), self._workers)
            out = merge_data({**self._totals, **dict(self._series())}, pending, cap=2 * self.KEEP)
            seen = dict(self._seen)
        for k in _LISTS:
            seen[k] = seen.get(k, 0) + len(pending[k])
        for k, v in pending["phases"].items():
            seen[f"phase:{k}"] = seen.get(f"phase:{k}", 0) + len(v)
        out["seen"] = seen
        return out

    def _series(self):
        t = self._totals
        yield from ((k, list(t[k])) for k in _LISTS)
        yield "phases", {k: list(v) for k, v in t["phases"].items()}

    def _add(self, data: dict) -> None:
        t = self._totals
        for key in ("counters", "failure_reasons"):
            for k, v in (data.get(key) or {}).items():
                t[key][k] = t[key].get(k, 0) + int(v)
        for key in ("link_modes", "link_gbps", "link_mode_at", "pool"):
            t[key].update(data.get(key) or {})
        for k in _LISTS:
            self._keep(k, t, k, data.get(k))
        for k, v in (data.get("phases") or {}).items():
            self._keep(f"phase:{k}", t["phases"], k, v)

    def _keep(self, name: str, into: dict, key: str, samples) -> None:
        if not samples:
            return
        kept = into.get(key)
        if not isinstance(kept, collections.deque):
            kept = into[key] = collections.deque(kept or (), maxlen=self.KEEP)
        kept.extend(samples)
        self._seen[name] = self._seen.get(name, 0) + len(samples)


class NixlECConnectorStats(ECConnectorStats):
    def __init__(self, data: Optional[dict[str, Any]] = None):
        super().__init__(data=merge_data(data, None))

    def reset(self) -> None:
        self.data = empty_data()

    def aggregate(self, other: ECConnectorStats) -> "NixlECConnectorStats":
        if isinstance(other, ECConnectorStats) and other.data:
            self.data = merge_data(self.data, other.data)
        return self

    def is_empty(self) -> bool:
        d = self.data
        return not any(d["counters"].values()) and not any(d[k] for k in _LISTS) and not d["pool"] and \
            not any(d["phases"].values())

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        c = d["counters"]
        xfer = d["xfer_s"]
        out: dict[str, int | float] = {
            "num_transfers": c.get("transfers", 0),
            "num_failed_transfers": c.get("failed_transfers", 0),
            "loads_landed": c.get("loads_landed", 0),
            "loads_failed": c.get("loads_failed", 0),
            "local_fallbacks": c.get("local_fallbacks", 0),
            "late_fallbacks": c.get("late_fallbacks", 0),
            "admission_defers": c.get("admission_defers", 0),
            "prefetched": c.get("prefetched", 0),
            "expired_leases": c.get("expired_leases", 0),
            "staging_copies": c.get("staging_copies", 0),
            "reserve_waits": c.get("reserve_waits", 0),
            "reserve_failures": c.get("reserve_failures", 0),
            "resent": c.get("resent", 0),
        }
        if d["pool"]:
            out["pool_used_bytes"] = sum(int(r.get("used", 0)) for r in d["pool"].values())
        if xfer:
            total_bytes = sum(d["sizes"])
            total_s = sum(xfer)
            out["avg_xfer_ms"] = round(statistics.fmean(xfer) * 1e3, 3)
            out["p90_xfer_ms"] = round(sorted(xfer)[int(0.9 * (len(xfer) - 1))] * 1e3, 3)
            out["avg_post_ms"] = round(statistics.fmean(d["post_s"]) * 1e3, 3) if d["post_s"] else 0.0
            out["avg_mb_per_transfer"] = round(total_bytes / len(xfer) / 1e6, 3)
            out["throughput_gbps"] = round(total_bytes / total_s / 1e9, 3) if total_s > 0 else 0.0
        if d["wait_s"]:
            out["avg_barrier_ms"] = round(statistics.fmean(d["wait_s"]) * 1e3, 3)
        if c.get("admitted"):
            out["avg_admission_steps"] = round(c.get("admission_steps", 0) / c["admitted"], 2)
        for k in PHASES:
            if d["phases"].get(k):
                out[f"p50_{k}_ms"] = round(statistics.median(d["phases"][k]) * 1e3, 3)
        return out


_BUCKETS_S = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0)
_BYTES = (64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30)
_PROM_COUNTERS = {
    "failed_transfers": "vllm:nixl_ec_num_failed_transfers",
    "expired_leases": "vllm:nixl_ec_num_expired_leases",
    "admission_defers": "vllm:nixl_ec_num_admission_defers",
    "prefetch_defers": "vllm:nixl_ec_num_prefetch_defers",
    "prefetched": "vllm:nixl_ec_num_prefetched",
    "local_fallbacks": "vllm:nixl_ec_num_local_fallbacks",
    "late_fallbacks": "vllm:nixl_ec_num_late_fallbacks",
    "loads_failed": "vllm:nixl_ec_num_failed_loads",
    "loads_landed": "vllm:nixl_ec_num_loads_landed",
    "transfers": "vllm:nixl_ec_num_transfers",
    "staging_copies": "vllm:nixl_ec_num_staging_copies",
    "quarantined": "vllm:nixl_ec_num_quarantined",
    "reserve_waits": "vllm:nixl_ec_num_reserve_waits",
    "reserve_failures": "vllm:nixl_ec_num_reserve_failures",
    "admitted": "vllm:nixl_ec_num_admitted",
    "admission_steps": "vllm:nixl_ec_num_admission_steps",
    "early_admissions": "vllm:nixl_ec_num_early_admissions",
    "early_reverted": "vllm:nixl_ec_num_early_reverted",
    "unplaced_loads": "vllm:nixl_ec_num_unplaced_loads",
    "expected_items": "vllm:nixl_ec_num_expected_items",
    "resent": "vllm:nixl_ec_num_resent",
    "encoded": "vllm:nixl_ec_num_encoded",
    "mm_items": "vllm:nixl_ec_num_mm_items",
    "mm_kv_hits": "vllm:nixl_ec_num_mm_kv_hits",
    "mm_cache_hits": "vllm:nixl_ec_num_mm_cache_hits",
    "cache_route_misses": "vllm:nixl_ec_num_cache_route_misses",
}


class NixlECPromMetrics(ECConnectorPromMetrics):
    """Histograms of transfer/post time, bytes and descriptors; counters of failures and more."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        H, C, G = self._histogram_cls, self._counter_cls, self._gauge_cls
        self._xfer = self._per_engine(H(name="vllm:nixl_ec_xfer_time_seconds", documentation="EC transfer time",
                                        buckets=_BUCKETS_S, labelnames=labelnames))
        self._post = self._per_engine(H(name="vllm:nixl_ec_post_time_seconds", documentation="EC transfer post time",
                                        buckets=_BUCKETS_S, labelnames=labelnames))
        self._bytes = self._per_engine(H(name="vllm:nixl_ec_bytes_transferred", documentation="bytes per EC transfer",
                                         buckets=_BYTES, labelnames=labelnames))
        self._wait = self._per_engine(H(name="vllm:nixl_ec_barrier_wait_seconds",
                                        documentation="load barrier wait per step", buckets=_BUCKETS_S,
                                        labelnames=labelnames))
        phase = H(name="vllm:nixl_ec_phase_seconds", documentation="a request's control-path phases (admit, "
                  "hold_rtt, hold_seen, place_wait, publish)", buckets=_BUCKETS_S, labelnames=[*labelnames, "phase"])
        self._phases = {idx: {k: phase.labels(*vals, k) for k in PHASES}
                        for idx, vals in self.per_engine_labelvalues.items()}
        self._counters = {k: self._per_engine(C(name=n, documentation=f"EC {k.replace('_', ' ')}",
                                                labelnames=labelnames)) for k, n in _PROM_COUNTERS.items()}
        self._pool = self._per_engine(G(name="vllm:nixl_ec_pool_used_bytes",
                                        documentation="bytes of the registered pool in use (all ranks)",
                                        labelnames=labelnames, multiprocess_mode="mostrecent"))
        self._mode = self._per_engine(G(name="vllm:nixl_ec_link_read_mode",
                                        documentation="1 if the last link chose READ, 0 if WRITE",
                                        labelnames=labelnames, multiprocess_mode="mostrecent"))

    def _per_engine(self, metric):
        return {idx: metric.labels(*vals) for idx, vals in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        d = merge_data(transfer_stats_data, None)
        for v in d["xfer_s"]:
            self._xfer[engine_idx].observe(v)
        for v in d["post_s"]:
            self._post[engine_idx].observe(v)
        for v in d["sizes"]:
            self._bytes[engine_idx].observe(v)
        for v in d["wait_s"]:
            self._wait[engine_idx].observe(v)
        for k, samples in d["phases"].items():
            m = self._phases[engine_idx].get(k)
            for v in samples if m is not None else ():
                m.observe(v)
        for k, m in self._counters.items():
            n = d["counters"].get(k, 0)
            if n:
                m[engine_idx].inc(n)
        if d["pool"]:
            self._pool[engine_idx].set(sum(int(r.get("used", 0)) for r in d["pool"].values()))
        if d["link_modes"]:
            self._mode[engine_idx].set(1 if list(d["link_modes"].values())[-1] == "read" else 0)


__all__ = ["NixlECConnectorStats", "NixlECPromMetrics", "StatsBook", "merge_data", "empty_data", "COUNTERS"]
