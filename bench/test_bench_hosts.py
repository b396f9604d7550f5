"""``ec-nixl bench`` across hosts: the producer in one network namespace, the consumer in another.

Two hosts made with tests/netns.py (a bridge between two namespaces), ``ec-nixl bench producer``
on host a, ``ec-nixl bench --producer a:PORT`` on host b, both with ``UCX_TLS=tcp``: between
namespaces of one machine UCX would otherwise move the bytes with CMA (it sees one node), which
no real pair of hosts can. UCX's own protocol tables (``UCX_PROTO_INFO=y``) prove the lane:
every READ and WRITE lane is ``tcp/eth0`` between *inter-node* peers. The run checks every
timed item in full (``--check full``), reports ours and raw NIXL at each size, and exits 0;
speed is never asserted.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import netns  # noqa: E402  (tests/netns.py)

PORT = 15790
PATHS = ("ours-read", "ours-write", "raw-nixl-read", "raw-nixl-write")
SIZES = {"64K": 64 << 10, "1M": 1 << 20}


@pytest.fixture
def hosts():
    why = netns.skip_reason()
    if why:
        pytest.skip(why)
    h = netns.Hosts(["a", "b"], tag="bench", root=False)  # nothing here talks from the root namespace
    try:
        yield h
    finally:
        h.close()


def _proto_tables(text: str) -> list[tuple[str, str, list[str]]]:
    """UCX_PROTO_INFO's tables (nixl 1.5.1's UCX prints one per operation and peer kind, on
    stdout): (head: '<agent> inter-node|intra-node|self cfg#N', operation, the lane of each range)."""
    out, head, op, lanes = [], None, None, None
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]] if line.rstrip().endswith("|") else []
        if len(cells) == 1 and re.search(r" (intra-node|inter-node|self) cfg#\d+$", cells[0]):
            if head is not None:
                out.append((head, op, lanes))
            head, op, lanes = cells[0], None, []
        elif len(cells) == 1 and head is not None and op is None:
            op = cells[0]
        elif len(cells) == 3 and head is not None and cells[0] != "Range":
            lanes.append(cells[2])
    if head is not None:
        out.append((head, op, lanes))
    return out


def test_producer_on_one_host_consumer_on_another_over_tcp(hosts, tmp_path):
    env = {**os.environ, "UCX_TLS": "tcp", "UCX_PROTO_INFO": "y",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    py = [sys.executable, "-m", "ec_nixl.cli", "bench"]
    prod_log = open(tmp_path / "producer.log", "w")
    prod = hosts.popen("a", [*py, "producer", "--listen", f"0.0.0.0:{PORT}", "--timeout", "90"], cwd=ROOT, env=env,
                       stdout=prod_log, stderr=subprocess.STDOUT, text=True)
    try:
        out_json = tmp_path / "hosts.json"
        r = hosts.run("b", [*py, "--producer", f"{hosts.addr('a')}:{PORT}", "--device", "cpu",
                            "--sizes", ",".join(SIZES), "--items", "2", "--batch-size", "64K", "--paths", ",".join((*PATHS, "reference-copy")),
                            "--repeats", "3", "--min-repeats", "2", "--warmup", "1", "--budget-s", "0.05",
                            "--idle-s", "0.3", "--check", "full", "--json", str(out_json), "--timeout", "80"],
                      cwd=ROOT, env=env, capture_output=True, text=True, timeout=100)
        prod_rc = prod.wait(timeout=30)  # it serves one run, then exits
    finally:
        if prod.poll() is None:
            prod.kill()
            prod.wait(10)
        prod_log.close()
    prod_text = (tmp_path / "producer.log").read_text()
    text = r.stdout + r.stderr
    assert r.returncode == 0, text[-6000:] + "\n--- producer:\n" + prod_text[-3000:]
    assert prod_rc == 0 and "run 1: done" in prod_text, prod_text[-3000:]

    # ours and the raw-NIXL floor at each size, and a step of two items, in the same run
    doc = json.loads(out_json.read_text())
    got = {(x["path"], x["bytes"], x["items"]) for x in doc["results"]}
    for path in PATHS:
        for nbytes, items in [(n, 1) for n in SIZES.values()] + [(2 * SIZES["64K"], 2)]:
            assert (path, nbytes, items) in got, (path, nbytes, items, sorted(got))
    assert doc["producer"].startswith(f"{hosts.addr('a')}:{PORT} "), doc["producer"]
    assert "reference-copy: skipped: not across hosts" in r.stdout, r.stdout[-3000:]
    assert re.search(r"^ours-read\s+1MiB\s+1\s.*\d\.\d\dx\s+\d+$", r.stdout, re.M), r.stdout[-3000:]  # an 'x raw'

    # UCX saw two nodes and chose TCP for every operation: the consumer READs (ours-read,
    # raw-nixl-read), the producer WRITEs (ours-write, raw-nixl-write); 'self' is an agent's
    # endpoint to itself. Without UCX_TLS=tcp these peers are 'intra-node' and READ is 'cma/memory'.
    for who, log, op in (("consumer", text, "remote memory read"), ("producer", prod_text, "remote memory write")):
        tables = _proto_tables(log)
        assert any("inter-node" in h and o.startswith(op) for h, o, _ in tables), \
            f"{who}: no inter-node '{op}' table from UCX_PROTO_INFO\n{log[-3000:]}"
        for head, o, lanes in tables:
            assert "intra-node" not in head, (who, head, o, lanes)
            assert lanes and all(lane.startswith("tcp/") for lane in lanes), (who, head, o, lanes)
        assert not re.search(r"\b(cma|posix|sysv|xpmem|knem)/", log), f"{who} used shared memory:\n{log[-3000:]}"


def test_control_channel_keeps_what_the_pipe_kept():
    """The TCP channel carries what the pipe did, equal on arrival: tuples stay tuples (the probes
    are compared with ==), descriptors stay ``ItemDesc``; anything else is refused, not pickled."""
    import socket

    from ec_nixl import protocol as P
    from ec_nixl.bench.wire import Channel

    a, b = socket.socketpair()
    ca, cb = Channel.__new__(Channel), Channel.__new__(Channel)
    for c, s in ((ca, a), (cb, b)):
        c.sock, c.peer, c._buf = s, "pair", bytearray()
    desc = P.ItemDesc(mm_hash="h", shape=[2, 3], dtype="bfloat16", nbytes=12)
    msg = ("ok", [([desc], [((1, 2), (3, 4), b"\x00d")], 0.5)], {"k": (1, "x")}, None)
    ca.send(msg)
    assert cb.poll(5) and cb.recv() == msg
    with pytest.raises(TypeError, match="does not carry"):
        ca.send(("ok", object()))
    ca.close()
    with pytest.raises(EOFError):
        cb.recv()
    cb.close()


def test_full_check_sees_a_changed_byte_in_the_middle():
    import numpy as np

    from ec_nixl.bench import memory

    src = np.arange(4096, dtype=np.uint8)
    old = memory.FULL_CHECK
    try:
        memory.FULL_CHECK = True
        want = memory.probe(src)
    finally:
        memory.FULL_CHECK = old
    memory.check(src.copy(), want, "same")
    bad = src.copy()
    bad[2000] ^= 1
    with pytest.raises(AssertionError, match="bytes differ"):
        memory.check(bad, want, "changed")
    memory.check(bad, want[:2], "ends only")  # without the digest only the ends are compared
