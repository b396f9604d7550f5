"""The events' keys in ``ec_connector_extra_config`` and where each publisher of an engine binds.

An engine has one publisher per thing it can describe: its scheduler's (vLLM's encoder cache,
every role) and, on an Encode instance, its serving worker's (the registered pool). Each takes
two ports, PUB then replay, from ``events_port``: DP rank ``d``'s scheduler publisher binds
``events_port + 4d`` (+1), its pool publisher ``events_port + 4d + 2`` (+3). Subscribers find the
replay socket at PUB + 1 (``subscriber.parse_source``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ec_nixl.errors import ConfigError
from ec_nixl.events import schema as S

DEFAULT_PORT_OFFSET = 1000
"""``events_port`` 0 means ``ec_port`` + this."""
PORTS_PER_DP_RANK = 4


@dataclass
class EventsConfig:
    """Every ``events*`` key of ``ec_connector_extra_config`` (docs/events.md)."""

    events: bool = False
    """Publish this instance's encoder-cache events (``ec-nixl serve-disagg`` turns it on)."""
    events_port: int = 0
    """First port of this instance's publishers (0: ``ec_port`` + 1000); see the module docstring."""
    events_host: Optional[str] = None
    """Where the publishers bind (default ``ec_ip``; 0.0.0.0 for every interface)."""
    events_instance: Optional[str] = None
    """The serving address every batch names (default ``ec_ip:ec_port``): set it to the URL a router
    sends this instance its requests at (serve-disagg does)."""
    events_topic: str = "ec-nixl"
    events_buffer_batches: int = 10_000
    """Batches kept for replay (vLLM's ``buffer_steps``)."""
    events_hwm: int = 100_000
    """ZMQ high-water mark of the PUB socket: messages a slow subscriber may lag before they drop."""
    events_heartbeat_s: float = 1.0
    """An idle publisher says it is alive this often (subscribers drop it after a few missed)."""
    events_batch_s: float = 0.05
    """While changes keep coming, one batch per this (0: one per engine step, sent from the engine's
    thread); the index lags the engine by this at most, and the cost follows it (``publisher``)."""

    def __post_init__(self) -> None:
        if not 0 <= self.events_port < 65536 - PORTS_PER_DP_RANK:
            raise ConfigError(f"events_port must be in 0..{65535 - PORTS_PER_DP_RANK}, got {self.events_port}")
        if self.events_buffer_batches < 1 or self.events_hwm < 1:
            raise ConfigError("events_buffer_batches and events_hwm must be >= 1")
        if not self.events_heartbeat_s > 0:
            raise ConfigError(f"events_heartbeat_s must be > 0, got {self.events_heartbeat_s}")
        if not 0 <= self.events_batch_s <= 1:
            raise ConfigError(f"events_batch_s must be within 0..1 s, got {self.events_batch_s}")
        if self.events_instance is not None and not 0 < len(self.events_instance) <= S.MAX_KEY_LEN:
            raise ConfigError(f"events_instance must be 1..{S.MAX_KEY_LEN} characters")


def publisher_ports(cfg: EventsConfig, ec_port: int, dp_rank: int, medium: str) -> tuple[int, int]:
    """(PUB, replay) ports of the publisher of ``medium`` of DP rank ``dp_rank``."""
    base = cfg.events_port or ec_port + DEFAULT_PORT_OFFSET
    pub = base + PORTS_PER_DP_RANK * dp_rank + (2 if medium == S.MEDIUM_POOL else 0)
    if pub + 1 > 65535:
        raise ConfigError(f"events port {pub + 1} is out of range (events_port {cfg.events_port}, ec_port {ec_port})")
    return pub, pub + 1
