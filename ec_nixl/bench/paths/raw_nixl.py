"""``raw-nixl-read`` / ``raw-nixl-write``: the floor. The same bytes between the same two
processes with plain NIXL and nothing of ec-nixl, so ``ours ÷ raw-nixl`` is the connector's own cost.

One ``nixl_agent`` per process, made when the first raw case runs, each over its own buffer
registered once. Per case both sides prep one strided descriptor list of a ring of item-sized
slots, back to back (``prep_xfer_dlist``; slot k is the same on both sides), so that NIXL merges
a step's slots into one descriptor; an operation is one prepped request over a step's slots + its
post, polled by the host until DONE (NIXL's bindings, called as ec-nixl's transport calls them:
``transport.nixl_calls``), timed on the initiator's clock.
The consumer READs (``raw-nixl-read``), the producer WRITEs (``raw-nixl-write``); the other side
drives its agent meanwhile (a target may need UCX progress: wire-up, emulated protocols). Data only, no
notification: ec-nixl's completion messages are part of what the ratio charges to the connector.
Each chunk poisons the head and tail of its destination slots first and checks them after.

The agents get the bench's ``--backend-params``. On one host they have no NIXL progress thread
(NIXL's own spins for the whole run, shared/design/nixl.md): the target's loop drives its agent
(``progress_until``). Across hosts each agent is driven as the ec-nixl endpoint of its process is
(``progress_thread``): over TCP a READ is emulated with messages the target must answer, and the
way a target is woken is then part of the link's cost on both sides of the ratio (between two
namespaces of the 2-core box, a spinning READ target made the 64 KiB floor 0.08 ms, half of
ours, while the box was quiet, and 5-15 ms while other jobs ran; ours' producer sleeps on UCX's
wake-up fds). On CUDA also ``CUDA_IPC_ENABLE_GET_ZCOPY=y`` (zero-copy READ
without NVLink, shared/design/device.md) unless the environment sets UCX_CUDA_IPC_ENABLE_GET_ZCOPY.
"""

from __future__ import annotations

import os
import time

from ec_nixl.bench import proc
from ec_nixl.bench.memory import check, probe
from ec_nixl.bench.paths.base import Path, Skip
from ec_nixl.bench.units import page_round

ZCOPY = "CUDA_IPC_ENABLE_GET_ZCOPY"
RING = 128  # most slots per ring: a chunk uses each slot at most once (4 steps of 32 items)
POISON = 0xA5
XFER_TIMEOUT_S = 60.0
PROGRESS_WAIT_S = 0.01  # EndpointConfig.nixl_progress_wait_s's default: what ours' producer runs with


def backend_params(cuda: bool, params: dict, environ=os.environ) -> dict:
    """The UCX backend parameters of a raw agent: ``params`` plus, on CUDA, zero-copy GET for
    cuda_ipc, unless the user chose it (environment variable or an ``engine_config`` entry)."""
    out = {k: str(v) for k, v in params.items()}
    if not cuda or f"UCX_{ZCOPY}" in environ:
        return out
    entries = [e.strip() for e in out.get("engine_config", "").split(",") if e.strip()]
    if not any(e.split("=", 1)[0].strip().upper().removeprefix("UCX_") == ZCOPY for e in entries):
        entries.append(f"{ZCOPY}=y")
    out["engine_config"] = ",".join(entries)
    return out


class RawAgent:
    """A plain NIXL agent over its own buffer, registered once; prepped rings; host-polled transfers.

    The buffer is plain process memory of the kind the pools use (anonymous, pre-touched DRAM;
    device memory), not the /dev/shm source: in our CPU runs CMA from that shared file mapping was
    up to 2x slower, and a floor on slower memory than ours would flatter ours. ``fill`` (the
    source) gives it the same bytes.
    """

    def __init__(self, name: str, device: str, nbytes: int, params: dict, fill=None, thread: bool = False):
        import torch
        from nixl._api import nixl_agent, nixl_agent_config  # type: ignore

        from ec_nixl import transport

        cuda = device.startswith("cuda")
        self.mem = "VRAM" if cuda else "DRAM"
        self.params = backend_params(cuda, params)
        self.thread = thread
        if thread:  # NIXL's progress thread as ec-nixl's endpoints run it: asleep on UCX's fds, not spinning
            self.params["engine_config"] = transport._with_mt_mutex(self.params.get("engine_config", ""))
            self.agent = transport._new_agent(name, nixl_agent_config(backends=[], enable_prog_thread=True),
                                              PROGRESS_WAIT_S)
        else:
            self.agent = nixl_agent(name, nixl_agent_config(backends=[], enable_prog_thread=False))
        self.agent.create_backend("UCX", self.params)
        # The same NIXL calls as ec-nixl's transport (the bindings, not the wrapper's methods):
        # the floor must not be slower than what ours uses to reach NIXL.
        self.post, self.status = transport.nixl_calls(self.agent)
        self.buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        if fill is not None:
            self.buf.copy_(fill[:nbytes])
        if cuda:
            torch.cuda.synchronize()
        self.base, self.size = self.buf.data_ptr(), nbytes
        self.dev = torch.cuda.current_device() if cuda else 0
        self.reg = self.agent.register_memory([(self.base, self.size, self.dev, "")], self.mem)
        self.peer, self.peer_info, self.ring = None, None, None

    def info(self) -> dict:
        return {"md": self.agent.get_agent_metadata(), "base": self.base, "size": self.size, "dev": self.dev,
                "params": self.params, "thread": self.thread}

    def connect(self, info: dict) -> None:
        name = self.agent.add_remote_agent(info["md"])
        self.peer = name.decode() if isinstance(name, (bytes, bytearray)) else str(name)
        self.peer_info = info

    def prep(self, nbytes: int, count: int, stride: int) -> list:
        """Prep slot k = [k*stride, +stride) on both sides; returns the head/tail probe of each
        slot's first ``nbytes`` (the item).

        The slots are dense (a descriptor spans its whole stride, the item plus its padding to
        4 KiB), so NIXL merges a step's consecutive slots into ONE descriptor, as it merges ours'
        consecutive pool blocks: the floor moves a step as one operation (with a descriptor per
        item it was 1.6x slower on the H200, bench/probes/step_floor.py)."""
        import numpy as np

        self.unprep()

        def ring(base: int, dev: int):  # one strided row: count slots of stride bytes each, back to back
            return np.array([[base, stride, dev, stride, count]], dtype=np.uint64)

        p = self.peer_info
        self.ring = (self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", ring(self.base, self.dev), self.mem),
                     self.agent.prep_xfer_dlist(self.peer, ring(p["base"], p["dev"]), self.mem))
        return [probe(self.buf[k * stride : k * stride + nbytes]) for k in range(count)]

    def xfer(self, op: str, slots) -> float:
        """Seconds from making the request to DONE of one request over ``slots`` (both sides)."""
        a, (local, remote), status = self.agent, self.ring, self.status
        t0 = time.perf_counter()
        h, st = self.post(op, local, slots, remote, slots, b"")
        while st == "PROC":
            st = status(h)
            if time.perf_counter() - t0 > XFER_TIMEOUT_S:
                break
        dt = time.perf_counter() - t0
        if st == "DONE":
            a.release_xfer_handle(h)
            return dt
        try:
            a.release_xfer_handle(h)  # cancels it if NIXL can
        except Exception:
            pass
        raise RuntimeError(f"raw NIXL {op} of slots {list(slots)[:4]}... ended {st} after {dt:.1f} s")

    def progress(self) -> None:
        """Drive UCX once (no progress thread): what a transfer's target must do now and then."""
        self.agent.get_new_notifs()

    def unprep(self) -> None:
        for h in self.ring or ():
            self.agent.release_dlist_handle(h)
        self.ring = None

    def close(self) -> None:
        try:
            self.unprep()
            if self.peer is not None:
                self.agent.remove_remote_agent(self.peer)
            self.agent.deregister_memory(self.reg)
        except Exception:
            pass


# --- the consumer's paths ----------------------------------------------------------------------


class RawNixlRead(Path):
    name = "raw-nixl-read"

    def __init__(self, c, spec, per_op):
        super().__init__(c, spec, per_op)
        stride = page_round(spec.nbytes)
        count = min(RING, c.dst_bytes // stride)  # both raw buffers have the destination's size
        if count < per_op:
            raise Skip(f"the buffers hold {count} items of {spec.label}; a step needs {per_op}")
        self.link = c.extras.get("raw") or c.extras.setdefault("raw", _open(c))
        self.stride, self.count, self.next = stride, count, 0
        self.chunk = max(1, min(16, count // per_op))
        self.link.prep(spec.nbytes, count, stride)
        self.probes = c.rpc("raw_prep", spec.nbytes, count, stride)  # of the source: what must arrive

    def take(self, k: int) -> list:
        """The slots of ``k`` operations (distinct within a chunk), poisoned at head and tail."""
        import numpy as np

        groups = []
        for _ in range(k):
            groups.append(np.arange(self.next, self.next + self.per_op, dtype=np.int32) % self.count)
            self.next = (self.next + self.per_op) % self.count
        buf, n = self.link.buf, self.spec.nbytes
        for k_ in {int(s) for g in groups for s in g}:
            off = k_ * self.stride
            buf[off : off + 8].fill_(POISON)
            buf[off + n - 8 : off + n].fill_(POISON)
        if self.c.cuda:
            import torch

            torch.cuda.synchronize()
        return groups

    def verify(self, groups: list) -> None:
        n = self.spec.nbytes
        for g in groups:
            for s in g.tolist():
                off = s * self.stride
                check(self.link.buf[off : off + n], self.probes[s], f"{self.name} slot {s}")

    def samples(self, k: int) -> list[float]:
        groups = self.take(k)
        conn = self.c.prod
        proc.send(conn, "raw_serve")  # the producer drives its agent until our next command
        try:
            ts = [self.link.xfer("READ", g) for g in groups]
        finally:
            proc.send(conn, "raw_stop")
            proc.reply(conn, "raw_serve")
            proc.reply(conn, "raw_stop")
        self.verify(groups)
        return ts


class RawNixlWrite(RawNixlRead):
    name = "raw-nixl-write"

    def samples(self, k: int) -> list[float]:
        groups = self.take(k)
        conn = self.c.prod
        proc.send(conn, "raw_write", [g.tolist() for g in groups])
        progress_until(self.link, conn, spin=target_spins(self.c.cfg))  # the WRITEs' target side
        ts = proc.reply(conn, "raw_write")
        self.verify(groups)
        return ts


def _open(c) -> RawAgent:
    """The consumer's agent and buffer, connected both ways with the producer's."""
    agent = RawAgent(f"ecb-raw-cons-{os.getpid()}", c.device, c.dst_bytes, c.cfg.get("backend_params") or {},
                     thread=progress_thread(c.cfg, "consumer"))
    peer = c.rpc("raw_open", agent.info())
    agent.connect(peer)
    c.extras["raw_params"] = agent.params
    c.extras["raw_threads"] = {"producer": peer.get("thread", False), "consumer": agent.thread}
    return agent


def progress_thread(cfg: dict, role: str) -> bool:
    """Whether ``role``'s raw agent runs NIXL's progress thread: across hosts, as that process's
    ec-nixl endpoints do (``--nixl-progress-thread``; auto = the producer only); never on one host."""
    if not cfg.get("producer"):
        return False
    chosen = cfg.get("nixl_progress_thread")
    return (role == "producer") if chosen is None else bool(chosen)


def target_spins(cfg: dict) -> bool:
    """Whether a raw transfer's target without a progress thread drives its agent without pause
    (``progress_until``): on a GPU host (a READ without zero-copy needs the target per message)
    and across hosts (a WRITE over TCP lands only as the target's UCX reads its socket; ours'
    consumer, the target of ours-write, spins in its barrier too: a 0.5 ms tick made the 9.8 MB
    raw WRITE 3x slower between two network namespaces)."""
    return cfg["device"].startswith("cuda") or bool(cfg.get("producer"))


def progress_until(agent: RawAgent, conn, spin: bool) -> None:
    """Be the target until something arrives on ``conn``: drive ``agent``, spinning when
    ``target_spins``, else every 0.5 ms (CPU, one host), where CMA is one-sided after wire-up and
    a spinning loop would steal one of few cores from the initiator. An agent with a progress
    thread needs nothing from us."""
    if agent.thread:
        while not conn.poll(0.5):
            pass
        return
    tick = 0.0 if spin else 0.0005
    while not conn.poll(tick):
        agent.progress()


def write_many(agent: RawAgent, groups: list) -> list[float]:
    """The producer's half of raw-nixl-write: one WRITE per step, seconds of each."""
    import numpy as np

    return [agent.xfer("WRITE", np.asarray(g, dtype=np.int32)) for g in groups]
