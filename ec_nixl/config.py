"""Endpoint configuration: typed, validated, parsed from JSON/CLI strings.

Every knob of the core lives in ``EndpointConfig``. ``parse_options`` turns a dict of strings
(what ``--ec-transfer-config`` delivers in ``ec_connector_extra_config``) into typed values and
rejects unknown keys with the list of valid ones, so a typo never passes silently.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from ec_nixl.errors import ConfigError

MODES = ("auto", "read", "write")


@dataclass
class EndpointConfig:
    """What one rank's data plane needs to run. Sizes in bytes, times in seconds."""

    name: str
    """Rank name: unique and stable per rank (the vLLM adapter uses engine_id-dp-tp); its NIXL agent
    is named ``{name}-{incarnation[:8]}`` (``handshake.agent_name``)."""
    device: str = "cpu"
    """Where the pool lives: 'cpu' (DRAM) or 'cuda[:N]' (VRAM)."""
    pool_bytes: int = 256 << 20
    """Size of the registered pool; 0 makes a control-only endpoint (no NIXL, no pool)."""
    block_bytes: int = 64 << 10
    """Allocation and descriptor granularity; must be equal on all peers."""
    listen: Optional[str] = None
    """'host:port' to serve items on (producers); None for consumers."""
    advertise: Optional[str] = None
    """'host:port' put into item announcements (default: ``listen``)."""
    compat: dict = field(default_factory=dict)
    """What must match between peers (model, dtype, width, ...), hashed into the handshake."""
    group: Optional[str] = None
    """Consumer group: the ranks of one consumer engine, which read each item once per rank
    (``readers``). Items are freed when every group that held them has all its readers done."""
    token: Optional[str] = None
    """Shared secret: peers must prove it (HMAC over the handshake)."""
    mode: str = "auto"
    """Link mode: 'read' (consumer pulls), 'write' (producer pushes) or 'auto' (probe both)."""
    backends: tuple = ("UCX",)
    backend_params: dict = field(default_factory=dict)
    nixl_progress_thread: Optional[bool] = None
    """Run NIXL's own progress thread. It sleeps on UCX's wake-up fds (``nixl_progress_wait_s``),
    so it costs nothing while idle. Over UCX's TCP lane (wire-up, notifications, in the default
    error mode) a transfer that carries a notification, or follows one, completes only when the
    *peer's* UCX has run: the thread runs it for a producer whose loop is asleep. None
    (default): on for serving endpoints with the UCX backend; off for consumers, which drive
    their UCX themselves while they wait for a load (with it, our thread and NIXL's share one UCX
    worker: no faster on 2 cores); off for other backends (untested)."""
    nixl_progress_wait_s: float = 0.01
    """Longest NIXL's progress thread sleeps when UCX signals nothing (it wakes at once on UCX
    events; this bounds a missed wake-up, and costs ~0.2 % of a core per agent at 10 ms).
    0 restores NIXL's default: a thread that spins, a core per agent even when idle."""
    native_handoff: bool = True
    """A serving endpoint posts the WRITE of a Push parked for an item not published yet from
    the publish itself, through a thread that never takes the GIL (ec_nixl/handoff.py,
    csrc/handoff.cpp): the runner going on in Python after its encoder step no longer delays it.
    It needs the library built (setup.py) and the nixl wheel's C API; without them, or False,
    pushes are posted by the endpoint's I/O thread in Python. Its thread sleeps when nothing is
    in flight or expected (where 4 CPUs or more are the process's it spins up to 20 ms for the
    publish a parked Push or Hold waits for: ``handoff.SPIN_S``). The agent then locks around
    its calls (NIXL_THREAD_SYNC_STRICT). The same
    thread sends the Grant of a parked Hold or Get when the publish completes it, from a second
    listening socket (``answer_port``; ec_nixl/native_answers.py)."""
    native_answers: bool = True
    """With ``native_handoff``: parked Holds and Gets are answered by the publish from the second
    socket. False: no second socket; the I/O thread answers them in Python."""
    answer_port: int = 0
    """Port of that second socket, on the ``listen`` host (0: any free port). Consumers connect to
    it by themselves; one that cannot reach it is answered on its link, from Python."""
    load_timeout_s: float = 5.0
    """Longest a load may take from request to landed before it fails."""
    announce_lease_s: float = 60.0
    """How long a producer keeps a published item nobody has claimed or held."""
    grant_lease_s: float = 30.0
    """How long one granted READ pins an item without the reader's notification."""
    heartbeat_s: float = 1.0
    peer_timeout_s: float = 5.0
    """A peer silent (or unreachable) this long while work is pending is declared dead."""
    link_timeout_s: float = 2.0
    """How long a producer may be unreachable before a consumer gives up on it, and the bound on
    how long a request waits for an unreachable producer before it is encoded locally (the
    request waits this plus at most a quarter of it). Counted on the connection itself: ZMTP
    pings every ``min(heartbeat_s, link_timeout_s / 4)``, sent and answered by ZMQ's own I/O
    thread on both sides, so an idle, busy or slow peer (encoding, under load, holding the GIL)
    answers, and only a stopped, hung or cut-off one does not. A consumer then loses its link (a
    connection attempt that gets no transport handshake this long fails too; a refused one fails
    at once); a producer ends the sessions of a dropped (or closed) connection at once (pins,
    pushes, interest), and frees items that only those sessions' group held this long after
    unless they are claimed again. Raise it on links that can stall for longer without being
    gone (a consumer then waits that long for a producer that is)."""
    quarantine_s: float = 10.0
    """A slot whose DMA outcome is unknown stays unused at least this long."""
    probe_bytes: int = 1 << 20
    """Size of the READ/WRITE probes timed at handshake (the reserved start of the pool)."""
    observer: bool = False
    """Connect to producers only to read their statistics (no compat hash needed, no data)."""
    threaded: bool = True
    """Run an I/O thread that owns NIXL; otherwise the creating thread drives progress."""
    gil_switch_interval_s: Optional[float] = None
    """With an I/O thread: lower the interpreter's GIL switch interval (``sys.setswitchinterval``,
    5 ms by default) to this, never raise it. None (default): vLLM's interpreter is left alone. A
    thread that wants the GIL while another runs Python waits up to that interval before CPython
    makes the other let go, and again after each call that released it. The native hand-off
    answers parked requests and posts their WRITEs without the GIL, and a publish no longer wakes
    the I/O thread for them: on the CPU box, 0.2 ms against None changed TTFT p50 by 0.94-1.12x
    (median of 4 rounds, every range spanning 1) in both serving flows (bench/RESULTS.md). It still
    pays where answers go through Python: ``native_handoff`` off or unavailable (the producer's
    ``stats()["native_handoff"]`` says why), where a busy runner held the waiting consumer's
    barrier to 9.3 ms at 5 ms and 3.5 ms at 0.2 ms (``handoff_trace.py --python-push --spin-ms
    10``); set 0.0002 there. Process-wide (the interpreter has one)."""
    free_when_consumed: bool = True
    """Producer frees an item as soon as every declared reader has read it."""
    evict_unclaimed: bool = True
    """When the pool is full, drop published items nobody has held yet (oldest first)."""
    reserve_wait_s: float = 1.0
    """Longest a producer's ``publish``/``reserve`` waits for space that is on its way back (items
    consumers claimed and are reading, slots behind a fence or in quarantine) before it evicts
    unclaimed items or fails with ``PoolExhausted``. A read-done message or a fence can lag the
    consumer's read by a step; without the wait a full pool fails a publish that would fit a few
    ms later. It never waits when nothing is on its way back. 0: never wait."""

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ConfigError("name must be a non-empty string")
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.pool_bytes < 0:
            raise ConfigError(f"pool_bytes must be >= 0, got {self.pool_bytes}")
        if self.block_bytes <= 0 or self.block_bytes & (self.block_bytes - 1):
            raise ConfigError(f"block_bytes must be a power of two, got {self.block_bytes}")
        if self.pool_bytes and self.pool_bytes < self.probe_blocks * self.block_bytes + self.block_bytes:
            raise ConfigError(
                f"pool_bytes {self.pool_bytes} too small: the probe area alone takes "
                f"{self.probe_blocks * self.block_bytes} B"
            )
        for f in ("load_timeout_s", "announce_lease_s", "grant_lease_s", "heartbeat_s", "peer_timeout_s",
                  "link_timeout_s"):
            if getattr(self, f) <= 0:
                raise ConfigError(f"{f} must be > 0, got {getattr(self, f)}")
        if self.nixl_progress_wait_s < 0:
            raise ConfigError(f"nixl_progress_wait_s must be >= 0, got {self.nixl_progress_wait_s}")
        if self.gil_switch_interval_s is not None and not 0 < self.gil_switch_interval_s <= 1:
            raise ConfigError(f"gil_switch_interval_s must be in (0, 1] s or None, got {self.gil_switch_interval_s}")
        if not 0 <= self.answer_port < 65536:
            raise ConfigError(f"answer_port must be in 0..65535 (0: any free port), got {self.answer_port}")
        if self.quarantine_s < 0:
            raise ConfigError(f"quarantine_s must be >= 0, got {self.quarantine_s}")
        if self.reserve_wait_s < 0:
            raise ConfigError(f"reserve_wait_s must be >= 0, got {self.reserve_wait_s}")
        if self.listen is not None:
            split_address(self.listen, allow_any_port=True)
        if self.advertise is not None:
            split_address(self.advertise)

    @property
    def progress_thread(self) -> bool:
        if self.nixl_progress_thread is not None:
            return self.nixl_progress_thread
        return self.listen is not None and "UCX" in self.backends

    @property
    def probe_blocks(self) -> int:
        return max(1, -(-self.probe_bytes // self.block_bytes))


def split_address(addr: str, allow_any_port: bool = False) -> tuple[str, int]:
    """'host:port' -> (host, port), with a clear error. Port 0 ("any") only if allowed."""
    if not isinstance(addr, str) or ":" not in addr:
        raise ConfigError(f"bad address {addr!r}: expected 'host:port'")
    host, _, port_s = addr.rpartition(":")
    host = host.strip("[]")
    try:
        port = int(port_s)
    except ValueError:
        raise ConfigError(f"bad address {addr!r}: port {port_s!r} is not a number") from None
    if not host or not (0 if allow_any_port else 1) <= port < 65536:
        raise ConfigError(f"bad address {addr!r}: need a host and a port in 1..65535")
    return host, port


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def coerce(name: str, value: Any, typ: Any) -> Any:
    """Convert a JSON/CLI value (often a string) to ``typ``, or raise ConfigError naming ``name``."""
    origin = typing.get_origin(typ)
    if origin is typing.Union:  # Optional[X]
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            return None
        return coerce(name, value, args[0])
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            s = str(value).strip().lower()
            if s in _TRUE:
                return True
            if s in _FALSE:
                return False
            raise ValueError("expected a boolean (true/false/1/0/yes/no)")
        if typ is int:
            if isinstance(value, bool):
                raise ValueError("expected an integer, got a boolean")
            if isinstance(value, float):
                if not value.is_integer():
                    raise ValueError("expected an integer")
                return int(value)
            s = str(value).strip()
            return int(float(s)) if any(c in s for c in ".eE") and float(s).is_integer() else int(s)
        if typ is float:
            if isinstance(value, bool):
                raise ValueError("expected a number, got a boolean")
            return float(value)
        if typ is str:
            if not isinstance(value, (str, int, float)):
                raise ValueError("expected a string")
            return str(value)
        if typ is tuple or origin is tuple:
            if isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            if not isinstance(value, (list, tuple)):
                raise ValueError("expected a list")
            return tuple(str(v) for v in value)
        if typ is dict or origin is dict:
            if isinstance(value, str):
                import json

                value = json.loads(value)
            if not isinstance(value, dict):
                raise ValueError("expected an object")
            return {str(k): str(v) if not isinstance(v, (int, float, bool)) else v for k, v in value.items()}
    except (ValueError, TypeError) as e:
        raise ConfigError(f"option {name!r}: cannot use {value!r}: {e}") from None
    raise ConfigError(f"option {name!r}: unsupported type {typ}")  # pragma: no cover


def parse_options(cls, options: dict, *, fixed: Optional[dict] = None):
    """Build dataclass ``cls`` from ``options`` (strings allowed) plus ``fixed`` values.

    Unknown keys raise ConfigError listing every valid key.
    """
    if not isinstance(options, dict):
        raise ConfigError(f"options must be a JSON object, got {type(options).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    settable = sorted(fields - set(fixed or {}))
    unknown = sorted(set(options) - set(settable))
    if unknown:
        raise ConfigError(f"unknown option(s) {unknown}; valid options are: {', '.join(settable)}")
    kwargs = {k: coerce(k, v, hints[k]) for k, v in options.items()}
    kwargs.update(fixed or {})
    return cls(**kwargs)
