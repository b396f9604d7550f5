"""Which EC connector hooks the running vLLM has and calls: the adapter's feature detection, in one place.

vLLM 0.32+ (the API the adapter is written against) and vLLM 0.26 (the newest that pins torch
2.11, the lent GPU's) differ in these hooks; everything else the adapter uses is the same:

=============================  =====  ======  =============================================================
hook (vLLM calls it ...)       0.26   0.32+   on 0.26 the adapter ...
=============================  =====  ======  =============================================================
start_worker_services          no     yes     starts the worker's endpoint when vLLM creates the connector,
                                              and counts a VRAM pool inside gpu_memory_utilization itself
start_save_caches              no     yes     publishes again (encoder-cache hits) at get_finished instead
update_state_after_free        no     yes     releases a loaded item's slot once the step that computes
                                              its last placeholder token has run (``CommitWatch``)
worker meta -> scheduler       no     yes     sends the workers' reports over its own local socket
(update_connector_output)                     (``report_channel``)
take_unavailable_requests      no     yes     cannot fail a request: ``fallback: fail`` is refused at start
                                              (0.26 has no metadata-only items, so every item can be encoded)
metadata-only items            no     yes     nothing: every item carries its media; announcements carry
(collect_ec_item_metadata)                    no ``metadata`` entry (no consumer of this vLLM could use one)
ECConnectorStats / Prometheus  no     yes     nothing in vLLM's log or /metrics; ``ec-nixl status`` reads
                                              the same counters from the instance's ``ec_port``
encoder output widths          no     yes     uses the LM's embedding size (right for Qwen2/2.5-VL; where
                                              the encoder's output is wider, the shapes disagree at the
                                              consumer's Hold and PD encodes the item itself)
Model Runner V2's EC wrapper   no     yes     nothing: vLLM 0.26 runs every EC instance on the V1 runner
encode-only config             no     yes     turns prefix caching off in an encode-only instance (0.26's
(is_mm_encoder_only)                          scheduler cannot build it over no KV cache groups)
=============================  =====  ======  =============================================================
"""

from __future__ import annotations

import importlib.util

from vllm.distributed.ec_transfer.ec_connector import base as _base

_Base = _base.ECConnectorBase

WORKER_SERVICES = hasattr(_Base, "start_worker_services")
"""vLLM starts the workers' services after loading the model, before its memory profiling."""

SAVE_PREP = hasattr(_Base, "start_save_caches")
"""Producers get a hook before the encoder runs (where items cached earlier are published again)."""

FREE_HOOK = hasattr(_Base, "update_state_after_free")
"""The scheduler says when an item's embeddings are in the KV cache."""

WORKER_REPORTS = hasattr(_base, "ECConnectorWorkerMetadata")
"""Workers' ``build_connector_worker_meta`` reaches the scheduler's ``update_connector_output``."""

FAILS_REQUESTS = hasattr(_Base, "take_unavailable_requests")
"""The connector can end a request with an error (vLLM finishes it as FINISHED_ERROR)."""

STATS = importlib.util.find_spec("vllm.distributed.ec_transfer.ec_connector.metrics") is not None
"""``ECConnectorStats`` and ``ECConnectorPromMetrics`` exist (vLLM's log line and /metrics)."""

METADATA_ONLY = importlib.util.find_spec("vllm.distributed.ec_transfer.ec_connector.utils") is not None
"""A consumer accepts items without their media (a router's placeholders, ``allow_missing_mm_embeddings``),
described by ``collect_ec_item_metadata``; without it every item a consumer sees carries its media."""

MRV2_EC = importlib.util.find_spec("vllm.v1.worker.gpu.ec_connector") is not None
"""Model Runner V2 has its EC wrapper (without it vLLM runs EC instances on the V1 runner)."""

WorkerMetadataBase = getattr(_base, "ECConnectorWorkerMetadata", object)
"""What ``NixlECWorkerMeta`` derives from (a plain object where vLLM has no such type)."""


def missing() -> list[str]:
    """The hooks this vLLM lacks, by name (empty on 0.32+), for the start-up log line."""
    names = {"start_worker_services": WORKER_SERVICES, "start_save_caches": SAVE_PREP,
             "update_state_after_free": FREE_HOOK, "worker reports": WORKER_REPORTS,
             "take_unavailable_requests": FAILS_REQUESTS, "connector stats": STATS,
             "metadata-only items": METADATA_ONLY}
    return [n for n, has in names.items() if not has]
