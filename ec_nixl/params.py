"""The request-level ``ec_transfer_params`` keys ec-nixl reads and writes (no vLLM import: the proxy
uses them too; ``vllm.metadata`` parses the per-item entries against the request).

* per item, under ``PARAMS_KEY``: where a finished encoder output is and what it is (the encoder's
  answer carries them; the proxy forwards them to the PD);
* at the top level, ``EXPECT_KEY``: the request reached the PD while its encoder was still running
  at the named producer (the proxy's overlapped flow); every item of it will be published there;
* at the top level, ``ROUTE_KEY``: the items a cache-aware router sent this instance because its
  encoder-cache events said it holds them (an engine that has to encode one counts a misroute).
"""

from __future__ import annotations

from typing import Any, Optional

from ec_nixl.config import split_address
from ec_nixl.errors import ECNixlError

PARAMS_KEY = "ec_nixl"
PARAMS_VERSION = 1
EXPECT_KEY = "ec_nixl_expect"
ROUTE_KEY = "ec_nixl_route"
MAX_ROUTED_ITEMS = 4096


def build_expect(producer: str) -> dict:
    """``ec_transfer_params`` for a request whose encoder is still running at ``producer``."""
    return {EXPECT_KEY: {"v": PARAMS_VERSION, "producer": producer}}


def parse_expect(params: Any) -> tuple[Optional[str], str]:
    """The producer an ``ec_nixl_expect`` entry names (None when there is none), or why it is bad."""
    if not isinstance(params, dict) or EXPECT_KEY not in params:
        return None, ""
    c = params[EXPECT_KEY]
    try:
        if not isinstance(c, dict) or c.get("v") != PARAMS_VERSION:
            raise ECNixlError(f"{EXPECT_KEY} must be an object with v={PARAMS_VERSION}")
        producer = c.get("producer")
        if not isinstance(producer, str):
            raise ECNixlError(f"{EXPECT_KEY}.producer (str) is required")
        split_address(producer)
        return producer, ""
    except ECNixlError as e:
        return None, f"bad {EXPECT_KEY}: {e}"


def announced_producer(params: Any) -> Optional[str]:
    """The producer an encoder's answer announces its items at (the first item's), if any."""
    if not isinstance(params, dict):
        return None
    for entry in params.values():
        c = entry.get(PARAMS_KEY) if isinstance(entry, dict) else None
        if isinstance(c, dict) and isinstance(c.get("producer"), str):
            return c["producer"]
    return None


def build_route(held: list[str]) -> dict:
    """``ec_transfer_params`` entry naming the items a router believes this instance holds."""
    return {ROUTE_KEY: {"v": PARAMS_VERSION, "held": list(held)}}


def parse_route(params: Any) -> tuple[frozenset[str], str]:
    """The items ``ROUTE_KEY`` names, or why the entry is bad (it only feeds a counter: a bad one
    is reported and ignored, the request goes on)."""
    if not isinstance(params, dict) or ROUTE_KEY not in params:
        return frozenset(), ""
    c = params[ROUTE_KEY]
    held = c.get("held") if isinstance(c, dict) and c.get("v") == PARAMS_VERSION else None
    if not isinstance(held, list) or len(held) > MAX_ROUTED_ITEMS or not all(isinstance(h, str) for h in held):
        return frozenset(), (f"bad {ROUTE_KEY}: expected {{'v': {PARAMS_VERSION}, 'held': [up to "
                             f"{MAX_ROUTED_ITEMS} mm hashes]}}")
    return frozenset(held), ""
