"""A real producer process for the tests: an ec-nixl Endpoint driven over a pipe.

Tests run the consumer in the test process and one or more producers with ``ProducerProcess``
(spawned, so NIXL, UCX and CUDA start clean). Items are generated from seeds on both sides, so
the consumer can check every byte without shipping the data through the pipe.
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

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def make_item(seed: int, shape: tuple[int, ...], dtype: str, device: str = "cpu") -> torch.Tensor:
    """Deterministic random item (same bytes in every process)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g, dtype=torch.float32).to(DTYPES[dtype])
    return t.to(device)


def digest(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes(),
                           digest_size=16).hexdigest()


def _serve(conn, cfg_kwargs: dict) -> None:
    from ec_nixl.config import EndpointConfig
    from ec_nixl.endpoint import Endpoint, Ready

    dev = cfg_kwargs.get("device", "cpu")
    if dev.startswith("cuda"):
        torch.cuda.set_device(torch.device(dev))
    ep = Endpoint(EndpointConfig(**cfg_kwargs))
    conn.send(("ready", ep.address))
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


class ProducerProcess:
    """Spawn a producer endpoint; call its commands; kill it at will."""

    def __init__(self, **cfg: Any):
        cfg.setdefault("name", f"producer-{os.getpid()}-{time.monotonic_ns() % 10**9}")
        cfg.setdefault("listen", "127.0.0.1:0")
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, cfg), daemon=True)
        self.proc.start()
        if not self._conn.poll(120):
            self.kill()
            raise RuntimeError("producer did not start within 120 s")
        status, self.address = self._conn.recv()
        assert status == "ready", self.address
        self.name = cfg["name"]

    def call(self, cmd: str, args: Any = None, timeout: float = 60.0) -> Any:
        self._conn.send((cmd, args))
        if not self._conn.poll(timeout):
            raise TimeoutError(f"producer command {cmd} timed out")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

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
