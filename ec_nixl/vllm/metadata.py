"""What crosses process boundaries in vLLM: ec_transfer_params, step metadata, worker reports.

* ``ec_transfer_params`` (producer response -> proxy -> consumer request): per item, vLLM's own
  ``collect_ec_item_metadata`` entry with our coordinates merged under the ``"ec_nixl"`` key, so
  orchestrators that only forward the dict keep working. ``parse_params`` treats it as hostile
  input: every field is type- and range-checked against the request it arrived with.
* ``NixlECMetadata`` (scheduler -> workers, pickled by vLLM): the loads of this step, and the
  step's ``SchedulerOutput`` itself (pickled with it, so a worker holds the very object its model
  runner reads: a load that fails can be added to the step's encoder inputs, see ``worker``).
* ``NixlECWorkerMeta`` (workers -> scheduler): per-rank landed/failed/re-encoded items and
  transfer stats.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorMetadata

from ec_nixl import protocol as P
from ec_nixl.config import split_address
from ec_nixl.errors import ECNixlError
from ec_nixl.params import PARAMS_KEY, PARAMS_VERSION
from ec_nixl.vllm.hooks import WorkerMetadataBase

@dataclass(frozen=True)
class RemoteItem:
    """A consumer's view of one announced item: what it is and who holds it."""

    desc: P.ItemDesc
    producer: str


@dataclass
class LoadSpec:
    """One item a worker must have in its encoder cache by the end of start_load_caches."""

    req_id: str
    desc: P.ItemDesc
    producer: str
    block: int
    valid_until: float
    incarnation: str = ""  # of the producer that held it: loaded from that incarnation only
    index: int = -1  # the item's position in the request's mm_features (its encoder input id)
    has_media: bool = False  # the request carries the item's media: it can be encoded here instead


@dataclass
class NixlECMetadata(ECConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    prefetch: list[LoadSpec] = field(default_factory=list)  # consumer: held items to start loading now
    publish: list[str] = field(default_factory=list)  # producer: (re)publish from the encoder cache
    release: list[str] = field(default_factory=list)  # consumer: committed to KV, give the slot back
    modalities: dict[str, str] = field(default_factory=dict)  # producer: of ``publish``, for its pool's events
    evict: list[str] = field(default_factory=list)  # consumer: placeholders of failed loads vLLM encodes again now
    step: Any = field(default=None, repr=False, compare=False)
    """The SchedulerOutput this metadata rides in (set when there are loads; workers drop it)."""


@dataclass
class NixlECWorkerMeta(WorkerMetadataBase):
    """Per-rank outcomes, concatenated across ranks (ranks report in different steps)."""

    loaded: list[tuple[int, str]] = field(default_factory=list)  # (rank, mm_hash)
    failed: list[tuple[int, str, str, str]] = field(default_factory=list)  # (rank, req_id, mm_hash, why)
    stats: Optional[dict] = None
    rerouted: list[tuple[int, str, str, str]] = field(default_factory=list)  # failed, encoded locally instead

    def aggregate(self, other: Any) -> "NixlECWorkerMeta":
        if not isinstance(other, NixlECWorkerMeta):
            return self
        from ec_nixl.vllm.stats import merge_data

        stats = merge_data(self.stats, other.stats) if (self.stats or other.stats) else None
        return NixlECWorkerMeta(self.loaded + other.loaded, self.failed + other.failed, stats,
                                self.rerouted + other.rerouted)


def build_params(items: dict[str, P.ItemDesc], producer: str, base: Optional[dict] = None) -> dict:
    """``ec_transfer_params`` for a finished encode: vLLM's entries plus our coordinates."""
    out: dict[str, Any] = {}
    for h, d in items.items():
        entry = dict((base or {}).get(h, {}))
        entry[PARAMS_KEY] = {"v": PARAMS_VERSION, "producer": producer, "shape": list(d.shape),
                             "dtype": d.dtype, "nbytes": d.nbytes}
        out[h] = entry
    return out


def parse_params(params: Any, expected: dict[str, int], dtype: str) -> tuple[dict[str, RemoteItem], dict[str, str]]:
    """Split ``ec_transfer_params`` into valid remote items and per-item errors.

    ``expected`` maps each of the request's mm identifiers to its number of embeddings. Entries
    that are not ours (no "ec_nixl" key) are ignored; entries for items the request does not
    have are reported as errors; nothing here raises.
    """
    items: dict[str, RemoteItem] = {}
    errors: dict[str, str] = {}
    if params is None:
        return items, errors
    if not isinstance(params, dict):
        return items, {"*": f"ec_transfer_params must be an object, got {type(params).__name__}"}
    if len(params) > P.MAX_ITEMS_PER_MESSAGE:
        return items, {"*": f"ec_transfer_params lists {len(params)} items (max {P.MAX_ITEMS_PER_MESSAGE})"}
    for h, entry in params.items():
        if not isinstance(entry, dict) or PARAMS_KEY not in entry:
            continue
        key = str(h)[:80]
        c = entry[PARAMS_KEY]
        try:
            if not isinstance(h, str):
                raise ECNixlError(f"item key must be a string, got {type(h).__name__}")
            if not isinstance(c, dict):
                raise ECNixlError("'ec_nixl' must be an object")
            if c.get("v") != PARAMS_VERSION:
                raise ECNixlError(f"unsupported ec_nixl params version {c.get('v')!r}")
            shape, nbytes, dt, producer = c.get("shape"), c.get("nbytes"), c.get("dtype"), c.get("producer")
            if not isinstance(shape, list) or not all(type(x) is int for x in shape):
                raise ECNixlError(f"shape must be a list of integers, got {shape!r}")
            if type(nbytes) is not int or not isinstance(dt, str) or not isinstance(producer, str):
                raise ECNixlError("nbytes (int), dtype (str) and producer (str) are required")
            split_address(producer)
            desc = P.ItemDesc(mm_hash=h, shape=shape, dtype=dt, nbytes=nbytes)
            P.validate_item(desc, dtype=dtype)
            if h not in expected:
                raise ECNixlError("no multimodal item of this request has this identifier")
            if len(shape) != 2 or shape[0] != expected[h]:
                raise ECNixlError(f"shape {shape} does not match the request's {expected[h]} embeddings")
            items[h] = RemoteItem(desc, producer)
        except ECNixlError as e:
            errors[key] = str(e)
    return items, errors
