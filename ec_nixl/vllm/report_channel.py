"""The workers' step reports to the scheduler, where vLLM carries none (vLLM < 0.32).

vLLM 0.32+ folds each rank's ``build_connector_worker_meta`` into the step's output and hands the
result to the scheduler's ``update_connector_output``. vLLM 0.26 has neither, so each consumer
rank sends the same ``NixlECWorkerMeta`` over a local ZMQ PUSH socket to a PULL socket that the
scheduler binds (ipc, one per engine, DP rank and ``ec_port``, in a directory only this user can
enter: two PDs on one host that share an ``engine_id`` still have their own ports), and
the scheduler drains it once per step. What the reports carry (late fallbacks, link modes, load
times, pool occupancy) then reaches the scheduler's counters as on 0.32+.

Never blocks a step: a report that does not fit the queue is dropped and counted; a malformed
one is logged and dropped. The scheduler may bind after the workers connected (vLLM creates the
workers first): ZMQ connects lazily and keeps what was sent until then.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from typing import Optional

import msgspec
import zmq

from ec_nixl.vllm.metadata import NixlECWorkerMeta

logger = logging.getLogger("ec_nixl.vllm")

QUEUE = 1024
"""Reports queued per socket before new ones are dropped (one per rank and step that had news)."""


def _directory() -> str:
    d = os.path.join(tempfile.gettempdir(), f"ec-nixl-{os.getuid()}")
    os.makedirs(d, mode=0o700, exist_ok=True)
    if os.stat(d).st_uid != os.getuid():
        raise PermissionError(f"{d} belongs to another user: worker reports cannot use it")
    return d


def address(engine_id: str, dp_rank: int, port: int) -> str:
    """The ipc address of one engine's report socket (short: ipc paths have ~100 characters)."""
    key = hashlib.sha256(f"{engine_id}/{dp_rank}/{port}".encode()).hexdigest()[:20]
    return f"ipc://{_directory()}/report-{key}"


class _End:
    """One end of an engine's report socket: its own ZMQ context (the engine's are not ours)."""

    def __init__(self, kind: int, engine_id: str, dp_rank: int, port: int):
        self.address = address(engine_id, dp_rank, port)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(kind)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM if kind == zmq.PULL else zmq.SNDHWM, QUEUE)

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()


class ReportInbox(_End):
    """The scheduler's end: bound once, drained without waiting."""

    def __init__(self, engine_id: str, dp_rank: int, port: int):
        super().__init__(zmq.PULL, engine_id, dp_rank, port)
        self._sock.bind(self.address)
        self._decoder = msgspec.msgpack.Decoder(NixlECWorkerMeta)
        self.malformed = 0

    def drain(self, limit: int = 4 * QUEUE) -> list[NixlECWorkerMeta]:
        out: list[NixlECWorkerMeta] = []
        while len(out) < limit:
            try:
                data = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                out.append(self._decoder.decode(data))
            except (msgspec.DecodeError, TypeError, ValueError) as e:
                self.malformed += 1
                logger.warning("ec-nixl: dropped a malformed worker report (%d bytes): %s", len(data), e)
        return out

    def close(self) -> None:
        super().close()
        path = self.address.removeprefix("ipc://")
        try:
            os.unlink(path)
        except OSError:
            pass


class ReportOutbox(_End):
    """A worker rank's end: one report per step that had news, never waited for."""

    def __init__(self, engine_id: str, dp_rank: int, port: int):
        super().__init__(zmq.PUSH, engine_id, dp_rank, port)
        self._sock.connect(self.address)
        self._encoder = msgspec.msgpack.Encoder()
        self.dropped = 0

    def send(self, report: Optional[NixlECWorkerMeta]) -> bool:
        if report is None:
            return True
        try:
            self._sock.send(self._encoder.encode(report), zmq.NOBLOCK)
            return True
        except zmq.Again:
            self.dropped += 1
            if self.dropped == 1:
                logger.warning("ec-nixl: the scheduler does not take worker reports (queue of %d full): "
                               "dropping them (counters only; loads are not affected)", QUEUE)
            return False

