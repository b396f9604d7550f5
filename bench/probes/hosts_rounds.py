#!/usr/bin/env python3
"""Probe: ``ec-nixl bench`` across two hosts made of network namespaces, several rounds, ratios with spread.

One producer (``ec-nixl bench producer --runs N``) in namespace a, N consumer runs in namespace b
one after the other, both over ``UCX_TLS=tcp`` (between namespaces UCX would otherwise use CMA:
see bench/test_bench_hosts.py). Each run times ours and raw NIXL at every size, interleaved per
size; a shared host drifts between runs, so the ratio ours / raw is taken per run and reported as
the median over runs with its min and max. Needs root (tests/netns.py). Every run's JSON and
output stay in --out.

    python bench/probes/hosts_rounds.py [--rounds 5] [--pin 0:1] [--out DIR] [-- BENCH_ARGS...]

``--pin 0:1`` keeps each host's processes on its own CPU: two machines share no cores, and on a
small box two spinning peers (a raw WRITE's initiator and target) otherwise take turns at whole
time slices (raw 64 KiB WRITEs of 4-8 ms instead of 0.05 while other jobs ran).

BENCH_ARGS go to the consumer (default: the sizes 64K,1M,9.8M,64M, ours-read/-write and
raw-nixl-read/-write, no batch case, no idle window).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import netns  # noqa: E402

DEFAULT = ["--device", "cpu", "--sizes", "64K,1M,9.8M,64M", "--items", "0", "--idle-s", "0",
           "--paths", "ours-read,ours-write,raw-nixl-read,raw-nixl-write"]
PAIRS = (("read", "ours-read", "raw-nixl-read"), ("write", "ours-write", "raw-nixl-write"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--port", type=int, default=15700)
    p.add_argument("--out", default="/tmp/ec-nixl-hosts-rounds")
    p.add_argument("--pin", default=None, metavar="CPUS_A:CPUS_B",
                   help="taskset each host's processes to its own CPUs (e.g. 0:1), as two machines would not share cores")
    p.add_argument("bench", nargs="*", help="consumer's ec-nixl bench options (after --)")
    a = p.parse_args()
    why = netns.skip_reason()
    if why:
        print(f"cannot make hosts here: {why}", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    env = {**os.environ, "UCX_TLS": os.environ.get("UCX_TLS", "tcp"),
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    py = [sys.executable, "-m", "ec_nixl.cli", "bench"]
    pin = dict(zip("ab", a.pin.split(":"))) if a.pin else {}
    on = {h: (["taskset", "-c", pin[h]] if h in pin else []) + py for h in "ab"}
    docs, loads = [], []
    hosts = netns.Hosts(["a", "b"], tag="rounds", root=False)
    try:
        with open(os.path.join(a.out, "producer.log"), "w") as plog:
            prod = hosts.popen("a", [*on["a"], "producer", "--listen", f"0.0.0.0:{a.port}", "--runs", str(a.rounds),
                                     "--timeout", "3600"], cwd=ROOT, env=env, stdout=plog, stderr=subprocess.STDOUT)
            try:
                for i in range(a.rounds):
                    js = os.path.join(a.out, f"round{i}.json")
                    t0 = time.monotonic()
                    r = hosts.run("b", [*on["b"], "--producer", f"{hosts.addr('a')}:{a.port}", *(a.bench or DEFAULT),
                                        "--json", js], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
                    with open(os.path.join(a.out, f"round{i}.txt"), "w") as f:
                        f.write(r.stdout + r.stderr)
                    if r.returncode != 0:
                        print(f"round {i}: exit {r.returncode}, TCP so far {tcp_stats(hosts)}\n"
                              f"{(r.stdout + r.stderr)[-3000:]}", file=sys.stderr)
                        return 1
                    docs.append(json.load(open(js)))
                    loads.append(docs[-1].get("load"))
                    print(f"round {i}: {time.monotonic() - t0:.0f} s, load {loads[-1]}, TCP so far {tcp_stats(hosts)}",
                          flush=True)
                prod.wait(60)
            finally:
                if prod.poll() is None:
                    prod.kill()
                    prod.wait(10)
    finally:
        hosts.close()
    summarize(docs)
    return 0


def tcp_stats(hosts) -> dict:
    """Each host's TCP retransmissions and retransmission timeouts so far (its own counters, from
    /proc/net inside its namespace): a link that stalled for seconds shows up here."""
    out = {}
    for h in ("a", "b"):
        r = hosts.run(h, ["cat", "/proc/net/snmp", "/proc/net/netstat"], capture_output=True, text=True, timeout=10)
        lines, vals = r.stdout.splitlines(), {}
        for head, row in zip(lines[0::2], lines[1::2]):
            names, nums = head.split()[1:], row.split()[1:]
            vals.update({f"{head.split(':')[0]}.{n}": v for n, v in zip(names, nums)})
        out[h] = f"retrans {vals.get('Tcp.RetransSegs', '?')} timeouts {vals.get('TcpExt.TCPTimeouts', '?')}"
    return out


def summarize(docs: list) -> None:
    """Per size: each path's p50 (median over runs) and ours / raw per run: median [min - max]."""
    per: dict = {}
    for d in docs:
        for x in d["results"]:
            per.setdefault((x["path"], x["bytes"], x["items"]), []).append(x["p50_us"])
    keys = sorted({(b, i) for (_, b, i) in per})
    print(f"\n{len(docs)} runs; p50 = median over runs of each run's p50; ratio = ours/raw per run, median [min-max]")
    print(f"{'size':>10} {'items':>5} | {'ours-read':>10} {'raw-read':>10} {'read ratio':>20} | "
          f"{'ours-write':>10} {'raw-write':>10} {'write ratio':>20}")
    for b, i in keys:
        cols = []
        for _, ours, raw in PAIRS:
            o, r = per.get((ours, b, i)), per.get((raw, b, i))
            if not (o and r):
                cols.append(f"{'':>10} {'':>10} {'':>20}")
                continue
            ratios = [x / y for x, y in zip(o, r)]
            spread = f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"
            cols.append(f"{_us(statistics.median(o)):>10} {_us(statistics.median(r)):>10} {spread:>20}")
        print(f"{_size(b // i):>10} {i:>5} | " + " | ".join(cols))


def _us(us: float) -> str:
    return f"{us / 1000:.2f} ms" if us >= 1000 else f"{us:.0f} us"


def _size(n: int) -> str:
    for unit, k in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            return f"{n / k:.1f}{unit}" if n % k else f"{n // k}{unit}"
    return f"{n}B"


if __name__ == "__main__":
    sys.exit(main())
