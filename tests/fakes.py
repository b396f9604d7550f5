"""Fakes that inject faults from outside: a raw wire client, a bare NIXL agent, a hostile producer.

Every fake speaks the real wire protocol (``ec_nixl.protocol``) over real ZMQ sockets, and the
agents are real NIXL agents with really registered memory: what is fake is only the behaviour
(a client that skips the handshake or replays one, a producer that lies in its grants). Tests
that use them say so.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

import torch
import zmq

from ec_nixl import protocol as P

# The compat hash of an endpoint configured with no compat fields and the default 64 KiB block.
DEFAULT_COMPAT = P.compat_hash({"block": 64 << 10})


def raw_hello(compat: str = DEFAULT_COMPAT, token: Optional[bytes] = None, **kw) -> P.Hello:
    """A Hello built by hand (signed when ``token`` is given); ``kw`` sets any other field."""
    kw.setdefault("name", "raw-client")
    kw.setdefault("incarnation", "inc")
    kw.setdefault("nonce", P.new_nonce())
    if kw.get("agent_md") is not None:  # metadata comes with its agent name, length and digest
        kw.setdefault("agent", kw["name"])
        for k, v in P.md_fields(kw["agent_md"]).items():
            kw.setdefault(k, v)
    h = P.Hello(version=kw.pop("version", P.PROTOCOL_VERSION), compat=compat, **kw)
    P.sign(h, token)
    return h


class RawClient:
    """A bare ZMQ DEALER speaking the wire protocol by hand (a fuzzer, an attacker)."""

    def __init__(self, address: str, timeout_ms: int = 5000):
        host, port = address.rsplit(":", 1)
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
        self.sock.connect(f"tcp://{host}:{port}")

    def ask(self, data) -> object:
        """Send one message (or raw bytes) and decode the one reply."""
        self.sock.send(data if isinstance(data, bytes) else P.encode(data))
        return P.decode(self.sock.recv())

    def close(self) -> None:
        self.sock.close(0)


class FakeAgent:
    """A real NIXL agent with a small registered buffer, living in the test process."""

    _n = 0

    def __init__(self, nbytes: int = 4 << 20, block: int = 64 << 10, name: Optional[str] = None):
        from ec_nixl.transport import load_nixl

        nixl_agent, nixl_agent_config = load_nixl()
        FakeAgent._n += 1
        self.name = name or f"fake-{os.getpid()}-{FakeAgent._n}"
        self.agent = nixl_agent(self.name, nixl_agent_config(backends=[]))
        self.agent.create_backend("UCX", {})
        self.buf = torch.arange(nbytes, dtype=torch.int64).to(torch.uint8)  # a recognisable pattern
        self.block = block
        self.reg = self.agent.register_memory([(self.buf.data_ptr(), nbytes, 0, "")], "DRAM")
        self.md = self.agent.get_agent_metadata()
        self.arena = P.ArenaInfo(base=self.buf.data_ptr(), size=nbytes, block=block, mem_type="DRAM", device=0)

    def close(self) -> None:
        try:
            self.agent.deregister_memory(self.reg)
        except Exception:
            pass


class FakeProducer:
    """A hostile producer: a ZMQ ROUTER that answers the handshake properly (real NIXL metadata,
    a real registered arena) and then answers each Get with what ``grant(msg)`` returns."""

    def __init__(self, grant: Callable, agent: Optional[FakeAgent] = None, welcome: Optional[Callable] = None):
        self.agent = agent or FakeAgent()
        self.grant = grant
        self.welcome = welcome or (lambda w: w)
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"127.0.0.1:{port}"
        self.incarnation = os.urandom(8).hex()
        self.seen: list = []

    def serve(self) -> None:
        while True:
            try:
                ident, data = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = P.decode(data)
            self.seen.append(msg)
            out = None
            if isinstance(msg, P.Hello):
                out = self.welcome(P.Welcome(version=P.PROTOCOL_VERSION, compat=msg.compat, name=self.agent.name,
                                             incarnation=self.incarnation, session="s-1", nonce=P.new_nonce(),
                                             agent_md=self.agent.md, arena=self.agent.arena, agent=self.agent.name,
                                             **P.md_fields(self.agent.md)))
            elif isinstance(msg, P.Get):
                out = self.grant(msg)
            elif isinstance(msg, P.Heartbeat):
                out = P.Heartbeat(session=msg.session)
            if out is not None:
                self.sock.send_multipart([ident, out if isinstance(out, bytes) else P.encode(out)])

    def close(self) -> None:
        self.sock.close(0)
        self.agent.close()


def pump(cons, fake: FakeProducer, pred: Callable[[], bool], timeout: float) -> bool:
    """Drive an unthreaded consumer and a fake producer in turn until ``pred()``."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        cons.progress(0.001)
        fake.serve()
    return True
