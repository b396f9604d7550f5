"""What the consumer's workers reported of a step, applied to the scheduler's requests.

A load that did not land either failed its request (no media to encode, or ``fallback`` 'fail')
or was encoded by the worker in the same step (a late fallback). Both make the scheduler distrust
the item's producer for a while (no early admissions from it). Kept apart from the scheduler
delegate: this is the one place the workers' outcome changes a request's state.
"""

from __future__ import annotations

import logging
from typing import Any

from ec_nixl.metrics import Metrics
from ec_nixl.vllm.metadata import NixlECWorkerMeta
from ec_nixl.vllm.poisoned import PoisonedEntries
from ec_nixl.vllm.producers import ProducerView

logger = logging.getLogger("ec_nixl.vllm")


def apply(m: NixlECWorkerMeta, reqs: dict[str, Any], producers: ProducerView, metrics: Metrics,
          poisoned: PoisonedEntries) -> set[str]:
    """Apply ``m`` to ``reqs`` (request id -> its admission) and to the encoder-cache entries that
    hold a failed load's placeholder; returns the requests that failed (with those that shared it)."""
    for _, req_id, h, _ in m.failed + m.rerouted:
        adm = reqs.get(req_id)
        it = adm.items.get(h) if adm is not None else None
        if it is not None:  # its producer gets no early admissions for a while
            producers.distrust(it.remote.producer)
    failed = set()
    for rank, req_id, h, why in m.failed:
        logger.error("request %s failed: encoder output %s did not land on rank %d: %s", req_id, h, rank, why)
        failed.add(req_id)
        adm = reqs.get(req_id)
        if adm is not None and not adm.failed:
            # vLLM takes the unavailable requests before it reads this output, so the request
            # is failed one step later; until then ensure_cache_available keeps it from being
            # scheduled again (no further tokens computed from the placeholder).
            adm.failed = f"encoder output {h} did not land on rank {rank}: {why}"
    for (req_id, h), why in {(r, h): why for _, r, h, why in m.rerouted}.items():  # once, whatever the ranks
        logger.warning("request %s: encoder output %s did not land (%s); encoded locally in the same step",
                       req_id, h, why)
        adm = reqs.get(req_id)
        if adm is not None and h in adm.items:
            adm.items[h].status = "local"
        metrics.count("local_fallbacks")
        metrics.count("late_fallbacks")
    return failed | poisoned.reported(m)
