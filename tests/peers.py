"""Real peer processes for the tests: ec-nixl Endpoints driven over a pipe.

Tests run producers (``ProducerProcess``) and, where a consumer must die or run beside others,
consumers (``ConsumerProcess``) in their own processes. Each is forked from a *fork server* that
has imported torch and ec-nixl once but created no NIXL agent, no UCX context and no CUDA
context, so every peer still starts clean (its agent, pool and sockets are its own) in about half
a second instead of the seconds a fresh interpreter needs to import torch. Items are generated
from seeds on both sides, so the consumer can check every byte without shipping the data through
the pipe.

Some commands are *fault injections* (``stall``, ``drop_read_notifs``): they break a peer on
purpose, the way a real one breaks, so the fault tests can watch the other side cope. What a
command needs of an endpoint's private state it reads through ``helpers`` (its "endpoint
internals" section), never here.
"""

from __future__ import annotations

import ctypes
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


def _load(ep, args, timeout):
    """Load ``args`` = [(desc, producer, reader, readers)], wait at the barrier, digest what it
    handed over (or, where it refused the step, what landed anyway), release.

    The digests are of the tensors the barrier *returned*: a barrier that handed over a slot
    before its bytes landed shows up as a digest mismatch, not as a late failure.
    """
    import helpers
    from ec_nixl.barrier import LoadBarrier
    from ec_nixl.tickets import ItemRef
    from ec_nixl.errors import LoadFailed

    refs = [ItemRef(desc=d, producer=p, reader=r, readers=n) for d, p, r, n in args]
    tickets = ep.load(refs, timeout=timeout)
    try:
        handed = LoadBarrier(ep).wait(tickets)
    except LoadFailed:
        handed = {}
    out = []
    for t in tickets:
        if t.mm_hash in handed:
            out.append((t.mm_hash, "landed", "", digest(handed[t.mm_hash])))
        elif helpers.landed(t):
            out.append((t.mm_hash, "landed", "", digest(t.tensor())))
        else:
            out.append((t.mm_hash, helpers.state(t), t.error or t.reason, ""))
    for t in tickets:
        t.release()
    return out


def _enter_netns(name: str) -> None:
    """Move this process into network namespace ``name`` (``tests/netns.py``: another "host")
    before it opens a socket or an agent: everything it creates from here lives there."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/run/netns/{name}") as f:
        if libc.setns(f.fileno(), 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns into {name} failed")


_USLEEP_HOLDING_GIL = ctypes.PyDLL(None).usleep
"""libc's sleep through ``PyDLL``, which unlike ``CDLL`` does not release the GIL. Looked up once:
loading a library lets go of the GIL, and a hog must start the moment it is called."""


def _hog_gil(seconds: float) -> float:
    """Hold the GIL for ``seconds`` (a busy encoder's Python, a long kernel launch): no other Python
    thread of the process runs meanwhile; ZMQ's and NIXL's own threads do."""
    t0 = time.monotonic()
    _USLEEP_HOLDING_GIL(int(seconds * 1e6))
    return time.monotonic() - t0


def _delay_pushes(seconds: float) -> None:
    """FAULT INJECTION: ``ec-nixl bench e2e``'s EC_NIXL_FAULT_DELAY_PUSH_MS (its sitecustomize's
    import hook cannot apply here: the fork server imported ec_nixl before this env was set), before
    the endpoint (whose loop keeps the pusher's ``poll``) exists."""
    import importlib.util

    import ec_nixl.pusher
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "ec_nixl", "bench", "faults", "sitecustomize.py")
    spec = importlib.util.spec_from_file_location("ec_nixl_bench_faults", path)
    faults = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(faults)
    faults._delay_pushes(ec_nixl.pusher, seconds)


def _serve(conn, cfg_kwargs: dict, env: dict) -> None:
    os.environ.update(env)
    if env.get("EC_NIXL_TEST_NETNS"):
        _enter_netns(env["EC_NIXL_TEST_NETNS"])
    torch.set_num_threads(1)  # several peers share a small machine: no intra-op thread pools
    import helpers
    from ec_nixl.config import EndpointConfig
    from ec_nixl.endpoint import Endpoint
    from ec_nixl.tensors import Ready

    if env.get("EC_NIXL_FAULT_DELAY_PUSH_MS"):
        _delay_pushes(float(env["EC_NIXL_FAULT_DELAY_PUSH_MS"]) / 1e3)
    dev = cfg_kwargs.get("device", "cpu")
    if dev.startswith("cuda"):
        torch.cuda.set_device(torch.device(dev).index or 0)
    ep = Endpoint(EndpointConfig(**cfg_kwargs))
    conn.send(("ready", (ep.address, ep.incarnation)))
    pending: dict[str, list] = {}  # what a command leaves for a later one (load_async batches, ...)
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
            elif cmd == "publish_in_larger_slot":
                # Zero-copy publish into a reserved slot `extra` bytes larger than the item (a
                # producer that reserves for the largest output it may write): only the item's
                # blocks are the consumer's business.
                mm_hash, shape, dtype, seed, extra = args
                t = make_item(seed, shape, dtype, dev)
                slot = ep.reserve(t.numel() * t.element_size() + extra, tag=mm_hash)
                slot.bytes().fill_(0x3C)
                slot.bytes()[: t.numel() * t.element_size()].copy_(t.reshape(-1).view(torch.uint8))
                if dev.startswith("cuda"):
                    torch.cuda.synchronize()
                conn.send(("ok", ep.publish_slot(mm_hash, slot, t.shape, t.dtype)))
            elif cmd == "publish_behind_kernel":
                # GPU: the item is written by a kernel queued behind `cycles` of busy stream
                # (torch.cuda._sleep) and published at once; publish() guards it with a CUDA event,
                # so it is NOT_READY until the stream gets there. Answers without waiting for it.
                mm_hash, shape, dtype, seed, cycles = args
                if not dev.startswith("cuda"):
                    raise ValueError("publish_behind_kernel needs a CUDA producer")
                final = make_item(seed, shape, dtype, dev)
                torch.cuda.synchronize()
                torch.cuda._sleep(int(cycles))
                t = final.clone()  # runs when the sleep ends
                conn.send(("ok", ep.publish(mm_hash, t)))
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
                conn.send(("ok", {t.mm_hash: (helpers.state(t), helpers.phase(t)) for t in pending.get("async", [])}))
            elif cmd == "hold":
                producer, hashes, timeout = args
                states = ep.hold(producer, hashes, timeout=timeout)
                conn.send(("ok", {h: (s.status, s.detail) for h, s in states.items()}))
            elif cmd == "query_stats":
                # Consumer: a producer's stats; the first call also shakes hands with it.
                producer, timeout = args
                conn.send(("ok", ep.query_stats(producer, timeout=timeout)))
            elif cmd == "get_only":
                # Consumer: take READ grants (pins) and never read: a reader that dies after Get.
                producer, hashes, timeout = args
                conn.send(("ok", helpers.get_only(ep, producer, hashes, timeout)))
            elif cmd == "stall":
                # FAULT INJECTION: block this endpoint's owner (I/O) thread for `args` seconds, as a
                # GC pause, a swapped-out process or a stuck driver call would. Answers at once.
                seconds = float(args)
                started = threading.Event()

                def stall():
                    started.set()
                    time.sleep(seconds)

                helpers.run_on_owner(ep, stall)
                started.wait(10)
                conn.send(("ok", time.monotonic()))
            elif cmd == "publish_and_hog":
                # A vLLM runner: publish, then go on in Python for `hog` seconds (holding the GIL
                # throughout). Answers (monotonic time the hog began, seconds it held the GIL).
                # Nothing between the publish and the hog lets go of the GIL.
                (mm_hash, shape, dtype, seed), hog = args
                t = make_item(seed, shape, dtype, dev)
                if dev.startswith("cuda"):
                    torch.cuda.synchronize()
                ep.publish(mm_hash, t)
                t_hog = time.monotonic()
                conn.send(("ok", (t_hog, _hog_gil(float(hog)))))
            elif cmd == "publish_while_parking":
                # FAULT INJECTION (a race): the next waiting request's item is published between the
                # server's look at the table and its handing the request to the native hand-off
                # (``what``: "note", a Hold; "arm", a Push), as another thread's publish could be, so
                # that publish does not see it there (``helpers.publish_before`` runs it inside the
                # server's call). Answers once the injection is in place; "parking_published_at"
                # then gives the monotonic time of that publish.
                (mm_hash, shape, dtype, seed), what = args
                t = make_item(seed, shape, dtype, dev)
                if dev.startswith("cuda"):
                    torch.cuda.synchronize()
                published_at = pending["parking_published_at"] = []

                def publish():
                    ep.publish(mm_hash, t)
                    published_at.append(time.monotonic())

                helpers.publish_before(ep, what, publish)
                conn.send(("ok", None))
            elif cmd == "parking_published_at":
                # After "publish_while_parking": when its publish ran (None: no request parked in `args` s).
                published_at = pending.get("parking_published_at", [])
                helpers.wait_until(lambda: bool(published_at), float(args))
                conn.send(("ok", published_at[0] if published_at else None))
            elif cmd == "hog_gil":
                # FAULT INJECTION: a producer busy in Python (encoding) for `args` seconds: the
                # answer comes after it, with the seconds it really held the GIL.
                conn.send(("ok", _hog_gil(float(args))))
            elif cmd == "drop_read_notifs":
                # FAULT INJECTION: this consumer's read-done messages are dropped from now on,
                # as if every one were lost on its way to the producer.
                helpers.drop_read_done(ep)
                conn.send(("ok", None))
            elif cmd == "pushes":
                # Producer: the pushes it is working on, as (mm_hash, 'queued' | 'posted').
                conn.send(("ok", helpers.producer_pushes(ep)))
            elif cmd == "items":
                # Producer: what keeps each published item alive (for assertion messages).
                conn.send(("ok", helpers.producer_items(ep)))
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
            ctx.set_forkserver_preload(["peers", "helpers", "ec_nixl.endpoint", "ec_nixl.barrier"])
        _CTX = ctx
    return _CTX


class PeerProcess:
    """Start an endpoint in its own process; call its commands; kill it at will."""

    default_listen: Any = None

    def __init__(self, env: dict | None = None, start_timeout: float = 120.0, netns: str | None = None,
                 **cfg: Any):
        """``netns``: a network namespace to run in (another host, ``tests/netns.py``)."""
        if netns:
            env = dict(env or {}, EC_NIXL_TEST_NETNS=netns)
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

    def answered(self) -> bool:
        """Whether the command started with ``send`` has answered (without collecting it)."""
        return self._conn.poll()

    def result(self, cmd: str = "?", timeout: float = 60.0) -> Any:
        if not self._conn.poll(timeout):
            raise TimeoutError(f"{type(self).__name__} command {cmd} timed out")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def stop(self, timeout: float = 10.0) -> None:
        """SIGSTOP: the process freezes (its sockets stay open, nothing answers). Returns once
        every thread of it is stopped: the signal is delivered asynchronously, and on a loaded
        machine a peer may run on for a while after ``kill`` returned."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while not self._stopped():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{type(self).__name__} {self.proc.pid} not stopped {timeout}s after SIGSTOP")
            time.sleep(0.001)

    def _stopped(self) -> bool:
        task = f"/proc/{self.proc.pid}/task"
        try:
            for tid in os.listdir(task):
                with open(f"{task}/{tid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] not in ("T", "t"):
                        return False
        except FileNotFoundError:  # gone (or a thread ended while we looked): check again
            return not self.proc.is_alive()
        return True

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
