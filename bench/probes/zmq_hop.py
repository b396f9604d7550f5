#!/usr/bin/env python3
"""Probe: what one control-plane hop costs on this host, and how much of it is waking threads.

Two processes ping-pong a 64-byte message over ZMQ (DEALER -> ROUTER, as an ec-nixl consumer
talks to a producer), over a plain TCP socket and over a pipe, N round trips each; the round
trip's p50/p10/p90 is printed. Each ZMQ side either *blocks* (in ``zmq.Poller.poll``, as an idle
owner loop does) or *spins* (non-blocking receive in a loop, as ``LoadBarrier.wait`` does on its
READs); a blocking client pauses ``PAUSE_S`` between round trips, a spinning one does not, so its
rows also keep both sides warmer. A ZMQ hop crosses up to three threads (the sender's ZMQ I/O
thread, the receiver's ZMQ I/O thread, the receiver's own thread); a pipe's or a plain socket's
crosses one. If ZMQ costs far more than the socket, the hop's time is thread wake-ups (idle
states, the scheduler), not the wire or our Python.

    python bench/probes/zmq_hop.py [--n 3000] [--transport tcp|ipc|both]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import select
import statistics
import tempfile
import time

MSG = b"x" * 64
PAUSE_S = 0.0002
"""Sleep between round trips of a blocking client: the other side goes idle, as in real traffic.
A spinning client does not pause (so the ZMQ rows where the client spins keep both sides warmer)."""


def timed(n: int, round_trip, pause: float) -> list[float]:
    """Seconds of ``n`` calls of ``round_trip``, ``pause`` apart; the first tenth (warm-up) dropped."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        round_trip()
        out.append(time.perf_counter() - t0)
        if pause:
            time.sleep(pause)
    return out[n // 10:]


def _zmq_recv(sock, poller, spin: bool) -> list:
    """One message's frames: a non-blocking receive in a loop (``spin``), or a poll then a receive."""
    import zmq

    if not spin:
        poller.poll(1000)
        return sock.recv_multipart()
    while True:
        try:
            return sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            pass


def _zmq_echo(addr: str, spin: bool, ready, n: int) -> None:
    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.bind(addr)
    ready.send(s.getsockopt_string(zmq.LAST_ENDPOINT))
    poller = zmq.Poller()
    poller.register(s, zmq.POLLIN)
    for _ in range(n):
        s.send_multipart(_zmq_recv(s, poller, spin))  # [identity, message] back to its sender
    ready.recv()
    s.close(0)
    ctx.term()


def zmq_rtt(addr: str, server_spin: bool, client_spin: bool, n: int) -> list[float]:
    import zmq

    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=_zmq_echo, args=(addr, server_spin, b, n), daemon=True)
    p.start()
    endpoint = a.recv()
    zc = zmq.Context()
    s = zc.socket(zmq.DEALER)
    s.connect(endpoint)
    poller = zmq.Poller()
    poller.register(s, zmq.POLLIN)

    def round_trip() -> None:
        s.send(MSG)
        _zmq_recv(s, poller, client_spin)

    out = timed(n, round_trip, 0.0 if client_spin else PAUSE_S)
    a.send(None)
    p.join(10)
    s.close(0)
    zc.term()
    return out


def _pipe_echo(r: int, w: int, n: int) -> None:
    for _ in range(n):
        select.select([r], [], [])
        os.write(w, os.read(r, 64))


def pipe_rtt(n: int) -> list[float]:
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    ctx = mp.get_context("fork")
    p = ctx.Process(target=_pipe_echo, args=(r1, w2, n), daemon=True)
    p.start()

    def round_trip() -> None:
        os.write(w1, MSG)
        select.select([r2], [], [])
        os.read(r2, 64)

    out = timed(n, round_trip, PAUSE_S)
    p.join(10)
    return out


def _sock_echo(port_conn, n: int) -> None:
    import socket

    srv = socket.create_server(("127.0.0.1", 0))
    port_conn.send(srv.getsockname()[1])
    c, _ = srv.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(n):
        select.select([c], [], [])
        c.sendall(c.recv(64))
    c.close()
    srv.close()


def socket_rtt(n: int) -> list[float]:
    """A plain TCP socket on loopback, both sides blocking in select: what the wire costs
    without ZMQ's I/O threads."""
    import socket

    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=_sock_echo, args=(b, n), daemon=True)
    p.start()
    c = socket.create_connection(("127.0.0.1", a.recv()))
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def round_trip() -> None:
        c.sendall(MSG)
        select.select([c], [], [])
        got = c.recv(64)
        while len(got) < len(MSG):
            got += c.recv(64)

    out = timed(n, round_trip, PAUSE_S)
    p.join(10)
    c.close()
    return out


def show(label: str, xs: list[float]) -> None:
    xs = sorted(xs)
    print(f"{label:44s} round trip p50 {statistics.median(xs) * 1e6:7.1f} us  p10 {xs[len(xs) // 10] * 1e6:7.1f}"
          f"  p90 {xs[len(xs) * 9 // 10] * 1e6:7.1f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--transport", choices=("tcp", "ipc", "both"), default="both")
    a = ap.parse_args()
    print(f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
    show("pipe, both block (one thread wake per hop)", pipe_rtt(a.n))
    show("tcp socket, both block (no ZMQ)", socket_rtt(a.n))
    addrs = []
    if a.transport in ("tcp", "both"):
        addrs.append(("tcp", "tcp://127.0.0.1:*"))
    if a.transport in ("ipc", "both"):
        addrs.append(("ipc", f"ipc://{tempfile.mkdtemp()}/hop"))
    for name, addr in addrs:
        for ss, cs in ((False, False), (True, False), (False, True), (True, True)):
            label = f"zmq {name}, server {'spins' if ss else 'blocks'}, client {'spins' if cs else 'blocks'}"
            show(label, zmq_rtt(addr, ss, cs, a.n))


if __name__ == "__main__":
    main()
