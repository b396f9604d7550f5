"""Free TCP ports for servers a test starts (vLLM instances, proxies, event publishers)."""

from __future__ import annotations

import random
import socket


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_block(n: int) -> int:
    """First of ``n`` consecutive free TCP ports (others may run servers on this host too), below
    the ephemeral range: between the pick and an instance's bind, any outgoing connection on the
    host (UCX, ZMQ, HTTP clients) may get a port there as its source port (seen twice: a restarted
    encoder, and the proxy of a fresh rig, could not bind theirs)."""
    rng = random.Random()
    below = _ephemeral_start() - n
    top = below if below > 20000 + 4 * n else 60000 - n
    for _ in range(200):
        base = rng.randrange(20000, top)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")
