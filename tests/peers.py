"""Real peer processes for the tests: ec-nixl Endpoints driven over a pipe.

Tests run producers (``ProducerProcess``) and, where a consumer must die or run beside others,
consumers (``ConsumerProcess``) in their own processes. Each is forked from a *fork server* that
has imported torch and ec-nixl once but created no NIXL agent, no UCX context and no CUDA
context, so every peer still starts clean (its agent, pool and sockets are its own) in about half
a second instead of the seconds a fresh interpreter needs to import torch. Items are generated
from seeds on both sides, so the consumer can check every byte without shipping the data through
the pipe.

Some commands are *fault injections* (``stall``, ``drop_read_notifs``): they break a peer on
purpose, the way a real one breaks, so the reliability tests can watch the other side cope.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from typing import Any

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "float64": torch.float64, "int8": torch.int8, "uint8": torch.uint8, "int32": torch.int32,
          "int64": torch.int64}


def make_item(seed: int, shape: tuple[int, ...], dtype: str, device: str = "cpu") -> torch.Tensor:
    """Deterministic random item (same bytes in every process)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g, dtype=torch.float32).to(DTYPES[dtype])
    return t.to(device)


def make_bytes_item(seed: int, shape: tuple[int, ...], dtype: str, device: str = "cpu") -> torch.Tensor:
    """Deterministic random *bytes* viewed as ``dtype`` (cheap for large items; may hold NaNs)."""
    g = torch.Generator().manual_seed(seed)
    size = torch.empty((), dtype=DTYPES[dtype]).element_size()
    n = int(torch.Size(shape).numel()) * size
    raw = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
    return raw.view(DTYPES[dtype]).view(*shape).to(device)


def digest(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes(),
                           digest_size=16).hexdigest()


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` (from /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class _GetRequest:
    """A Get sent on its own (a grant nobody READs): what a consumer holds when it dies."""

    kind = "get"

    def __init__(self, producer: str, mm_hashes: list[str], req: int, deadline: float):
        from ec_nixl.queries import HoldRequest

        self._h = HoldRequest(producer, mm_hashes, 1, req, deadline)
        self.producer, self.mm_hashes, self.req, self.deadline = producer, mm_hashes, req, deadline

    @property
    def done(self) -> bool:
        return self._h.done

    @property
    def states(self):
        return self._h.states

    def message(self, session: str):
        from ec_nixl import protocol as P

        return P.Get(session=session, req=self.req, mm_hashes=self.mm_hashes)

    def resolve(self, msg, incarnation: str) -> None:
        self._h.resolve(msg, incarnation)

    def finish(self, status: str, detail: str) -> None:
        self._h.finish(status, detail)


def _load(ep, args, timeout):
    """Load ``args`` = [(desc, producer, reader, readers)], wait, digest what landed, release."""
    from ec_nixl.barrier import LoadBarrier
    from ec_nixl.tickets import ItemRef
    from ec_nixl.errors import LoadFailed

    refs = [ItemRef(desc=d, producer=p, reader=r, readers=n) for d, p, r, n in args]
    tickets = ep.load(refs, timeout=timeout)
    try:
        LoadBarrier(ep).wait(tickets)
    except LoadFailed:
        pass
    out = []
    for t in tickets:
        if t.state == "landed":
            out.append((t.mm_hash, "landed", "", digest(t.tensor())))
            t.release()
        else:
            out.append((t.mm_hash, t.state, t.error or t.reason, ""))
    return out


def _serve(conn, cfg_kwargs: dict, env: dict) -> None:
    os.environ.update(env)
    torch.set_num_threads(1)  # several peers share a small machine: no intra-op thread pools
    from ec_nixl.config import EndpointConfig
    from ec_nixl.endpoint import Endpoint
    from ec_nixl.tensors import Ready

    dev = cfg_kwargs.get("device", "cpu")
    if dev.startswith("cuda"):
        torch.cuda.set_device(torch.device(dev).index or 0)
    ep = Endpoint(EndpointConfig(**cfg_kwargs))
    conn.send(("ready", (ep.address, ep.incarnation)))
    pending: dict[str, list] = {}  # load_async batches by name
    while True:
        try:
            cmd, args = conn.recv()
        except EOFError:
            break
        try:
            if cmd == "publish":
                out = []
                for mm_hash, shape, dtype, seed in args:
                    t = make_item(seed, shape, dtype, dev)
                    out.append(ep.publish(mm_hash, t))
                if dev.startswith("cuda"):
                    torch.cuda.synchronize()
                conn.send(("ok", out))
            elif cmd == "publish_bytes":
                # Random-byte items; returns (desc, blake2b digest) per item (the soak checks them).
                out = []
                for mm_hash, shape, dtype, seed in args:
                    t = make_bytes_item(seed, shape, dtype, dev)
                    out.append((ep.publish(mm_hash, t), digest(t)))
                if dev.startswith("cuda"):
                    torch.cuda.synchronize()
                conn.send(("ok", out))
            elif cmd == "publish_late":
                # The item is announced now but written only after `delay` seconds: a throttled
                # producer. Until then the consumer must get NOT_READY (READ) or a queued push.
                mm_hash, shape, dtype, seed, delay = args
                t = make_item(seed, shape, dtype, dev)
                nbytes = t.numel() * t.element_size()
                slot = ep.reserve(nbytes, tag=mm_hash)
                slot.bytes().fill_(0x5A)
                ready = Ready(False)
                desc = ep.publish_slot(mm_hash, slot, t.shape, t.dtype, ready)

                def later():
                    time.sleep(delay)
                    slot.bytes().copy_(t.reshape(-1).view(torch.uint8))
                    if dev.startswith("cuda"):
                        torch.cuda.synchronize()
                    ready.set()

                threading.Thread(target=later, daemon=True).start()
                conn.send(("ok", desc))
            elif cmd == "load":
                # Consumer: args = (items, timeout); items = [(desc, producer, reader, readers)].
                items, timeout = args
                conn.send(("ok", _load(ep, items, timeout)))
            elif cmd == "load_async":
                # Consumer: start loading and answer at once (the test kills us mid-flight).
                from ec_nixl.tickets import ItemRef

                items, timeout = args
                tickets = ep.load([ItemRef(desc=d, producer=p, reader=r, readers=n) for d, p, r, n in items],
                                  timeout=timeout)
                pending.setdefault("async", []).extend(tickets)
                conn.send(("ok", [t.mm_hash for t in tickets]))
            elif cmd == "phases":
                conn.send(("ok", {t.mm_hash: (t.state, t.phase) for t in pending.get("async", [])}))
            elif cmd == "hold":
                producer, hashes, timeout = args
                states = ep.hold(producer, hashes, timeout=timeout)
                conn.send(("ok", {h: (s.status, s.detail) for h, s in states.items()}))
            elif cmd == "get_only":
                # Consumer: take READ grants (pins) and never read: a reader that dies after Get.
                producer, hashes, timeout = args
                g = _GetRequest(producer, list(hashes), ep.links.next_req(), time.monotonic() + timeout)
                ep.loop.call(lambda: ep.links.ask(g))
                ep.wait_for(lambda: g.done, timeout + 0.05)
                if not g.done:
                    g.finish("TIMEOUT", "no grant")
                conn.send(("ok", {h: (s.status, s.block) for h, s in g.states.items()}))
            elif cmd == "stall":
                # FAULT INJECTION: block this endpoint's owner (I/O) thread for `args` seconds, as a
                # GC pause, a swapped-out process or a stuck driver call would. Answers at once.
                seconds = float(args)
                started = threading.Event()

                def stall():
                    started.set()
                    time.sleep(seconds)

                ep.loop.call(stall)
                started.wait(10)
                conn.send(("ok", time.monotonic()))
            elif cmd == "drop_read_notifs":
                # FAULT INJECTION: this consumer's read-done notifications are dropped from now on,
                # as if every one were lost on its way to the producer.
                from ec_nixl import protocol as P

                send = ep.links.send
                ep.links.send = lambda link, msg: None if isinstance(msg, P.ReadDone) else send(link, msg)
                conn.send(("ok", None))
            elif cmd == "pushes":
                # Producer: the pushes it is working on, as (mm_hash, 'queued' | 'posted').
                conn.send(("ok", ep.server.pusher.active()))
            elif cmd == "items":
                # Producer: what keeps each published item alive (for assertion messages).
                conn.send(("ok", ep.items.inspect()))
            elif cmd == "stats":
                conn.send(("ok", ep.stats()))
            elif cmd == "published":
                conn.send(("ok", ep.published()))
            elif cmd == "unpublish_all":
                conn.send(("ok", [ep.unpublish(h) for h in ep.published()]))
            elif cmd == "close":
                ep.close()
                conn.send(("ok", None))
                break
            else:
                conn.send(("error", f"unknown command {cmd}"))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


_CTX = None


def _context():
    """A fork server that imported torch and ec-nixl once (no NIXL agent, no CUDA context)."""
    global _CTX
    if _CTX is None:
        method = os.environ.get("EC_NIXL_TEST_START", "forkserver")
        ctx = mp.get_context(method)
        if method == "forkserver":
            ctx.set_forkserver_preload(["peers", "ec_nixl.endpoint", "ec_nixl.barrier"])
        _CTX = ctx
    return _CTX


class PeerProcess:
    """Start an endpoint in its own process; call its commands; kill it at will."""

    default_listen: Any = None

    def __init__(self, env: dict | None = None, start_timeout: float = 120.0, **cfg: Any):
        cfg.setdefault("name", f"{type(self).__name__.lower()}-{os.getpid()}-{time.monotonic_ns() % 10**9}")
        if self.default_listen is not None:
            cfg.setdefault("listen", self.default_listen)
        ctx = _context()
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, cfg, dict(env or {})), daemon=True)
        self.proc.start()
        child.close()
        deadline = time.monotonic() + start_timeout
        while not self._conn.poll(0.1):
            if not self.proc.is_alive() or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{type(self).__name__} did not start (exit code {self.proc.exitcode})")
        status, (self.address, self.incarnation) = self._conn.recv()
        assert status == "ready", self.address
        self.name = cfg["name"]
        self.cfg = cfg

    @property
    def pid(self) -> int:
        return self.proc.pid

    def call(self, cmd: str, args: Any = None, timeout: float = 60.0) -> Any:
        self.send(cmd, args)
        return self.result(cmd, timeout)

    def send(self, cmd: str, args: Any = None) -> None:
        """Start a command without waiting for its answer (``result`` collects it)."""
        self._conn.send((cmd, args))

    def result(self, cmd: str = "?", timeout: float = 60.0) -> Any:
        if not self._conn.poll(timeout):
            raise TimeoutError(f"{type(self).__name__} command {cmd} timed out")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def stop(self) -> None:
        """SIGSTOP: the process freezes (its sockets stay open, nothing answers)."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def cont(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("close", timeout=20)
            except Exception:
                pass
            self.proc.join(10)
        self.kill()


class ProducerProcess(PeerProcess):
    """A producer: serves items on ``listen`` (default: a free port on 127.0.0.1)."""

    default_listen = "127.0.0.1:0"


class ConsumerProcess(PeerProcess):
    """A consumer in its own process (so that it can be killed): ``load`` returns digests."""
