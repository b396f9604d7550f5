"""NIXL transport: one agent per rank, the arena registered once, dlists prepped once.

The local arena is registered with NIXL exactly once and described by one prepped descriptor
list of fixed-size blocks (a single strided Nx5 row, so a 1 GiB arena costs one row, not
16k). Each peer's arena is prepped once, at handshake. A transfer is then one
``make_prepped_xfer`` over the block indices of a step's items: no per-item registration and
no staging copy.

Descriptors, measured (nixl 1.5.1; ``bench/probes/step_floor.py``, one H200, two processes,
zero-copy READ of 32 x 9.8 MB = 300 MiB; NIXL's telemetry counts the descriptors):
``make_prepped_xfer`` merges indices that follow each other in the prepped row into ONE
descriptor (4800 consecutive 64 KiB blocks -> 1, 167 us = 93 % of the 155 us D2D copy; the
same bytes as one prepped descriptor: 163 us), and posts one UCX operation per descriptor
(one per item: 250 us = 62 %). ``initialize_xfer`` merges nothing (4800 descriptors of 64 KiB:
34 ms). So a step must be contiguous on both sides: ``Pool.try_allocate_many`` carves a step's
slots back to back, on the producer (publish) and the consumer (load), and ``post_many`` joins
ranges that continue each other. A coarse second dlist is not needed.

NIXL agents are not thread-safe in their default mode, so a ``Transport`` belongs to one
*owner thread*: every method checks it is called there. This module owns the agent and its
handles; it never decides policy (who reads what, when to give up: see ``endpoint``).

Progress: with the UCX backend over TCP (active messages: notifications, wire-up), a transfer
that carries a notification, or follows one on the same connection, completes only once the
*peer's* UCX worker has run. NIXL's progress thread does that for the peer, and here it sleeps in
``poll()`` on UCX's wake-up fds instead of spinning (``progress_wait_s``), so it costs nothing
while idle and answers within a wake-up when a message arrives.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ec_nixl.arena import Arena
from ec_nixl.errors import ConfigError, ProtocolError, TransferFailed
from ec_nixl.protocol import ArenaInfo

logger = logging.getLogger(__name__)

# vLLM sets this before importing nixl to work around a rare UCX registration-cache leak.
os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")


_AGENT_LOCK = threading.Lock()


def _new_agent(name: str, conf, progress_wait_s: float):
    """``nixl_agent(name, conf)`` with its progress thread blocking instead of spinning.

    nixl 1.5.1's Python wrapper hard-codes ``pthrDelay = 0`` into the agent config. The UCX
    backend's progress thread uses it as the timeout of its ``poll()`` on the workers' UCX
    wake-up fds (rounded up to whole milliseconds): 0 makes it spin, a core per agent even when
    idle (measured 0.93 core of an idle producer). Any positive value makes it sleep until UCX
    has an event and wake at least that often (NIXL's guard against a missed wake-up). The
    C++ config field is settable, so the wrapper's module-level binding is swapped, for the
    duration of the construction only, for one that sets it.
    """
    import nixl._api as api  # the wheel's real module (nixl_cu12/_cu13._api)

    bind = getattr(api, "nixlBind", None)
    delay_us = int(round(progress_wait_s * 1e6))
    if delay_us <= 0 or not getattr(conf, "enable_pthread", False) or bind is None \
            or not hasattr(bind, "nixlAgent"):
        if delay_us > 0 and getattr(conf, "enable_pthread", False):
            logger.warning("ec-nixl: cannot set NIXL's progress-thread delay in this nixl version: "
                           "its progress thread will spin (one core per agent)")
        return api.nixl_agent(name, conf)

    class _Bind:
        def __getattr__(self, attr):
            return getattr(bind, attr)

        @staticmethod
        def nixlAgent(agent_name, agent_config):
            agent_config.pthrDelay = delay_us
            return bind.nixlAgent(agent_name, agent_config)

    with _AGENT_LOCK:
        api.nixlBind = _Bind()
        try:
            return api.nixl_agent(name, conf)
        finally:
            api.nixlBind = bind


def _with_mt_mutex(engine_config: str) -> str:
    """UCX config string plus ``USE_MT_MUTEX=y`` (unless it already says otherwise).

    With a progress thread NIXL makes the UCX worker multi-threaded, and UCX guards it with a
    *spinlock* by default: a progress thread woken while our thread posts a large transfer
    (the CMA copy of a 16 MiB item runs inside the post, ~3 ms) spins for all of it, a core
    lost on a small host. A mutex makes it sleep instead; uncontended it costs the same.
    """
    if "USE_MT_MUTEX" in engine_config.upper():
        return engine_config
    return ",".join(p for p in (engine_config, "USE_MT_MUTEX=y") if p)


def load_nixl():
    """Import NIXL, or explain how to get it."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config  # type: ignore
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ConfigError(
            f"NIXL is not importable ({e}); install it with `pip install nixl==1.5.1`"
        ) from None
    return nixl_agent, nixl_agent_config


GET_ZCOPY = "CUDA_IPC_ENABLE_GET_ZCOPY"


def ucx_params(backend_params: Optional[dict], mem_type: str) -> dict:
    """The UCX backend's init parameters: the user's, plus zero-copy READ for VRAM pools.

    UCX's cuda_ipc transport turns GET zero-copy off when it finds no NVLink (one GPU, PCIe
    hosts), and NIXL READ between VRAM pools then falls back to active messages over tcp
    (0.4 GB/s instead of hundreds). PUT has no such check. We switch GET zero-copy back on through
    NIXL's ``engine_config`` (UCX keys without the ``UCX_`` prefix), scoped to our backend, unless
    the user decided: ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY`` in the environment (which UCX prefers
    anyway), or the key already in ``backend_params["engine_config"]`` (``...=n`` opts out).
    """
    params = {str(k): str(v) for k, v in (backend_params or {}).items()}
    if mem_type != "VRAM" or f"UCX_{GET_ZCOPY}" in os.environ:
        return params
    engine = params.get("engine_config", "")
    if GET_ZCOPY in engine:
        return params
    params["engine_config"] = f"{engine},{GET_ZCOPY}=y" if engine else f"{GET_ZCOPY}=y"
    logger.info("ec-nixl: UCX engine_config %r (zero-copy READ between VRAM pools; override with "
                "UCX_%s=n or backend_params.engine_config)", params["engine_config"], GET_ZCOPY)
    return params


def nixl_calls(agent):
    """``(post, status)`` for the hot path: ``post(op, local, li, remote, ri, notif) -> (handle,
    state)`` and ``status(handle) -> state``, with states "DONE"/"PROC"/"ERR".

    They call NIXL's bindings directly where nixl 1.5.1's wrapper is found (its methods add a
    dict look-up, a backend list and two pybind enum comparisons, ~0.2 us each, to every post
    and every poll of a waiter's spin loop); otherwise the wrapper's own methods. The handle is
    the wrapper's ``nixl_xfer_handle`` either way (its release and finalizer stay NIXL's)."""
    import nixl._api as api

    bind, ops = getattr(agent, "agent", None), getattr(agent, "nixl_ops", None)
    handle_t, b = getattr(api, "nixl_xfer_handle", None), getattr(api, "nixlBind", None)
    try:
        success, in_prog = int(b.NIXL_SUCCESS), int(b.NIXL_IN_PROG)
        direct = all(callable(getattr(bind, m, None)) for m in ("makeXferReq", "postXferReq", "getXferStatus")) \
            and handle_t is not None and ops is not None and set(ops) >= {"READ", "WRITE"}
    except Exception:
        direct = False
    if not direct:
        def post(op, local, li, remote, ri, notif):
            h = agent.make_prepped_xfer(op, local, li, remote, ri, notif)
            return h, agent.transfer(h)

        post.via = "wrapper"
        return post, agent.check_xfer_state

    states = {success: "DONE", in_prog: "PROC"}
    make, post_req, get_status = bind.makeXferReq, bind.postXferReq, bind.getXferStatus

    def post(op, local, li, remote, ri, notif):
        h = handle_t(bind, make(ops[op], local._handle, li, remote._handle, ri, notif, [], False))
        return h, states.get(post_req(h._handle, notif).value, "ERR")

    def status(h):
        return states.get(get_status(h._handle).value, "ERR")

    post.via = "bindings"
    return post, status


_MD_HEAD = b"nixlSerDes|Agent"


def md_agent(md: bytes) -> Optional[str]:
    """The agent name NIXL metadata starts with (nixl 1.5.1: ``nixlSerDes|Agent``, a u64 length,
    the name, ``|``), or None where it does not start that way."""
    start = len(_MD_HEAD) + 8
    if not md.startswith(_MD_HEAD) or len(md) < start:
        return None
    n = int.from_bytes(md[len(_MD_HEAD):start], "little")
    if n > 4096 or md[start + n:start + n + 1] != b"|":
        return None
    try:
        return md[start:start + n].decode()
    except UnicodeDecodeError:
        return None


@dataclass
class Peer:
    """A remote agent whose arena is prepped for transfers."""

    name: str  # its NIXL agent name
    arena: ArenaInfo
    dlist: object  # prepped remote dlist handle
    incarnation: str
    md_sha256: bytes = b""  # of the metadata loaded: the same agent may come again with it only


class Xfer:
    """One posted transfer (a NIXL request handle plus what it moves)."""

    __slots__ = ("handle", "op", "peer", "nbytes", "state", "released", "t_posted")

    def __init__(self, handle, op: str, peer: str, nbytes: int, state: str):
        self.handle = handle
        self.op = op
        self.peer = peer
        self.nbytes = nbytes
        self.state = state
        self.released = False
        self.t_posted = time.monotonic()


class NativeXfer(Xfer):
    """A WRITE the native hand-off posts (``native_push``): polled and released through it, by key.
    ``keep``: what must outlive the WRITE (the CUDA event its thread waits on)."""

    __slots__ = ("key", "keep")

    def __init__(self, key: int, nbytes: int, peer: str, keep=None):
        super().__init__(None, "WRITE", peer, nbytes, "PROC")
        self.key, self.keep = key, keep


_NATIVE_STATES = {"ARMED": "PROC", "FIRED": "PROC", "POSTED": "PROC", "DONE": "DONE"}
"""The hand-off's entry states as a transfer's (ARMED: its publish is firing it now; the rest,
FAILED, CANCELLED and an unknown key, are ERR)."""


class Transport:
    """The rank's NIXL agent, its registered arena and its peers' prepped dlists."""

    def __init__(
        self,
        name: str,
        arena: Arena,
        block_size: int,
        backends: tuple[str, ...] = ("UCX",),
        backend_params: Optional[dict[str, str]] = None,
        telemetry: bool = True,
        progress_thread: bool = False,
        progress_wait_s: float = 0.01,
        native_handoff: bool = False,
    ):
        _, nixl_agent_config = load_nixl()
        self.name = name
        self.arena = arena
        self.block_size = block_size
        self._owner = threading.get_ident()
        # With the progress thread, NIXL's own thread runs UCX whenever a message arrives (see the
        # module docstring); without it, only our NIXL calls (polls, notification drains) do, so
        # the endpoint must keep calling while peers may be waiting on us.
        self.progress_thread = progress_thread
        extra = {}
        if native_handoff:  # the hand-off's thread calls the agent too: NIXL must lock
            from nixl._api import nixl_thread_sync_t

            extra["sync_mode"] = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        self._agent = _new_agent(name, nixl_agent_config(backends=[], capture_telemetry=telemetry,
                                                         enable_prog_thread=progress_thread, **extra),
                                 progress_wait_s)
        for b in backends:
            params = ucx_params(backend_params, arena.mem_type) if b == "UCX" else {}
            if b == "UCX" and progress_thread:
                params["engine_config"] = _with_mt_mutex(params.get("engine_config", ""))
            try:
                self._agent.create_backend(b, params)
            except Exception as e:
                raise ConfigError(f"NIXL backend {b!r} could not be created ({e}); params={params}") from None
        self._telemetry = telemetry
        self._post, self._status = nixl_calls(self._agent)
        self._reg = self._agent.register_memory(
            [(arena.base, arena.size, arena.device_id, "")], arena.mem_type
        )
        self.nblocks = arena.size // block_size
        self._index = np.arange(self.nblocks, dtype=np.int32)  # block indices, for post_many's slices
        self._local = self._agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", self._strided(arena.base, self.nblocks, arena.device_id), arena.mem_type
        )
        self.metadata: bytes = self._agent.get_agent_metadata()
        self.peers: dict[str, Peer] = {}  # by NIXL agent name
        self.handoff = None  # handoff.NativeHandoff: pushes posted off the GIL (native_push)
        self.handoff_why = "off (native_handoff=False)"
        if native_handoff:
            from ec_nixl.handoff import NativeHandoff

            self.handoff, why = NativeHandoff.attach(self._agent, cuda=arena.mem_type == "VRAM")
            self.handoff_why = why or "on"
            if self.handoff is None:
                logger.info("ec-nixl: pushes are posted in Python (native hand-off unavailable: %s)", why)
        # Whether we can read the agent name in a peer's metadata before NIXL does (our own
        # metadata says whether this NIXL writes it where md_agent looks).
        self._md_names = md_agent(self.metadata) == name
        if not self._md_names:
            logger.warning("ec-nixl: this NIXL's metadata format is not the one known: a peer's agent name is "
                           "checked only after NIXL loaded its metadata")

    # --- ownership ----------------------------------------------------------------------

    def bind_owner(self) -> None:
        """Make the calling thread the owner (e.g. the endpoint's I/O thread at start)."""
        self._owner = threading.get_ident()

    def _check_owner(self) -> None:
        if threading.get_ident() != self._owner:
            raise RuntimeError("ec-nixl Transport used outside its owner thread (NIXL is not thread-safe)")

    # --- description --------------------------------------------------------------------

    def _strided(self, base: int, nblocks: int, device: int) -> np.ndarray:
        return np.array([[base, self.block_size, device, self.block_size, nblocks]], dtype=np.uint64)

    @property
    def arena_info(self) -> ArenaInfo:
        a = self.arena
        return ArenaInfo(base=a.base, size=self.nblocks * self.block_size, block=self.block_size,
                         mem_type=a.mem_type, device=a.device_id)

    # --- peers --------------------------------------------------------------------------

    def add_peer(self, md: bytes, arena: ArenaInfo, incarnation: str, agent: str) -> Peer:
        """Load a peer's metadata and prep its arena once.

        ``agent`` is the NIXL agent name the peer announced. NIXL is handed metadata only for an
        agent it does not hold: a copy of a loaded agent's metadata that differs (cut short,
        forged) would unload that agent, so it is refused before NIXL sees it, and the same
        metadata again (a reconnect) is the peer we have. Whatever a failed load left in NIXL is
        removed (NIXL still refuses that name afterwards: agent names are never reused).
        """
        self._check_owner()
        if arena.block != self.block_size:
            raise ConfigError(f"peer block size {arena.block} != local {self.block_size}")
        if not agent or agent == self.name:
            raise ProtocolError(f"peer NIXL agent name {agent!r} is empty or ours")
        named = md_agent(md) if self._md_names else agent
        if named is None:
            raise ProtocolError("peer NIXL metadata names no agent (not NIXL metadata)")
        if named != agent:
            raise ProtocolError(f"NIXL metadata of agent {named!r} announced as agent {agent!r}")
        digest = hashlib.sha256(md).digest()
        old = self.peers.get(agent)
        if old is not None:
            if old.md_sha256 == digest and old.incarnation == incarnation:
                return old
            raise ProtocolError(f"NIXL agent {agent} is already loaded with other metadata "
                                f"(incarnation {old.incarnation}); refusing to replace it")
        try:
            loaded = self._agent.add_remote_agent(md)
        except Exception:
            self._unload(agent)
            raise
        loaded = loaded.decode() if isinstance(loaded, (bytes, bytearray)) else str(loaded)
        if loaded != agent:  # only where md_agent cannot read this NIXL's format
            if loaded not in self.peers:
                self._unload(loaded)
            raise ProtocolError(f"NIXL metadata of agent {loaded!r} announced as agent {agent!r}")
        nblocks = arena.size // arena.block
        try:
            dlist = self._agent.prep_xfer_dlist(agent, self._strided(arena.base, nblocks, arena.device),
                                                arena.mem_type)
        except Exception:
            self._unload(agent)  # an arena outside what the peer registered
            raise
        peer = Peer(name=agent, arena=arena, dlist=dlist, incarnation=incarnation, md_sha256=digest)
        self.peers[agent] = peer
        try:
            self._agent.make_connection(agent)
        except Exception as e:  # optional optimisation only
            logger.debug("make_connection(%s) failed: %s", agent, e)
        return peer

    @property
    def local_dlist(self):
        """Our arena's prepped list (block k = descriptor k)."""
        return self._local

    def forget_peer(self, name: str) -> None:
        """Drop a peer's dlist and metadata (peer gone or restarted). The native hand-off lets go
        of the list first: what it had armed on it never writes, what it fired is cancelled."""
        self._check_owner()
        peer = self.peers.pop(name, None)
        if peer is not None:
            if self.handoff is not None and not self.handoff.quiesce(peer.dlist):
                logger.error("ec-nixl: the native hand-off still posts to %s after 1 s: its list is kept", name)
            else:
                self._drop_dlist(peer)
        self._unload(name)

    def _unload(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except Exception as e:
            logger.debug("remove_remote_agent(%s): %s", name, e)

    def _drop_dlist(self, peer: Peer) -> None:
        try:
            peer.dlist.release()
        except Exception as e:
            logger.debug("release dlist of %s: %s", peer.name, e)

    # --- transfers ----------------------------------------------------------------------

    def post(self, op: str, peer: Peer, local_block: int, remote_block: int, nblocks: int,
             notif: bytes = b"") -> Xfer:
        """Post one READ (peer -> us) or WRITE (us -> peer) of ``nblocks`` contiguous blocks."""
        return self.post_many(op, peer, [(local_block, remote_block, nblocks)], notif)

    def post_many(self, op: str, peer: Peer, ranges: list[tuple[int, int, int]], notif: bytes = b"") -> Xfer:
        """Post ONE request moving several ``(local_block, remote_block, nblocks)`` ranges.

        A step's items from one peer go as one NIXL request: one post, one completion, one
        notification, whatever the count; ranges contiguous on both sides become one
        descriptor (see the module docstring).
        """
        self._check_owner()
        if not ranges:
            raise TransferFailed("nothing to transfer", reason="BAD_RANGE")
        idx, local_n, remote_n = self._index, self.nblocks, peer.arena.size // peer.arena.block
        if remote_n > len(idx):
            idx = self._index = np.arange(remote_n, dtype=np.int32)
        runs: list[list[int]] = []  # ranges that continue each other on both sides, joined
        total = 0
        for local_block, remote_block, nblocks in ranges:
            if nblocks <= 0:
                raise TransferFailed(f"a range of {nblocks} blocks", reason="BAD_RANGE")
            total += nblocks
            if runs:
                last = runs[-1]
                if last[0] + last[2] == local_block and last[1] + last[2] == remote_block:
                    last[2] += nblocks
                    continue
            runs.append([local_block, remote_block, nblocks])
        for local_block, remote_block, nblocks in runs:  # a joined run is in bounds iff its parts are
            if local_block < 0 or local_block + nblocks > local_n:
                raise TransferFailed(f"local blocks {local_block}+{nblocks} outside the arena", reason="BAD_RANGE")
            if remote_block < 0 or remote_block + nblocks > remote_n:
                raise TransferFailed(f"remote blocks {remote_block}+{nblocks} outside {peer.name}'s arena",
                                     reason="BAD_RANGE")
        # Slices of one arange (nothing allocated for a run); NIXL merges each run into one descriptor.
        if len(runs) == 1:
            (lb, rb, n), = runs
            li_a, ri_a = idx[lb:lb + n], idx[rb:rb + n]
        else:
            li_a = np.concatenate([idx[lb:lb + n] for lb, _, n in runs])
            ri_a = np.concatenate([idx[rb:rb + n] for _, rb, n in runs])
        try:
            h, state = self._post(op, self._local, li_a, peer.dlist, ri_a, notif)
        except Exception as e:
            raise TransferFailed(f"{op} with {peer.name} could not be posted: {e}", reason="POST") from None
        return Xfer(h, op, peer.name, total * self.block_size, state)

    def poll(self, x: Xfer) -> str:
        """Current state: DONE, PROC or ERR (sticky once final)."""
        self.finished([x])
        return x.state

    def finished(self, xfers: list[Xfer]) -> list[Xfer]:
        """Those of ``xfers`` that are final now (DONE or ERR): ``poll`` for many, lean enough for
        a waiter's spin loop (one owner check, one NIXL status call per request in flight)."""
        self._check_owner()
        check = self._status
        out = []
        for x in xfers:
            if x.state == "PROC" and not x.released:
                if isinstance(x, NativeXfer):  # the hand-off's: its outcome, by key
                    x.state = _NATIVE_STATES.get(self.handoff.take(x.key).state, "ERR")
                else:
                    try:
                        x.state = check(x.handle)
                    except Exception as e:
                        logger.warning("check_xfer_state(%s) raised %s", x.peer, e)
                        x.state = "ERR"
                if x.state == "PROC":
                    continue
            out.append(x)
        return out

    def telemetry(self, x: Xfer) -> Optional[tuple[float, float, int, int]]:
        """(post_us, xfer_us, bytes, descriptors) of a finished transfer, if NIXL captured it."""
        if not self._telemetry or isinstance(x, NativeXfer):
            return None
        try:
            t = self._agent.get_xfer_telemetry(x.handle)
            return float(t.postDuration), float(t.xferDuration), int(t.totalBytes), int(t.descCount)
        except Exception:
            return None

    def release(self, x: Xfer) -> bool:
        """Release (cancelling if active). False when NIXL cannot cancel: the DMA may still run."""
        self._check_owner()
        if x.released:
            return True
        if isinstance(x, NativeXfer):  # the hand-off releases its own requests (NIXL cancels what it can)
            if self.poll(x) == "PROC":
                self.handoff.cancel(x.key)
                if self.poll(x) == "PROC":
                    return False
            x.released = True
            return True
        try:
            x.handle.release()
        except Exception as e:
            logger.debug("release of %s transfer with %s failed: %s", x.op, x.peer, e)
            return False
        x.released = True
        if x.state == "PROC":
            x.state = "ERR"  # cancelled: whoever else shares this request sees it failed
        return True

    # --- notifications ------------------------------------------------------------------

    def notifs(self) -> list[tuple[str, bytes]]:
        self._check_owner()
        out = []
        for agent, msgs in self._agent.get_new_notifs().items():
            name = agent.decode() if isinstance(agent, (bytes, bytearray)) else str(agent)
            out.extend((name, m) for m in msgs)
        return out

    def send_notif(self, peer: str, msg: bytes) -> None:
        self._check_owner()
        self._agent.send_notif(peer, msg)

    # --- link probe ---------------------------------------------------------------------

    def probe(self, peer: Peer, op: str, nblocks: int, reps: int = 3) -> float:
        """Median seconds of ``reps`` transfers of block 0..nblocks (the reserved probe area)."""
        self._check_owner()
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            x = self.post(op, peer, 0, 0, nblocks)
            deadline = t0 + 5.0
            while self.poll(x) == "PROC":
                if time.perf_counter() > deadline:
                    self.release(x)
                    return float("inf")
            dt = time.perf_counter() - t0
            ok = x.state == "DONE"
            self.release(x)
            if not ok:
                return float("inf")
            times.append(dt)
        times = sorted(times[1:])  # the first one pays connection set-up
        return times[len(times) // 2]

    def close(self) -> None:
        if self.handoff is not None:  # its thread stops (releasing what it posted) before the agent goes
            self.handoff.close()
        for name in list(self.peers):
            try:
                self.forget_peer(name)
            except Exception:
                pass
        try:
            self._local.release()
        except Exception:
            pass
        try:
            self._agent.deregister_memory(self._reg)
        except Exception as e:
            logger.debug("deregister: %s", e)
        self._agent = None
