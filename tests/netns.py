"""Hosts on one machine: Linux network namespaces on a bridge, for the cross-host tests.

Each host is a network namespace with its own stack and one address on a private /24; the
bridge lives in a namespace of its own (the "switch"), and the root namespace (the test process,
a proxy) is attached to it too, so the test talks to every host directly. What a real network
does to E and PD is done with ``ip`` alone (no nftables, no tc actions on this kernel):

- ``cut(a, b)``: packets between a and b are dropped on arrival, silently, both ways (a policy
  rule ``from <peer> blackhole`` in each, ahead of the local table): TCP sees only silence, the
  others still reach both;
- ``drop(src, dst)``: the same in one direction only (packets from src dropped at dst);
- ``link(host, up=False)``: the host's interface goes down: it vanishes for everyone, its
  processes keep running;
- ``hosts_file``: names resolved inside the namespaces (``ip netns exec`` bind-mounts
  ``/etc/netns/<ns>/hosts`` over ``/etc/hosts``).

Everything made here is named ``ecnx<pid>-...`` and removed by ``close`` (and at the start of
the next run, for the namespaces of processes that are gone), so a failed test leaves nothing
behind and parallel runs do not touch each other's.
"""

from __future__ import annotations

import ipaddress
import os
import random
import shutil
import subprocess
from typing import Optional, Sequence

PREFIX = "ecnx"
NETNS_ETC = "/etc/netns"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip() or r.returncode}")
    return r


def available() -> tuple[bool, str]:
    """Whether namespaces can be made here, and why not."""
    if os.geteuid() != 0:
        return False, "network namespaces need root (the cross-host tests make their own hosts)"
    if shutil.which("ip") is None:
        return False, "no `ip` command (iproute2)"
    name = f"{PREFIX}{os.getpid()}-probe"
    r = _ip("netns", "add", name, check=False)
    if r.returncode != 0:
        return False, f"`ip netns add` fails here: {r.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return True, ""


def sweep() -> None:
    """Remove what runs of processes that are gone left behind (never another live run's)."""
    names = _ip("netns", "list", check=False).stdout.split()
    if os.path.isdir(NETNS_ETC):
        names += os.listdir(NETNS_ETC)
    for name in set(names):
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            _ip("netns", "del", name, check=False)
            shutil.rmtree(os.path.join(NETNS_ETC, name), ignore_errors=True)


def _subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.200-254.x that no route of the root namespace touches."""
    routes = _ip("-4", "route", "show", "table", "all", check=False).stdout
    used = []
    for line in routes.splitlines():
        tok = line.split()[0] if line.split() else ""
        tok = line.split()[1] if tok in ("local", "broadcast", "unicast") and len(line.split()) > 1 else tok
        try:
            used.append(ipaddress.ip_network(tok, strict=False))
        except ValueError:
            continue
    rng = random.Random()
    for _ in range(500):
        net = ipaddress.ip_network(f"10.{rng.randrange(200, 255)}.{rng.randrange(0, 256)}.0/24")
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise RuntimeError("no free private /24 for the test hosts")


class Hosts:
    """Network namespaces ``names`` on one bridge, plus the root namespace (``ROOT``) when
    ``root``: only a test that talks to the hosts over the network itself needs that, and while
    it is attached every UCX agent started in the root namespace sees (and may try to use) its
    interface."""

    ROOT = "root"

    def __init__(self, names: Sequence[str], tag: str = "t", root: bool = True):
        sweep()
        self.names = list(names)
        self.tag = tag
        base = f"{PREFIX}{os.getpid()}-{tag}"
        self.switch = f"{base}-sw"
        self.ns = {h: f"{base}-{h}" for h in self.names}
        self.net = _subnet()
        hosts = list(self.net.hosts())
        self.addrs = {h: str(hosts[i]) for i, h in enumerate(self.names)}
        self.addrs[self.ROOT] = str(hosts[-1])
        self.root_if = f"{PREFIX}{os.getpid() % 10_000_000}"[:15] if root else None
        self._rules: list[tuple[str, str]] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, h in enumerate(self.names):
            ns = self.ns[h]
            _ip("netns", "add", ns)
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{i}", "netns", self.switch)
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.addrs[h]}/{self.net.prefixlen}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", "eth0", "up")
            # the local table moves behind a free slot, so that a blackhole rule can come first
            _ip("-n", ns, "rule", "add", "pref", "100", "lookup", "local")
            _ip("-n", ns, "rule", "del", "pref", "0")
        if self.root_if is None:
            return
        _ip("link", "add", self.root_if, "type", "veth", "peer", "name", "proot", "netns", self.switch)
        _ip("-n", self.switch, "link", "set", "proot", "master", "br0", "up")
        _ip("addr", "add", f"{self.addrs[self.ROOT]}/{self.net.prefixlen}", "dev", self.root_if)
        _ip("link", "set", self.root_if, "up")

    # --- using the hosts ---------------------------------------------------------------

    def addr(self, host: str) -> str:
        return self.addrs[host]

    def argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run on ``host`` (the root namespace runs it as is)."""
        return list(argv) if host == self.ROOT else ["ip", "netns", "exec", self.ns[host], *argv]

    def popen(self, host: str, argv: Sequence[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(self.argv(host, argv), **kw)

    def run(self, host: str, argv: Sequence[str], **kw) -> subprocess.CompletedProcess:
        kw.setdefault("timeout", 60)
        return subprocess.run(self.argv(host, argv), **kw)

    def hosts_file(self, names: dict[str, str]) -> None:
        """Resolve ``name -> host`` inside every namespace (the root's /etc/hosts is not touched)."""
        lines = ["127.0.0.1 localhost"] + [f"{self.addrs[h]} {n}" for n, h in names.items()]
        for ns in self.ns.values():
            d = os.path.join(NETNS_ETC, ns)
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, "hosts"), "w") as f:
                f.write("\n".join(lines) + "\n")

    # --- failing the network -------------------------------------------------------------

    def drop(self, src: str, dst: str) -> None:
        """Packets from ``src`` are dropped silently on arrival at ``dst`` (one direction)."""
        _ip("-n", self.ns[dst], "rule", "add", "pref", "10", "from", self.addrs[src], "blackhole")
        self._rules.append((dst, src))

    def cut(self, a: str, b: str) -> None:
        """No packet between ``a`` and ``b``, either way; both still reach everyone else."""
        self.drop(a, b)
        self.drop(b, a)

    def heal(self) -> None:
        """Undo every ``drop``/``cut``."""
        for dst, src in self._rules:
            _ip("-n", self.ns[dst], "rule", "del", "pref", "10", "from", self.addrs[src], "blackhole", check=False)
        self._rules = []

    def link(self, host: str, up: bool) -> None:
        """Take ``host``'s interface down (it vanishes, its processes run on) or up again."""
        _ip("-n", self.ns[host], "link", "set", "eth0", "up" if up else "down")

    # --- cleanup -------------------------------------------------------------------------

    def close(self) -> None:
        for ns in [*self.ns.values(), self.switch]:
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(os.path.join(NETNS_ETC, ns), ignore_errors=True)
        if self.root_if is not None:
            _ip("link", "del", self.root_if, check=False)  # gone with the switch; this is for a half-built one

    def __enter__(self) -> "Hosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Hosts({self.addrs})"


def skip_reason() -> Optional[str]:
    ok, why = available()
    return None if ok else why
