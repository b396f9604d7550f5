"""What the scheduler does itself where vLLM lacks a hook (vLLM < 0.32; the table is in ``hooks``).

* No worker meta reaches ``update_connector_output``: the workers' reports come over
  ``report_channel`` instead, drained once per step; one that does not decode or apply is dropped,
  logged and counted (``malformed_reports``), never raised into vLLM's step.
* No ``update_state_after_free``: ``CommitWatch`` reads from each step the scheduler builds which
  loaded items that step commits to the KV cache. vLLM 0.32+ calls the hook once the step that
  computed an item's last placeholder token has run, and the consumer then gives the item's pool
  slot back; without it a slot would stay taken until vLLM evicted the item from its encoder
  cache. The release goes out with the next step's metadata (after this step's gather: the
  workers run the steps in order).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from ec_nixl.metrics import Metrics
import ec_nixl.vllm.hooks as hooks
from ec_nixl.vllm.metadata import NixlECWorkerMeta
from ec_nixl.vllm.options import Placement

logger = logging.getLogger("ec_nixl.vllm")


class CommitWatch:
    """Loads not yet committed to the KV cache: (request id, item index) -> (request, end token)."""

    def __init__(self) -> None:
        self._open: dict[tuple[str, int], tuple[Any, int]] = {}

    def __bool__(self) -> bool:
        return bool(self._open)

    def watch(self, request, index: int) -> None:
        pos = request.mm_features[index].mm_position
        self._open[(request.request_id, index)] = (request, pos.offset + pos.length)

    def committed_by(self, scheduler_output) -> list[tuple[Any, int]]:
        """The watched items whose last placeholder token this step computes; no longer watched.
        Read before vLLM advances the requests' computed tokens (at ``build_connector_meta``)."""
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        done = []
        for key, (request, end) in list(self._open.items()):
            n = scheduled.get(key[0])
            if n and request.num_computed_tokens + n >= end:
                del self._open[key]
                done.append((request, key[1]))
        return done

    def forget(self, request) -> list[int]:
        """The request ended: the indexes of its items still watched (their slots go back now)."""
        return [i for i in range(len(request.mm_features)) if self._open.pop((request.request_id, i), None)]


class SchedulerStandIns:
    """The scheduler's stand-ins for the hooks this vLLM lacks (each a no-op where it has them)."""

    def __init__(self, place: Placement, metrics: Metrics):
        self._metrics = metrics
        self._malformed = 0  # of the inbox's, counted already
        self._inbox = None
        if place.is_consumer and not hooks.WORKER_REPORTS:
            from ec_nixl.vllm.report_channel import ReportInbox

            self._inbox = ReportInbox(place.engine_id, place.dp_rank, place.base_port)
        self._watch: Optional[CommitWatch] = None if hooks.FREE_HOOK else CommitWatch()
        self._committed: list[tuple[Any, int]] = []  # by the last step built

    def take_reports(self, apply: Callable[[NixlECWorkerMeta], None]) -> None:
        """``apply`` each of the workers' reports sent since the last step. A report that does not
        decode (the inbox's count) or whose ``apply`` raises (a stats entry of the wrong type) is
        dropped and counted: the scheduler's step goes on."""
        if self._inbox is None:
            return
        bad = 0
        for report in self._inbox.drain():
            try:
                apply(report)
            except Exception as e:  # noqa: BLE001  (a worker's report must never stop the scheduler)
                bad += 1
                logger.warning("ec-nixl: dropped a worker report the scheduler could not apply: %r", e)
        bad += self._inbox.malformed - self._malformed
        self._malformed = self._inbox.malformed
        if bad:
            self._metrics.count("malformed_reports", bad)

    def loaded(self, request, index: int) -> None:
        if self._watch is not None:
            self._watch.watch(request, index)

    def before_step(self, scheduler_output, apply_report: Callable[[NixlECWorkerMeta], None],
                    release: Callable[[Any, int], None]) -> None:
        """At the start of ``build_connector_meta``: ``apply_report`` each worker report that came
        since the last step (``take_reports``), and ``release(request, index)`` each load the
        previous step committed (released with this step's metadata); this step's are noted for
        the next."""
        self.take_reports(apply_report)
        out, self._committed = self._committed, (self._watch.committed_by(scheduler_output) if self._watch else [])
        for request, index in out:
            release(request, index)

    def finished(self, request, release: Callable[[Any, int], None]) -> None:
        """The request ended: its loads not released yet (committed or not) are released now."""
        rid = request.request_id
        done = [i for r, i in self._committed if r.request_id == rid]
        self._committed = [(r, i) for r, i in self._committed if r.request_id != rid]
        for index in done + (self._watch.forget(request) if self._watch else []):
            release(request, index)

    def close(self) -> None:
        if self._inbox is not None:
            self._inbox.close()
            self._inbox = None
