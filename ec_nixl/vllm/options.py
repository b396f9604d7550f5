"""NixlECConnector settings: vLLM's ECTransferConfig plus typed ``ec_connector_extra_config``.

vLLM passes ``ec_connector_extra_config`` through untouched (JSON strings stay strings), so every
key is parsed and validated here; an unknown key fails start-up with the list of valid ones.
The standard fields keep Mooncake-compatible meanings: ``ec_ip``/``ec_port`` (rank r of data
parallel rank d serves on ``ec_port + d*tp + r``), ``ec_buffer_size`` (pool bytes per rank),
``ec_buffer_device`` and ``engine_id`` (ranks are named ``{engine_id}-dp{d}-tp{r}``; their NIXL
agents add the incarnation).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from ec_nixl import protocol as P
from ec_nixl.config import EndpointConfig, parse_options
from ec_nixl.errors import ConfigError
from ec_nixl.events.config import EventsConfig

FALLBACKS = ("auto", "fail")


ENDPOINT_FIXED = frozenset({"name", "device", "pool_bytes", "listen", "advertise", "compat", "group",
                            "observer", "threaded"})
"""``EndpointConfig`` fields the adapter derives from vLLM's config and the process's place; every
other ``EndpointConfig`` field is an ``ec_connector_extra_config`` key of the same name."""


_TEMPLATE = {"name": "template", "pool_bytes": 0}  # placeholders: replaced per process


@dataclass
class NixlECOptions:
    """Every key accepted in ``ec_connector_extra_config`` (all optional).

    The adapter's own keys are declared here; the data-plane keys (``mode``, ``backends``,
    ``backend_params``, ``nixl_progress_thread``, ``token``, ``block_bytes``, ``load_timeout_s``,
    leases, timeouts, ...) are ``EndpointConfig``'s fields, declared once there, and arrive in
    ``endpoint``: a validated template that ``endpoint_config`` completes for each process.
    """

    admission_timeout_s: float = 30.0
    """Longest a request waits for its producer to have its items ready."""
    early_admission: bool = True
    """Admit a request before its producer answered the Hold when every remote item carries its
    media and the producer is connected and answering (``vllm.scheduler``): it is scheduled in the
    step a local cache hit would be, and a miss costs a local encode. False: every request waits
    for its Holds (gated)."""
    early_without_media: bool = True
    """Early admission also for items without media (vLLM EPD routers' ``image_embeds``
    placeholders): such a request is scheduled in the step it arrives, like one with its media,
    instead of after its Hold's round trip. A Hold that answers "not ready" before vLLM scheduled
    it still puts it back on the gated path; once scheduled, its workers ask the producer
    themselves (waiting for a republish, up to ``load_timeout_s``), and an item that does not
    land fails the request, as a gated one fails after ``missing_grace_s``. False: such requests
    wait for their Holds (what they lose then is only the retries of a producer that is busy)."""
    early_load_wait_s: float = 0.5
    """Longest a step waits for an early-admitted item whose place its Hold had not given when the
    step was built (the workers ask the producer for it): then it is encoded in that step. It
    bounds what a producer that stops answering costs the batch (the scheduler admits no more
    early from it); raise it where producers answer slowly."""
    admission_wait_s: float = 0.005
    """How long the scheduler may block for producers' answers: once per step, at its end, for the
    Holds of the step's early-admitted loads (an answered one saves the workers a round trip);
    on a gated request's first sight (saves deferring a whole engine step when the producer
    answers fast)."""
    missing_grace_s: float = 2.0
    """A producer may not have (re)published an item yet: MISSING is retried this long."""
    expect_wait_s: float = 5.0
    """Longest the producer is asked to wait for items of a request that reached us before its
    encoder finished (``ec_nixl_expect`` in its params: the proxy's overlapped flow). Then they
    are encoded here (or the request fails when it carries no media). The proxy cancels and
    resends a request whose encoder failed, so this bounds only an encoder that is lost silently."""
    prefetch_defer_s: float = 0.002
    """A busy engine admits a request one step after its items' transfer started (so that the step
    does not wait for it) only when the transfer is expected to take at least this long: its
    bytes over the producer link's bandwidth, as the link probe measured it at handshake.
    Shorter (or not yet measured) transfers are admitted at once and waited for at the gather,
    which costs that step less than a step costs the request. 0: always a step later."""
    fallback: str = "auto"
    """'auto': re-encode locally when the request carries its media, else fail it; 'fail'."""
    control_port: bool = True
    """A consumer-only engine listens on its ``ec_port`` (TP rank 0's, as a producer would) for vLLM
    EPD routers' control requests (``peers``, ``cancel``; ``epd_control``), as ECMooncake's
    consumers do. False: it listens on nothing (E and PD on one host sharing an ``ec_port``)."""
    advertise_host: Optional[str] = None
    """Host put in ec_transfer_params (default ec_ip; set it when ec_ip is 0.0.0.0)."""
    compat_model_id: Optional[str] = None
    """What must match between producer and consumer (default: the model path/name)."""
    endpoint: EndpointConfig = field(default_factory=lambda: EndpointConfig(**_TEMPLATE))
    """The data-plane settings (name, place and pool are filled in per process)."""
    cache_events: EventsConfig = field(default_factory=EventsConfig)
    """The encoder-cache events (its ``events*`` keys; ``ec_nixl.events.config``)."""

    def __post_init__(self) -> None:
        if self.fallback not in FALLBACKS:
            raise ConfigError(f"fallback must be one of {FALLBACKS}, got {self.fallback!r}")
        for f in ("admission_timeout_s", "missing_grace_s", "prefetch_defer_s"):
            if getattr(self, f) < 0:
                raise ConfigError(f"{f} must be >= 0")
        if not self.early_load_wait_s > 0:
            raise ConfigError("early_load_wait_s must be > 0")
        if not 0 <= self.expect_wait_s <= P.MAX_HOLD_WAIT_S:
            raise ConfigError(f"expect_wait_s must be within 0..{P.MAX_HOLD_WAIT_S:g} s (what a producer waits at most)")
        if self.admission_wait_s < 0 or self.admission_wait_s > 1:
            raise ConfigError("admission_wait_s must be within 0..1 s (it blocks the scheduler)")


@dataclass
class Placement:
    """Where this process sits: roles, ranks, ports, names, device."""

    engine_id: str
    dp_rank: int
    tp_size: int
    tp_rank: int
    reader: int
    """This rank's index among the ``readers`` ranks of the engine that each load every item."""
    readers: int
    ip: str
    base_port: int
    device: str
    pool_bytes: int
    is_producer: bool
    is_consumer: bool

    @property
    def serving_rank(self) -> bool:
        """Producers serve from TP rank 0 only: encoder outputs are identical on every rank."""
        return self.is_producer and self.tp_rank == 0

    @property
    def port(self) -> int:
        return self.base_port + self.dp_rank * self.tp_size + self.tp_rank

    @property
    def producer_port(self) -> int:
        return self.base_port + self.dp_rank * self.tp_size

    @property
    def agent_name(self) -> str:
        return f"{self.engine_id}-dp{self.dp_rank}-tp{self.tp_rank}"

    @property
    def group(self) -> str:
        return f"{self.engine_id}-dp{self.dp_rank}"


def parse_extra(extra: dict) -> NixlECOptions:
    """Typed, validated options; an unknown key fails with the list of every valid one."""
    extra = {} if extra is None else extra
    if not isinstance(extra, dict):
        raise ConfigError(f"ec_connector_extra_config must be a JSON object, got {type(extra).__name__}")
    adapter_keys = {f.name for f in dataclasses.fields(NixlECOptions)} - {"endpoint", "cache_events"}
    endpoint_keys = {f.name for f in dataclasses.fields(EndpointConfig)} - ENDPOINT_FIXED
    events_keys = {f.name for f in dataclasses.fields(EventsConfig)}
    unknown = sorted(set(extra) - adapter_keys - endpoint_keys - events_keys)
    if unknown:
        raise ConfigError(f"unknown option(s) {unknown}; valid options are: "
                          f"{', '.join(sorted(adapter_keys | endpoint_keys | events_keys))}")
    template = parse_options(EndpointConfig, {k: v for k, v in extra.items() if k in endpoint_keys},
                             fixed=_TEMPLATE)
    opts = parse_options(NixlECOptions, {k: v for k, v in extra.items() if k in adapter_keys})
    opts.endpoint = template
    opts.cache_events = parse_options(EventsConfig, {k: v for k, v in extra.items() if k in events_keys})
    return opts


def placement(vllm_config, worker: bool) -> Placement:
    """Derive ranks, ports and device from vLLM's config (and parallel state in workers)."""
    ec = vllm_config.ec_transfer_config
    par = vllm_config.parallel_config
    tp_size = int(getattr(par, "tensor_parallel_size", 1))
    pcp = int(getattr(par, "prefill_context_parallel_size", 1) or 1)
    # vLLM runs the DP ranks of a dense (non-MoE) model as independent engines and resets their
    # data_parallel_rank to 0 (ParallelConfig.reconfigure_for_independent_dp_rank); the real rank
    # stays in data_parallel_index. With the rank, every DP rank of a producer took ec_port + 0
    # (the second failed to start) and all DP ranks of a consumer were one reader group.
    dp_rank = getattr(par, "data_parallel_index", None)
    if dp_rank is None:
        dp_rank = getattr(par, "data_parallel_rank", 0)
    dp_rank = int(dp_rank or 0)
    tp_rank = pcp_rank = 0
    if worker:
        try:
            from vllm.distributed.parallel_state import get_pcp_group, get_tensor_model_parallel_rank

            tp_rank = int(get_tensor_model_parallel_rank())
            pcp_rank = int(get_pcp_group().rank_in_group) if pcp > 1 else 0
        except Exception:
            tp_rank = pcp_rank = 0
    device = (ec.ec_buffer_device or "cuda").lower()
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            device = "cpu"  # CPU platform: the pool lives in DRAM (ec_buffer_device defaults to cuda)
        elif worker:
            device = f"cuda:{torch.cuda.current_device()}"
    elif device not in ("cpu",):
        raise ConfigError(f"ec_buffer_device {ec.ec_buffer_device!r} is not supported: use 'cuda' or 'cpu'")
    pool = int(ec.ec_buffer_size)
    if pool <= 0:
        raise ConfigError(f"ec_buffer_size must be positive, got {ec.ec_buffer_size}")
    return Placement(
        engine_id=str(ec.engine_id),
        dp_rank=dp_rank,
        tp_size=tp_size,
        tp_rank=tp_rank,
        reader=pcp_rank * tp_size + tp_rank,
        readers=tp_size * pcp,
        ip=str(ec.ec_ip),
        base_port=int(ec.ec_port),
        device=device,
        pool_bytes=pool,
        is_producer=bool(ec.is_ec_producer),
        is_consumer=bool(ec.is_ec_consumer),
    )


def compat_fields(vllm_config, opts: NixlECOptions) -> dict:
    mc = vllm_config.model_config
    return {"model": opts.compat_model_id or str(mc.model), "dtype": str(mc.dtype).removeprefix("torch."),
            "ec_nixl": 1}


def endpoint_config(p: Placement, opts: NixlECOptions, compat: dict, *, control_only: bool) -> EndpointConfig:
    """The core endpoint of one process: a worker rank (pool + NIXL) or a scheduler (control only).
    A consumer-only engine's scheduler listens on the port its producer rank would have: vLLM EPD
    routers send their control requests there (``epd_control``)."""
    serve = p.serving_rank and not control_only
    control_port = control_only and opts.control_port and p.is_consumer and not p.is_producer and p.tp_rank == 0
    return dataclasses.replace(
        opts.endpoint,
        name=p.agent_name + ("-sched" if control_only else ""),
        device=p.device,
        pool_bytes=0 if control_only else p.pool_bytes,
        listen=f"{p.ip}:{p.port}" if serve or control_port else None,
        advertise=f"{opts.advertise_host}:{p.port}" if serve and opts.advertise_host else None,
        # one answer port per rank, as ec_port (0: any free port)
        answer_port=opts.endpoint.answer_port + (p.port - p.base_port) if opts.endpoint.answer_port else 0,
        compat=compat,
        group=p.group,
        # A serving producer must answer while its engine idles; a consumer-only worker is driven
        # by the model-runner thread itself (no thread hand-offs on the load path).
        threaded=serve or control_only,
    )
