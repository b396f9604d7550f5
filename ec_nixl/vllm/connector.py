"""NixlECConnector: the vLLM ``ECConnectorBase`` subclass, a thin router by role.

vLLM builds the connector twice per engine: once in the EngineCore (role SCHEDULER) and once in
every worker rank (role WORKER). Each hook goes to the delegate of its role
(``scheduler.SchedulerSide`` or ``worker.WorkerSide``). On a vLLM that lacks some hooks
(``hooks``: 0.26), the call that stands in for each is made here, from the hook vLLM does call.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorMetadata, ECConnectorRole

from ec_nixl.errors import ConfigError
import ec_nixl.vllm.hooks as hooks
from ec_nixl.vllm.metadata import NixlECMetadata
from ec_nixl.vllm.options import parse_extra, placement
from ec_nixl.vllm.stats import NixlECConnectorStats, NixlECPromMetrics

logger = logging.getLogger("ec_nixl.vllm")


def _log_like_vllm() -> None:
    """Send ec_nixl's records through vLLM's handlers (vLLM configures only its own logger)."""
    ours, theirs = logging.getLogger("ec_nixl"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        src = theirs.handlers[0]
        h = logging.StreamHandler(getattr(src, "stream", None))  # same stream and format as vLLM's,
        h.setFormatter(src.formatter)  # but our own level (EC_NIXL_LOG_LEVEL, default vLLM's)
        ours.addHandler(h)
        ours.setLevel(os.environ.get("EC_NIXL_LOG_LEVEL", "").upper() or theirs.getEffectiveLevel())
        ours.propagate = False


class NixlECConnector(ECConnectorBase):
    def __init__(self, vllm_config, role: ECConnectorRole):
        super().__init__(vllm_config=vllm_config, role=role)
        _log_like_vllm()
        ec = vllm_config.ec_transfer_config
        self.opts = parse_extra(ec.ec_connector_extra_config)
        if not hooks.FAILS_REQUESTS and self.opts.fallback != "auto":
            raise ConfigError(f"fallback {self.opts.fallback!r} needs a vLLM that can fail a request from its EC "
                              "connector (take_unavailable_requests, vLLM >= 0.32); this vLLM has no such hook: use "
                              "fallback 'auto' (every item of this vLLM carries its media and can be encoded here)")
        self.scheduler = self.worker = None
        if role == ECConnectorRole.SCHEDULER:
            from ec_nixl.vllm.scheduler import SchedulerSide

            self.scheduler = SchedulerSide(vllm_config, self.opts, placement(vllm_config, worker=False))
            cache = vllm_config.cache_config
            if self.is_producer and not self.is_consumer and cache.enable_prefix_caching:
                # An encode-only instance has no KV cache. vLLM >= 0.32 turns prefix caching off
                # for it; 0.26 keeps it on, and its scheduler, which creates this connector just
                # before its KV cache manager, then fails to build a prefix-caching manager over
                # no KV cache groups (HybridKVCacheCoordinator's assertion).
                logger.info("NixlECConnector: prefix caching off in this encode-only instance (it has no KV cache)")
                cache.enable_prefix_caching = False
        else:
            from ec_nixl.vllm.worker import WorkerSide

            self.worker = WorkerSide(vllm_config, self.opts, placement(vllm_config, worker=True))
            if not hooks.WORKER_SERVICES:
                # vLLM < 0.32 never calls start_worker_services. It creates this connector after
                # setting the worker's device and before its memory snapshot: start here, and keep
                # a VRAM pool inside gpu_memory_utilization (vLLM >= 0.32 counts it itself).
                logger.info("NixlECConnector: this vLLM lacks %s; ec-nixl stands in for them (ec_nixl.vllm.hooks)",
                            ", ".join(hooks.missing()))
                self.worker.start_services()
                self.worker.count_pool_in_budget()

    def _meta(self) -> NixlECMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, NixlECMetadata), type(meta)
        return meta

    # ---------------------------------------------------------------- worker hooks

    def start_worker_services(self) -> None:
        if self.worker is not None:
            self.worker.start_services()

    def start_save_caches(self, **kwargs: Any) -> None:
        cache = kwargs.get("encoder_cache")
        if self.worker is not None and cache is not None:
            self.worker.start_save_caches(cache, self._meta())

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs) -> None:
        if self.worker is not None and self.is_producer:
            self.worker.save_caches(encoder_cache, mm_hash)

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs) -> None:
        if self.worker is not None and self.is_consumer:
            self.worker.start_load_caches(encoder_cache, self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        if self.worker is not None:
            meta = self._connector_metadata
            if not hooks.SAVE_PREP and self.is_producer and isinstance(meta, NixlECMetadata):
                self.worker.publish_again(meta)  # vLLM < 0.32: no start_save_caches
            self.worker.get_finished()
            if not hooks.WORKER_REPORTS:
                self.worker.send_report()  # vLLM < 0.32: no worker meta to the scheduler
        return None, None

    def build_connector_worker_meta(self):
        return self.worker.worker_meta() if self.worker is not None else None

    # ---------------------------------------------------------------- scheduler hooks

    def has_cache_item(self, identifier: str) -> bool:
        return self.scheduler is not None and self.scheduler.has_cache_item(identifier)

    def ensure_cache_available(self, request, num_computed_tokens: int) -> bool:
        return self.scheduler is None or self.scheduler.ensure_cache_available(request, num_computed_tokens)

    def update_state_after_alloc(self, request, index: int) -> None:
        if self.scheduler is not None:
            self.scheduler.update_state_after_alloc(request, index)

    def update_state_after_free(self, request, index: int) -> None:
        if self.scheduler is not None:
            self.scheduler.update_state_after_free(request, index)

    def build_connector_meta(self, scheduler_output) -> ECConnectorMetadata:
        if self.scheduler is None:
            return NixlECMetadata()
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        if self.scheduler is not None:
            self.scheduler.update_connector_output(connector_output)

    def take_unavailable_requests(self) -> set[str]:
        return self.scheduler.take_unavailable_requests() if self.scheduler is not None else set()

    def request_finished(self, request) -> tuple[bool, Optional[dict[str, Any]]]:
        if self.scheduler is None:
            return False, None
        return self.scheduler.request_finished(request)

    def has_pending_push_work(self) -> bool:
        return False  # producers serve from their own I/O thread: no engine steps needed

    # ---------------------------------------------------------------- both

    def get_ec_connector_stats(self):
        return self.scheduler.get_stats() if self.scheduler is not None else None

    def shutdown(self) -> None:
        for side in (self.scheduler, self.worker):
            if side is not None:
                side.shutdown()

    @classmethod
    def build_ec_connector_stats(cls, data: Optional[dict[str, Any]] = None):
        return NixlECConnectorStats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return NixlECPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
