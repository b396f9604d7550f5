"""A real encoder-cache events publisher in a process of its own, driven over a pipe.

``PublisherProcess`` runs ``ec_nixl.events.publisher.EventPublisher`` (real sockets, its own
thread) in a spawned process; the test sends it changes and waits for each to have gone out
(``drain``), so the order of what a subscriber can see is the test's, not the scheduler's.

One fault injection, a fake on purpose: ``lose`` makes the publisher skip the PUB send of the
named sequence numbers (they stay in its replay buffer), which is what a subscriber sees when
ZMQ drops messages at its high-water mark or a connection blips.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from typing import Any

from ec_nixl.events.publisher import EventPublisher, PublisherConfig


class LossyPublisher(EventPublisher):
    """Fault injection: the first PUB message with a sequence number in ``lost`` is not sent (the
    heartbeats that repeat that number later are)."""

    lost: set[int] = set()

    def _send_pub(self, seq: int, payload: bytes) -> None:
        if seq in self.lost:
            self.lost.discard(seq)
            self.counters["lost_on_purpose"] += 1
            return
        super()._send_pub(seq, payload)


def _serve(conn, cfg_kwargs: dict) -> None:
    cfg_kwargs = dict(cfg_kwargs, mediums=tuple(cfg_kwargs["mediums"]))
    pub = LossyPublisher(PublisherConfig(**cfg_kwargs))
    pub.lost = set()
    conn.send(("ready", pub.endpoint, pub.replay_endpoint))
    while True:
        try:
            cmd, *args = conn.recv()
        except EOFError:
            break
        try:
            if cmd == "store":
                for h, modality, nbytes, medium in args[0]:
                    pub.stored(h, modality, nbytes, medium)
                pub.drain()
                out: Any = True
            elif cmd == "remove":
                for h, medium in args[0]:
                    pub.removed(h, medium)
                pub.drain()
                out = True
            elif cmd == "record":  # changes recorded, not flushed (the storm test floods them)
                for h, modality, nbytes, medium in args[0]:
                    pub.stored(h, modality, nbytes, medium)
                out = len(pub._pending)
            elif cmd == "flush":
                pub.drain()
                out = True
            elif cmd == "lose":
                pub.lost.update(args[0])
                out = True
            elif cmd == "held":
                pub.drain()
                out = pub.held()
            elif cmd == "stats":
                out = pub.stats()
            elif cmd == "exit":
                pub.close()
                conn.send(("ok", True))
                return
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", out))
        except Exception as e:  # the test reads the failure
            conn.send(("error", f"{type(e).__name__}: {e}"))


class PublisherProcess:
    """One publisher process; ``call`` runs a command there and returns its answer."""

    def __init__(self, **cfg_kwargs: Any):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, cfg_kwargs), daemon=True)
        self.proc.start()
        child.close()
        if not self._conn.poll(30):
            self.kill()
            raise RuntimeError("publisher process did not start")
        tag, *rest = self._conn.recv()
        if tag != "ready":
            raise RuntimeError(f"publisher process failed: {rest}")
        self.endpoint, self.replay = rest

    def call(self, cmd: str, *args: Any, timeout: float = 30.0) -> Any:
        self._conn.send((cmd, *args))
        if not self._conn.poll(timeout):
            raise TimeoutError(f"publisher process did not answer {cmd!r}")
        tag, out = self._conn.recv()
        if tag != "ok":
            raise RuntimeError(out)
        return out

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.call("exit", timeout=10)
        except (OSError, EOFError, TimeoutError, RuntimeError):
            pass
        self.kill()
