"""The native hand-off: a parked push's WRITE posted by a thread that never takes the GIL.

Why: in a serving process the runner goes on in Python after an encoder step publishes; an I/O
thread of that process that must post the WRITE waits for the interpreter lock at every call
(bench/RESULTS.md: 1 ms after the publish on an H100, 34x the copy). ``csrc/handoff.cpp`` keeps the
per-item work in C: the owner (the endpoint's I/O thread) *arms* an entry when a Push waits for
an item not published yet; the publishing thread *fires* it from the publish itself; the
library's thread waits for the item's copy (its CUDA event), makes, posts and polls the WRITE;
the owner *takes* the outcome when it next runs. What a failure means is decided in Python only.
The same thread sends the Grants the publish itself answers (``native_answers``) from a ZMQ
socket no Python thread touches (``answer_on``).

The library drives the endpoint's own NIXL agent through the nixl wheel's C API
(``libnixl_capi.so``): no second agent, no second registration. The bindings' agent object
holds the C++ ``nixlAgent*`` that the C API's one-pointer agent handle wraps, and a prepped list
handle of the bindings is the ``nixlDlistH*`` that the C API's list handle wraps; ``attach``
checks the agent pointer by asking the C API for the agent's metadata and comparing it with the
bindings' answer, and refuses (the Python path stays) on any mismatch. The agent must be made
thread-safe (``NIXL_THREAD_SYNC_STRICT``): ``Transport`` does that when the hand-off is on.

``load_library`` finds ``ec_nixl/_handoff*.so`` (built by setup.py from csrc/handoff.cpp; any C
compiler will do, no NIXL header is needed). Without it, or without the C API, ``attach`` returns
None with the reason, and the endpoint posts in Python as before.
"""

from __future__ import annotations

import ctypes
import glob
import os
from dataclasses import dataclass
from typing import Optional

from ec_nixl.loop import has_spare_cpus

VP, SZ = ctypes.c_void_p, ctypes.c_size_t
HERE = os.path.dirname(os.path.abspath(__file__))

ARMED, FIRED, POSTED, DONE, FAILED, CANCELLED = 1, 2, 3, 4, 5, 6
STATES = {0: "UNKNOWN", ARMED: "ARMED", FIRED: "FIRED", POSTED: "POSTED", DONE: "DONE", FAILED: "FAILED",
          CANCELLED: "CANCELLED"}
SPIN_S = 0.02 if has_spare_cpus() else 0.0
"""How long the thread spins for the publish after a push is armed or a Hold noted (``expect``),
before it sleeps: a publish that finds it awake is served at once, where waking a thread asleep
for long cost 100-240 us on an idle H100 host (bench/RESULTS.md). As the consumer's barrier
(``read_lane.SPIN_S``): only where 4 CPUs or more are the process's; none on small hosts, where a
spinning thread takes the core the publisher and the consumer need."""
CAPACITY = 256
"""Entries at most (armed, in flight, or finished and not taken yet): a push that finds the table
full is posted in Python, as without the library."""

_CAPI = ("nixl_capi_make_xfer_req", "nixl_capi_post_xfer_req", "nixl_capi_get_xfer_status",
         "nixl_capi_release_xfer_req", "nixl_capi_destroy_xfer_req", "nixl_capi_create_opt_args",
         "nixl_capi_destroy_opt_args", "nixl_capi_opt_args_set_has_notif", "nixl_capi_opt_args_set_notif_msg")


def load_library() -> tuple[Optional[ctypes.PyDLL], str]:
    """(the built library, '') or (None, why not). ``PyDLL``: its calls keep the GIL (each is a
    mutex and a few stores, shorter than giving the GIL away and taking it back)."""
    if os.environ.get("EC_NIXL_NATIVE", "1") == "0":
        return None, "disabled (EC_NIXL_NATIVE=0)"
    hits = sorted(glob.glob(os.path.join(HERE, "_handoff*.so")))
    if not hits:
        return None, "ec_nixl/_handoff*.so not built (setup.py builds it from csrc/handoff.cpp with a C++ compiler)"
    try:
        lib = ctypes.PyDLL(hits[0])
    except OSError as e:
        return None, f"{hits[0]} does not load ({e})"
    i64, i32 = ctypes.c_int64, ctypes.c_int32
    sigs = {"hx_start": ([VP * 11, VP, VP, ctypes.c_double, ctypes.c_double, ctypes.c_int, ctypes.c_int], VP),
            "hx_arm": ([VP, i64, VP, i32, i32, ctypes.c_char_p, SZ], ctypes.c_int),
            "hx_fire": ([VP, i64, VP, i32, i32, VP], ctypes.c_int),
            "hx_take": ([VP, i64, ctypes.POINTER(ctypes.c_int), ctypes.c_double * 3], ctypes.c_int),
            "hx_cancel": ([VP, i64], ctypes.c_int),
            "hx_quiesce": ([VP, VP, ctypes.c_double], ctypes.c_int),
            "hx_count": ([VP], ctypes.c_int),
            "hx_stop": ([VP], None),
            "hx_answer_socket": ([VP, VP, VP], None),
            "hx_send": ([VP, i64, VP, ctypes.c_char_p, SZ, ctypes.c_char_p, SZ], ctypes.c_int),
            "hx_expect": ([VP], None)}
    for name, (args, res) in sigs.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            return None, f"{hits[0]} lacks {name} (built from an older csrc/handoff.cpp: rebuild it)"
        fn.argtypes, fn.restype = args, res
    return lib, ""


def capi_library(api_module) -> tuple[Optional[ctypes.CDLL], str]:
    """The C API beside the nixl wheel whose bindings ``api_module`` (``nixl._api``) loaded."""
    pkg = api_module.__name__.split(".")[0]
    site = os.path.dirname(os.path.dirname(api_module.__file__))
    hits = glob.glob(os.path.join(site, f".{pkg}.mesonpy.libs", "libnixl_capi*.so*")) + \
        glob.glob(os.path.join(site, f"{pkg}.libs", "libnixl_capi*.so*"))
    if not hits:
        return None, f"no libnixl_capi.so beside {pkg}"
    try:
        capi = ctypes.CDLL(hits[0])
        missing = [f for f in _CAPI + ("nixl_capi_get_local_md",) if not hasattr(capi, f)]
    except OSError as e:
        return None, f"{hits[0]} does not load ({e})"
    if missing:
        return None, f"{hits[0]} lacks {', '.join(missing)}"
    return capi, ""


def zmq_send_address() -> tuple[Optional[int], str]:
    """(the address of ``zmq_send`` in the libzmq pyzmq uses, '') or (None, why not). The very
    library pyzmq loaded (found in this process's mappings; a pyzmq with libzmq built in exports
    it itself): a socket of one libzmq must never be driven by another."""
    import zmq
    from zmq.backend.cython import _zmq

    paths = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                path = parts[5] if len(parts) >= 6 else ""
                if "libzmq" in os.path.basename(path) and path not in paths:
                    paths.append(path)
    except OSError as e:
        return None, f"cannot read this process's mappings ({e})"
    for path in paths + [_zmq.__file__]:
        try:
            lib = ctypes.CDLL(path)
            ver = [ctypes.c_int(), ctypes.c_int(), ctypes.c_int()]
            lib.zmq_version(*[ctypes.byref(v) for v in ver])
            if tuple(v.value for v in ver) != zmq.zmq_version_info():
                continue
            return ctypes.cast(lib.zmq_send, VP).value, ""
        except (OSError, AttributeError):
            continue
    return None, "pyzmq's libzmq exports no zmq_send this process can reach"


def _value_pointer(obj) -> int:
    """The C++ object a pybind11 instance holds (its first value slot, right after the object's
    header). Only trusted after ``attach`` checked it against the agent's metadata."""
    return ctypes.c_void_p.from_address(id(obj) + 2 * ctypes.sizeof(ctypes.c_void_p)).value or 0


@dataclass
class Outcome:
    state: str  # UNKNOWN ARMED FIRED POSTED DONE FAILED CANCELLED
    status: int  # NIXL's status of a FAILED entry (negative), 0 otherwise
    t_fired: float
    t_posted: float
    t_done: float


class NativeHandoff:
    """One executor per NIXL agent. Owner thread: ``arm``, ``take``, ``cancel``; any thread:
    ``fire`` (the publish). Keys are the owner's; a key is free again once taken after its end."""

    def __init__(self, lib, handle: int, boxes: list, done_fd: int):
        self._lib, self._h, self._boxes = lib, VP(handle), boxes
        self._lists: dict[int, ctypes.Array] = {}  # prepped list handle -> its C API box (kept alive)
        self.done_fd = done_fd
        """Readable once entries ended since the last ``drain_done``: the owner's poller watches it."""

    @classmethod
    def attach(cls, agent, cuda: bool, spin_us: Optional[float] = None,
               poll_spin_us: Optional[float] = None) -> tuple[Optional["NativeHandoff"], str]:
        """An executor over ``agent`` (a ``nixl_agent`` made with ``NIXL_THREAD_SYNC_STRICT``), or
        (None, why not). ``cuda``: items are in VRAM (the thread waits on their CUDA events in
        this process's current context). ``spin_us``: how long the thread spins for a publish
        after an arm or an ``expect`` before it sleeps (default ``SPIN_S``). ``poll_spin_us``: how
        long it polls a posted WRITE without sleeping after the post (default: the pusher's,
        ``pusher.PUSH_SPIN_S``: 0.5 ms where the process has spare CPUs, else 0), then it sleeps
        20-200 us between polls."""
        lib, why = load_library()
        if lib is None:
            return None, why
        import nixl._api as api

        capi, why = capi_library(api)
        if capi is None:
            return None, why
        bind = getattr(agent, "agent", None)
        ptr = _value_pointer(bind) if bind is not None else 0
        if not ptr:
            return None, "the NIXL bindings' agent holds no C++ agent where expected"
        agent_box = (VP * 1)(ptr)
        data, n = VP(), SZ()
        capi.nixl_capi_get_local_md.argtypes = [VP, ctypes.POINTER(VP), ctypes.POINTER(SZ)]
        capi.nixl_capi_get_local_md.restype = ctypes.c_int
        try:
            same = capi.nixl_capi_get_local_md(ctypes.cast(agent_box, VP), ctypes.byref(data), ctypes.byref(n)) == 0 \
                and ctypes.string_at(data, n.value) == agent.get_agent_metadata()
        except Exception as e:  # pragma: no cover - defensive: a layout that made the call raise
            return None, f"the C API did not accept the bindings' agent ({e})"
        if not same:
            return None, "the C API's view of the bindings' agent differs from the bindings' (another nixl layout)"
        fns = [ctypes.cast(getattr(capi, f), VP) for f in _CAPI]
        ctx = VP()
        if cuda:
            try:
                cu = ctypes.CDLL("libcuda.so.1")
                cu.cuCtxGetCurrent.argtypes = [ctypes.POINTER(VP)]
                if cu.cuCtxGetCurrent(ctypes.byref(ctx)) != 0 or not ctx.value:
                    return None, "no current CUDA context for the hand-off thread"
                fns += [ctypes.cast(cu.cuEventQuery, VP), ctypes.cast(cu.cuCtxSetCurrent, VP)]
            except (OSError, AttributeError) as e:
                return None, f"the CUDA driver API is not reachable ({e})"
        else:
            fns += [None, None]
        if spin_us is None:
            spin_us = SPIN_S * 1e6
        if poll_spin_us is None:  # as the pusher's PUSH_SPIN_S
            poll_spin_us = 500.0 if has_spare_cpus() else 0.0
        done_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        h = lib.hx_start((VP * 11)(*fns), ctypes.cast(agent_box, VP), ctx if cuda else None, float(spin_us),
                         float(poll_spin_us), CAPACITY, done_fd)
        if not h:
            os.close(done_fd)
            return None, "the hand-off thread did not start"
        return cls(lib, h, [agent_box, capi], done_fd), ""

    def _box(self, prepped) -> ctypes.Array:
        """The C API's list handle around a prepped list of the bindings (kept while we live)."""
        raw = int(getattr(prepped, "_handle", prepped))
        box = self._lists.get(raw)
        if box is None:
            box = self._lists[raw] = (VP * 1)(raw)
        return box

    def quiesce(self, prepped, timeout_s: float = 1.0) -> bool:
        """Owner, before it releases the prepped list ``prepped`` (its peer went away): entries
        armed on it are taken back, fired ones cancelled; returns once none is being made or
        posted over it (False: still one after ``timeout_s``). Posted WRITEs end as ``cancel``
        says; their outcome is still taken by key."""
        raw = int(getattr(prepped, "_handle", prepped))
        box = self._lists.get(raw)
        if box is None or self._h is None:
            return True
        ok = self._lib.hx_quiesce(self._h, ctypes.cast(box, VP), timeout_s) == 1
        if ok:
            del self._lists[raw]
        return ok

    def arm(self, key: int, remote, remote_block: int, capacity: int, notif: bytes) -> bool:
        """Owner: ``key`` WRITEs into ``capacity`` blocks at ``remote_block`` of the prepped list
        ``remote`` once fired. False: not armed (table full, key in use, notification too long):
        the caller posts it in Python."""
        if self._h is None:
            return False
        rc = self._lib.hx_arm(self._h, key, ctypes.cast(self._box(remote), VP), remote_block, capacity, notif,
                              len(notif))
        return rc == 0

    def fire(self, key: int, local, local_block: int, nblocks: int, cuda_event: Optional[int] = None) -> bool:
        """Publisher: the item of armed ``key`` is at ``nblocks`` blocks from ``local_block`` of
        the prepped list ``local``, complete once ``cuda_event`` (a raw ``CUevent``) is. True if
        its WRITE starts now."""
        if self._h is None:
            return False
        return self._lib.hx_fire(self._h, key, ctypes.cast(self._box(local), VP), local_block, nblocks,
                                 cuda_event or None) == 1

    def answer_on(self, sock) -> str:
        """Answers (``send``) go out on the ROUTER socket ``sock`` from now on; it is the thread's
        alone until ``answer_off``. '' or why not."""
        if self._h is None:
            return "the hand-off is closed"
        zsend, why = zmq_send_address()
        if zsend is None:
            return why
        self._lib.hx_answer_socket(self._h, VP(zsend), VP(sock.underlying))
        return ""

    def answer_off(self) -> None:
        """Take the answer socket back (returns once no send uses it): the caller may close it."""
        if self._h is not None:
            self._lib.hx_answer_socket(self._h, None, None)

    def expect(self) -> None:
        """Owner: a publish will answer a request that waits now (a noted Hold or Get): the thread
        spins for it a while (``SPIN_S``; arming a push does the same)."""
        if self._h is not None:
            self._lib.hx_expect(self._h)

    def send(self, key: int, cuda_event: Optional[int], identity: bytes, body: bytes) -> bool:
        """Publisher: send ``body`` to the peer routed as ``identity`` on the answer socket once
        ``cuda_event`` (a raw ``CUevent``; None: now) is complete. True if queued; ``take``
        says whether it went (DONE) or not (FAILED: no route, a full queue, no socket)."""
        if self._h is None:
            return False
        return self._lib.hx_send(self._h, key, cuda_event or None, identity, len(identity), body, len(body)) == 1

    def take(self, key: int) -> Outcome:
        """Owner: where ``key`` stands; an armed entry is taken back (it never fires now), a
        finished one is forgotten."""
        if self._h is None:
            return Outcome("UNKNOWN", 0, 0.0, 0.0, 0.0)
        st, stamps = ctypes.c_int(0), (ctypes.c_double * 3)()
        state = self._lib.hx_take(self._h, key, ctypes.byref(st), stamps)
        return Outcome(STATES.get(state, "UNKNOWN"), st.value if state == FAILED else 0, *stamps)

    def cancel(self, key: int) -> str:
        """Owner: stop ``key``'s WRITE (see csrc/handoff.cpp ``hx_cancel``); the state it was in."""
        if self._h is None:
            return "UNKNOWN"
        return STATES.get(self._lib.hx_cancel(self._h, key), "UNKNOWN")

    def drain_done(self) -> None:
        """Owner, when ``done_fd`` is readable: reset it (then ``take`` the entries that ended)."""
        try:
            os.eventfd_read(self.done_fd)
        except OSError:  # (BlockingIOError: nothing ended since the last drain)
            pass

    def count(self) -> int:
        return self._lib.hx_count(self._h) if self._h is not None else 0

    def close(self) -> None:
        """Stops the thread; WRITEs still in flight are released (NIXL cancels them). Before the
        agent goes."""
        if self._h is not None:
            h, self._h = self._h, None
            self._lib.hx_answer_socket(h, None, None)
            self._lib.hx_stop(h)
            os.close(self.done_fd)
