"""The Encode side of the bench: one process, driven by the consumer over a pipe (``proc.call``).

It owns a device endpoint (ours-*, staged-write), a DRAM endpoint (host-bounce, GPU runs), the
source buffer (the encoder outputs, outside any pool; shared with the consumer for the reference
copies) and, when those paths run, a ucxx listener and a plain NIXL agent. Every public method is
a command; the paths' modules say how their items are made (``paths.STAGERS``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import socket
import time

from ec_nixl.bench import memory, proc
from ec_nixl.bench.memory import Source, pin, unpin
from ec_nixl.bench.proc import BenchError
from ec_nixl.bench.paths import STAGERS, ours, raw_nixl, ucx
from ec_nixl.bench.units import BLOCK

CHUNK_SETTLE_S = 30.0
"""Longest a chunk waits for the items of earlier chunks to be freed (``Producer.settle``)."""


class Producer:
    def __init__(self, cfg: dict, conn=None):
        import torch

        from ec_nixl import Endpoint, EndpointConfig

        self.cfg, self.conn = cfg, conn
        memory.FULL_CHECK = cfg.get("check") == "full"
        self.device, self.tmpdir = cfg["device"], cfg["tmpdir"]
        self.cuda = self.device.startswith("cuda")
        if self.cuda:
            torch.cuda.set_device(0)
        else:
            torch.set_num_threads(1)
        pid = os.getpid()
        # On one host the endpoints listen on loopback; across hosts (``remote``) on the control
        # listener's host and known ports, so that a firewall can let exactly those through.
        ep_host, ports = cfg.get("ep_host", "127.0.0.1"), cfg.get("ep_ports", (0, 0))
        common = dict(pool_bytes=cfg["pool_bytes"], block_bytes=BLOCK, threaded=True,
                      announce_lease_s=600.0, grant_lease_s=600.0, evict_unclaimed=False, load_timeout_s=60.0,
                      reserve_wait_s=CHUNK_SETTLE_S,
                      backend_params=cfg.get("backend_params") or {},
                      nixl_progress_thread=cfg.get("nixl_progress_thread"))
        self.ep = Endpoint(EndpointConfig(name=f"ecb-prod-{pid}", device=self.device, listen=f"{ep_host}:{ports[0]}",
                                          **common))
        self.host, self.pinned = None, False
        if self.cuda and "host-bounce" in cfg["paths"]:
            self.host = Endpoint(EndpointConfig(name=f"ecb-prodh-{pid}", device="cpu", listen=f"{ep_host}:{ports[1]}",
                                                **common))
            self.pinned = pin(self.host.pool.arena)
        self.source = Source(self.device, cfg["src_bytes"], self.tmpdir)
        self._cursor, self._n = 0, 0
        self.files: list[str] = []
        self.raw = None
        self.unpublished: dict = {}  # publish-landed: staged groups not yet published

    # --- for the stagers -----------------------------------------------------------------

    def src_region(self, nbytes: int):
        """The next region of the source (rotating, so repeats do not re-read one hot range)."""
        span = self.source.nbytes - nbytes
        off = self._cursor if self._cursor <= span else 0
        self._cursor = off + -(-nbytes // 4096) * 4096
        return self.source.tensor[off : off + nbytes]

    def reserve(self, ep, nbytes: int, tag: str):
        """A slot for one item of a chunk (the chunk began on an empty pool: ``settle``). A chunk
        that cannot fit is the bench's own sizing error, reported in one clear line."""
        from ec_nixl.errors import PoolError

        try:
            return ep.reserve(nbytes, tag=tag)
        except PoolError as e:
            raise BenchError(f"the producer's pool ({ep.pool.capacity} B usable) cannot take item {tag}: {e} "
                             f"(a bench sizing bug, or a --pool-bytes too small for --items)") from None

    def settle(self) -> None:
        """Before a chunk's items are made: wait until the items of earlier chunks are freed.

        The consumer has released all of them, but each is freed only when this process's I/O
        thread has taken the consumer's read-done message, which can lag (a loaded host). First-fit
        would then place the new chunk around the old items; the pools are sized for one chunk,
        so the free space left between could fit no last item, and the chunk's own items (read
        only after this command returns) would keep it split for good. An empty pool first gives
        every chunk the same layout."""
        left = self.drain(CHUNK_SETTLE_S)
        if left:
            held = "; ".join(e.items.held_by() for e in (self.ep, self.host) if e is not None and e.pool.stats().used)
            raise BenchError(f"the producer's pool still holds {left} B of earlier chunks after {CHUNK_SETTLE_S:g} s, "
                             f"although the consumer released them all: {held}")

    def new_hash(self, tag: str) -> str:
        self._n += 1
        return f"{tag}-{self._n}"

    # --- commands ------------------------------------------------------------------------

    def info(self) -> dict:
        import torch

        return {"address": self._advertised(self.ep.address),
                "host_address": self._advertised(self.host.address) if self.host else None,
                "pinned": self.pinned, "ref": self.source.export(), "src_bytes": self.source.nbytes,
                "capacity": self.ep.pool.capacity, "host_capacity": self.host.pool.capacity if self.host else 0,
                "torch": torch.__version__, "pid": os.getpid(), "hostname": socket.gethostname()}

    def _advertised(self, address: str) -> str:
        """``address`` with the host a remote consumer was told to dial (``--advertise``), if any."""
        adv = self.cfg.get("advertise")
        return f"{adv}:{address.rsplit(':', 1)[1]}" if adv else address

    def cpu_seconds(self) -> float:
        """CPU seconds of this process so far, all threads: the idle-cost meter of a consumer on
        another host, which cannot read this process's /proc."""
        t = os.times()
        return t.user + t.system

    def items(self, kind: str, tag: str, spec: tuple, n_ops: int, per_op: int) -> list:
        """``n_ops`` operations of ``per_op`` items each: per op (descs or paths, probes, stage_s)."""
        import torch

        nbytes, shape, dtype = spec
        self.settle()
        return [STAGERS[kind](self, tag, nbytes, shape, getattr(torch, dtype), per_op) for _ in range(n_ops)]

    def stage_unpublished(self, tag: str, spec: tuple, n_ops: int, per_op: int) -> list:
        self.settle()
        return ours.stage_unpublished(self, tag, spec, n_ops, per_op)

    def publish_staged(self, group: str) -> tuple:
        return ours.publish_staged(self, group)

    def publish_when_parked(self, group: str, parked: int, counter: str = "holds_parked") -> tuple:
        return ours.publish_when_parked(self, group, parked, counter)

    def stats(self) -> dict:
        out = {"dev": self.ep.stats()}
        if self.host is not None:
            out["host"] = self.host.stats()
        for v in out.values():
            for k in ("xfer_s", "post_s", "sizes", "wait_s"):
                v.pop(k, None)
        return out

    def drain(self, timeout: float = 10.0) -> int:
        """Wait until every published item was consumed and freed; returns bytes still used."""
        deadline = time.monotonic() + timeout
        eps = [e for e in (self.ep, self.host) if e is not None]
        while time.monotonic() < deadline:
            if all(e.pool.stats().used == 0 for e in eps):
                return 0
            time.sleep(0.002)
        return sum(e.pool.stats().used for e in eps)

    def ucx_start(self) -> int:
        return ucx.serve(self.source.tensor, self.cuda)

    def raw_open(self, peer: dict) -> dict:
        self.raw = raw_nixl.RawAgent(f"ecb-raw-prod-{os.getpid()}", self.device, peer["size"],
                                     self.cfg.get("backend_params") or {}, fill=self.source.tensor,
                                     thread=raw_nixl.progress_thread(self.cfg, "producer"))
        self.raw.connect(peer)
        return self.raw.info()

    def raw_prep(self, nbytes: int, count: int, stride: int) -> list:
        return self.raw.prep(nbytes, count, stride)

    def raw_serve(self) -> None:
        """Be the target of the consumer's raw READs until its next command."""
        raw_nixl.progress_until(self.raw, self.conn, spin=raw_nixl.target_spins(self.cfg))

    def raw_write(self, groups: list) -> list:
        return raw_nixl.write_many(self.raw, groups)

    def raw_stop(self) -> None:
        """Ends a ``raw_serve`` (any command does); nothing else to do."""

    def close(self) -> None:
        for p in self.files:
            try:
                os.unlink(p)
            except OSError:
                pass
        if self.raw is not None:
            self.raw.close()
        if self.host is not None:
            if self.pinned:
                unpin(self.host.pool.arena)
            self.host.close()
        self.ep.close()


def producer_main(cfg: dict, conn, ctl) -> None:
    """Entry point of the spawned producer: serve commands until ``close``."""

    def body(prod: Producer) -> None:
        ctl.send(("ready", None))
        proc.serve(prod, conn, cfg["idle_timeout_s"])

    proc.run_role("producer", cfg, ctl, lambda: Producer(cfg, conn), body)


class ProducerProcess:
    """A bench producer in its own (spawned) process, driven over a pipe: ``rpc(cmd, *args)``.

    For harnesses that time a consumer in their own process (the micro suite's handshake): a
    producer in-process would share the GIL with the timed consumer thread and add up to a switch
    interval (5 ms) to every control-plane hop.
    """

    def __init__(self, device: str = "cpu", pool_bytes: int = 64 << 20, start_timeout: float = 120.0):
        self._tmp = proc.shm_tmpdir()
        cfg = {"device": device, "paths": ["ours-read"], "pool_bytes": pool_bytes, "src_bytes": pool_bytes,
               "tmpdir": self._tmp, "parent_pid": os.getpid(), "idle_timeout_s": 600.0}
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        ctl_r, ctl_w = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=producer_main, args=(cfg, child, ctl_w), daemon=True)
        self.proc.start()
        child.close()
        ctl_w.close()
        try:
            if not ctl_r.poll(start_timeout):
                raise TimeoutError(f"bench producer did not start within {start_timeout} s")
            status, detail = ctl_r.recv()
            if status != "ready":
                raise RuntimeError(detail)
            self.info = self.rpc("info")
        except BaseException:
            self.close()
            raise
        finally:
            ctl_r.close()
        self.address = self.info["address"]

    def rpc(self, cmd: str, *args, timeout: float = 120.0):
        return proc.call(self._conn, cmd, *args, timeout=timeout)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self._conn.send(("close", ()))
                self._conn.poll(20)
            except Exception:
                pass
            self.proc.join(20)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self._conn.close()
        shutil.rmtree(self._tmp, ignore_errors=True)
