"""Real vLLM E and PD on two hosts (network namespaces, tests/netns.py), and the network between
them failing while both keep running.

Why namespaces: every other e2e test runs E and PD on one loopback, where UCX moves DRAM with
CMA (process-to-process copies) and a "dead" producer is always a refused connection. Between
hosts a producer can also go silent (a cut, a one-way drop, a host that vanishes), names must
resolve where the consumer runs, and the bytes go over a real NIC's TCP lane. Namespaces give
each server its own network stack on this one box (and in CI, which runs as root).

Servers (started once for the module, ~1.5 min on 2 cores):

* the session's colocated ``baseline`` (tests/e2e/conftest.py);
* host ``e``: ``encoder-a`` with ``ec_ip`` = e's address (case a), and ``encoder-b`` with
  ``ec_ip`` 0.0.0.0 and ``advertise_host`` ``encoder-host`` (cases b and c in one server: it binds
  every address and announces a name, which only ``pd``'s /etc/hosts resolves;
  ``Hosts.hosts_file``, written before the servers start). Both on the first core;
* host ``pd``: ``pd`` (consumer, all connector settings at their defaults), on the last core, its
  vision tower corrupted: in its own mount namespace (``ip netns exec`` makes one) a copy of the
  model whose ``visual.*`` weights are other random numbers is mounted over the model directory,
  so the path (which the mm hashes and the compat hash are made of) is the same and only its own
  embeddings differ. Its tokens equal the baseline's only when it used E's transferred
  embeddings; ``test_pd_tower_is_corrupted`` checks that its own encoding really differs;
* the root namespace (this process): one proxy per encoder (``ec_nixl.disagg.proxy``, E then PD),
  an observer endpoint for the producers' stats, and every request.

UCX: E and PD run with ``UCX_TLS=tcp`` and ``UCX_PROTO_INFO=y``. Left alone, UCX (one kernel,
one IPC namespace) calls the namespaces "intra-node" and READs over ``cma/memory``; with tcp only
it must say "inter-node" and move the bytes over ``tcp/eth0``, which the case below reads back
from the logs. ``UCX_NET_DEVICES`` is not set: UCX must find the right interface by itself, as
it would between real hosts.

Failure cases. The PD's tower is corrupted, so a request that was encoded locally does not give
the baseline's tokens; instead each fallen-back request must be answered 200 and say how it was
served: the PD's answer lists the item under ``ec_nixl_consumer.local``, its counters show a local
fallback and no landed load (the proxy's encoder fallback sends no params at all, and the answer
carries ``X-EC-Fallback``). Token equality is asserted for every request that should have
transferred, before and after each failure. Bounds (the connector's defaults: ``link_timeout_s``
2 s, pings every 0.5 s; a refused connection fails at once; see ec_nixl/links.py) are named
constants below, added to the time one local-encode request takes, measured in the same test;
measured times are printed as ``[timing]`` lines. One bound is not the connector's: when E's
host vanishes, a proxied request is given up on by the proxy's encoder watch (its defaults:
``/health`` every 1 s, 2 s allowed; ``PROXY_ENCODER_LOST_S``). After each case the engines answer /health and
the producer's pool is empty again (unclaimed items expire after the encoders' short
``announce_lease_s``, set here so that this takes seconds, not a minute).

    pytest -m e2e tests/e2e/test_e2e_hosts.py -v -s
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

pytest.importorskip("vllm")
requests = pytest.importorskip("requests")

import netns  # noqa: E402  (tests/netns.py)
from conftest import (  # noqa: E402  (tests/e2e/conftest.py)
    BASE_ENV,
    COMMON_VLLM_ARGS,
    REQUEST_TIMEOUT_S,
    STARTUP_TIMEOUT_S,
    Baseline,
    free_port_block,
    nixl_metrics,
    token_ids,
    wait_until,
)
from ec_nixl.disagg.launcher import Instance, Supervisor, group_alive, instance_env, vllm_argv  # noqa: E402
from ec_nixl.disagg.proxy import ProxyConfig, encoder_body  # noqa: E402
from ec_nixl.disagg.ttft import chat_body  # noqa: E402
from ec_nixl.links import FAILED_BACKOFF_MAX_S  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

VLLM_ARGS = list(COMMON_VLLM_ARGS)  # log stats on: the PD's /metrics carries the connector's series
POOL_BYTES = 64 << 20
ANNOUNCE_LEASE_S = 5.0
"""Encoders keep an item nobody held this long (default 60 s): items published for requests whose
PD could not reach them are gone seconds after each case, so the drained check stays short."""
UCX_ENV = {"UCX_TLS": "tcp", "UCX_PROTO_INFO": "y"}

# Bounds on top of one local encode (measured in each test):
LOST_PRODUCER_S = 3.0
"""A producer that went silent (cut, dropped, host gone): link_timeout_s (2 s) and at most a
quarter of it more, plus scheduling slack."""
REFUSED_S = 1.0
"""A producer whose process died on a live host: the connection is reset or refused at once."""
PROXY_ENCODER_LOST_S = ProxyConfig.encoder_watch_s + ProxyConfig.encoder_watch_timeout_s + 1.0
"""An encoder whose host vanished while it runs a proxied request: the request itself goes out on
the proxy's idle keep-alive connection (no connect that could fail), so before the encoder watch
it waited out ``--encode-timeout`` (seen: 120 s). The watch asks the encoder's ``/health`` every
``encoder_watch_s`` over a new connection and gives up after ``encoder_watch_timeout_s``; the
request then goes to the PD without params. Plus 1 s of slack."""
DRAIN_S = ANNOUNCE_LEASE_S + 10.0
HEALTH_S = 10.0

LANDED = "vllm:nixl_ec_num_loads_landed_total"
FALLBACKS = "vllm:nixl_ec_num_local_fallbacks_total"
FAILED_LOADS = "vllm:nixl_ec_num_failed_loads_total"
OUTCOME = "ec_nixl_consumer"

TIMINGS: dict[str, float] = {}


def timing(name: str, seconds: float) -> float:
    TIMINGS[name] = seconds
    print(f"[timing] {name}: {seconds:.2f}s", flush=True)
    return seconds


@dataclass
class HostInstance(Instance):
    """An instance listening on a namespace's address (``Instance.url`` is loopback)."""

    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass
class Deploy:
    hosts: netns.Hosts
    sup: Supervisor
    enc_a: HostInstance  # ec_ip = e's address
    enc_b: HostInstance  # ec_ip 0.0.0.0, advertise_host encoder-host
    pd: HostInstance
    proxy_a: Instance  # encoder-a -> pd
    proxy_b: Instance  # encoder-b -> pd
    model: str
    log_dir: Path
    status_ep: Any  # observer Endpoint (root namespace)

    def ec_addr(self, inst: HostInstance) -> str:
        """The producer's side channel as the root namespace reaches it."""
        return f"{self.hosts.addr('e')}:{inst.ec_transfer_config['ec_port']}"

    def producer_stats(self, inst: HostInstance) -> Optional[dict[str, Any]]:
        """None while it cannot be reached (the observer backs off after failures too)."""
        try:
            return self.status_ep.query_stats(self.ec_addr(inst), timeout=5.0)
        except Exception as e:  # noqa: BLE001  (unreachable, timed out: the caller retries)
            print(f"stats of {inst.name}: {e}", flush=True)
            return None

    def metrics(self) -> dict[str, float]:
        return nixl_metrics(self.pd.url)

    def logs(self) -> str:
        return f"(logs: {self.log_dir})"


@pytest.fixture(scope="module")
def hosts() -> Iterator[netns.Hosts]:
    why = netns.skip_reason()
    if why is not None:
        pytest.skip(why)
    # root=True: the proxies and this process reach both hosts over the bridge (the module's
    # UCX agents all run inside the two namespaces, so none sees the root's veth come and go).
    h = netns.Hosts(["e", "pd"], tag="e2e", root=True)
    try:
        h.hosts_file({"encoder-host": "e"})  # before any server starts: ip netns exec mounts it then
        yield h
    finally:
        h.close()


def corrupt_tower(model: str, out: Path) -> str:
    """A copy of ``model`` whose vision weights are other random numbers of the same mean and spread
    (seeded): a working tower that encodes every image differently."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out)
    f = out / "model.safetensors"
    tensors = load_file(str(f))
    g = torch.Generator().manual_seed(1)
    for k, t in tensors.items():
        if "visual." in k and t.numel() > 1 and float(t.float().std()) > 0:
            x = t.float()
            tensors[k] = (torch.randn(x.shape, generator=g) * x.std() + x.mean()).to(t.dtype)
    save_file(tensors, str(f), metadata={"format": "pt"})
    return str(out)


def _ec_config(role: str, engine_id: str, ip: str, port: int, extra: dict[str, str]) -> dict[str, Any]:
    return {"ec_connector": "NixlECConnector", "ec_role": role, "engine_id": engine_id, "ec_ip": ip,
            "ec_port": port, "ec_buffer_device": "cpu", "ec_buffer_size": POOL_BYTES,
            "ec_connector_extra_config": extra}


@pytest.fixture(scope="module")
def deploy(hosts: netns.Hosts, baseline: Baseline, tiny_model: str,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deploy]:
    from ec_nixl.config import EndpointConfig
    from ec_nixl.endpoint import Endpoint

    log_dir = tmp_path_factory.mktemp("hosts") / "logs"
    cores = sorted(os.sched_getaffinity(0))
    e_core, pd_core = str(cores[0]), str(cores[-1])  # E on one core, PD (and the baseline) on the other
    http, ec = 8100, 15600  # each namespace has all its ports free
    lease = {"announce_lease_s": str(ANNOUNCE_LEASE_S)}

    def vllm(name: str, ns: str, port: int, ecfg: dict[str, Any], core: str, prefix: tuple = ()) -> HostInstance:
        argv = vllm_argv(tiny_model, port, VLLM_ARGS, ecfg)
        argv[argv.index("--host") + 1] = "0.0.0.0"
        env = instance_env(dict(os.environ), core, None, {**BASE_ENV, **UCX_ENV})
        return HostInstance(name=name, role="pd" if ns == "pd" else "encoder", port=port,
                            argv=hosts.argv(ns, [*prefix, *argv]), env=env, log_path=log_dir / f"{name}.log",
                            ec_transfer_config=ecfg, host=hosts.addr(ns))

    enc_a = vllm("encoder-a", "e", http, _ec_config("ec_producer", "encoder-a", hosts.addr("e"), ec, lease),
                 e_core)
    enc_b = vllm("encoder-b", "e", http + 1,
                 _ec_config("ec_producer", "encoder-b", "0.0.0.0", ec + 8, {**lease, "advertise_host": "encoder-host"}),
                 e_core)
    # The corrupted copy is mounted in the PD's own mount namespace only; it goes with the process.
    over = ("sh", "-c", 'mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh",
            corrupt_tower(tiny_model, log_dir.parent / "tiny-vl-corrupt"), tiny_model)
    pd = vllm("pd", "pd", http, _ec_config("ec_consumer", "pd", hosts.addr("pd"), ec, {}), pd_core, over)
    with Supervisor() as sup:
        for inst in (enc_a, enc_b, pd):
            sup.spawn(inst)
        sup.wait_healthy([enc_a, enc_b, pd], STARTUP_TIMEOUT_S)
        proxies = []
        for name, enc in (("proxy-a", enc_a), ("proxy-b", enc_b)):
            port = free_port_block(1)
            proxies.append(sup.spawn(Instance(
                name=name, role="proxy", port=port, env=dict(os.environ), log_path=log_dir / f"{name}.log",
                argv=[sys.executable, "-m", "ec_nixl.disagg.proxy", "--encoders", enc.url, "--pd", pd.url,
                      "--host", "127.0.0.1", "--port", str(port)])))
        sup.wait_healthy(proxies, 60.0)
        ep = Endpoint(EndpointConfig(name=f"e2e-hosts-status-{os.getpid()}", pool_bytes=0, threaded=True,
                                     observer=True))
        try:
            yield Deploy(hosts, sup, enc_a, enc_b, pd, proxies[0], proxies[1], tiny_model, log_dir, ep)
        finally:
            ep.close()
            print("[timing] summary: " + ", ".join(f"{k} {v:.2f}s" for k, v in TIMINGS.items()), flush=True)


# ------------------------------------------------------------------------------------------ helpers


def _post(url: str, body: dict[str, Any]) -> tuple[requests.Response, float]:
    t0 = time.monotonic()
    r = requests.post(url + "/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    return r, time.monotonic() - t0


def producer_params(inst: HostInstance, body: dict[str, Any]) -> dict[str, Any]:
    """The proxy's first step by hand: the encoder's 1-token answer carries ``ec_transfer_params``."""
    r, _ = _post(inst.url, encoder_body(body))
    assert r.status_code == 200, r.text[:500]
    params = r.json().get("ec_transfer_params")
    assert isinstance(params, dict) and params, f"no ec_transfer_params from {inst.name}: {r.text[:500]}"
    return params


def counters_after(d: Deploy, before: dict[str, float], landed: int, fallbacks: int = 0) -> dict[str, float]:
    """Deltas once ``landed`` loads and ``fallbacks`` fallbacks are counted (the front-end records
    a step's stats around the answer), or after a few seconds."""
    def delta() -> dict[str, float]:
        m = d.metrics()
        return {k: m.get(k, 0.0) - before.get(k, 0.0) for k in (LANDED, FALLBACKS, FAILED_LOADS)}

    got = wait_until(lambda: (x := delta())[LANDED] >= landed and x[FALLBACKS] >= fallbacks and x, 5.0)
    if got:
        time.sleep(0.3)  # and nothing more comes in
    return delta()


def outcome(r: requests.Response) -> dict[str, list[str]]:
    return (r.json().get("ec_transfer_params") or {}).get(OUTCOME) or {}


def assert_transfers(d: Deploy, baseline: Baseline, url: str, body: dict[str, Any], what: str) -> float:
    """One request that must go over NIXL: the baseline's tokens, every image landed, no fallback."""
    n = len(body["messages"][0]["content"]) - 1
    expected = baseline.token_ids(body)
    before = d.metrics()
    r, took = _post(url, body)
    assert r.status_code == 200, f"{what}: HTTP {r.status_code}: {r.text[:500]} {d.logs()}"
    c = counters_after(d, before, n)
    assert r.json()["choices"][0]["token_ids"] == expected, f"{what}: tokens differ from colocated {d.logs()}"
    assert c[LANDED] == n and c[FALLBACKS] == 0 and c[FAILED_LOADS] == 0, f"{what}: PD counter deltas {c} {d.logs()}"
    return took


def assert_fell_back(d: Deploy, r: requests.Response, before: dict[str, float], n: int, what: str) -> None:
    """Answered, and the PD says it encoded the ``n`` images itself (its tower: not the baseline's
    tokens, so they are not compared)."""
    assert r.status_code == 200, f"{what}: HTTP {r.status_code}: {r.text[:500]} {d.logs()}"
    assert len(outcome(r).get("local", [])) == n and not outcome(r).get("loaded"), (
        f"{what}: answer says {outcome(r)} {d.logs()}")
    c = counters_after(d, before, 0, n)
    assert c[LANDED] == 0 and c[FALLBACKS] == n, f"{what}: PD counter deltas {c} {d.logs()}"


def local_encode_s(d: Deploy, tag: str) -> float:
    """How long the PD takes for a one-image request it encodes itself (no params: the connector
    is not involved), on this box, now."""
    r, took = _post(d.pd.url, chat_body(d.model, [(96, 80)], tag))
    assert r.status_code == 200, r.text[:500]
    return timing(f"{tag} (PD encodes itself)", took)


def assert_healthy_and_drained(d: Deploy, producers: list[HostInstance]) -> None:
    """Every engine still up, and each producer's pool and items back to 0."""
    for inst in [d.pd, *producers]:
        ok = wait_until(lambda: _health(inst.url) == 200, HEALTH_S)
        assert ok, f"{inst.name} /health not 200 {d.logs()}"
    for inst in producers:
        last: dict[str, Any] = {}

        def drained() -> bool:
            st = d.producer_stats(inst)
            if st is None:
                return False
            last.update(st)
            return st["pool"]["used"] == 0 and st["items"] == 0

        t0 = time.monotonic()
        ok = wait_until(drained, DRAIN_S, interval_s=0.5)
        assert ok, f"{inst.name} still holds {last.get('items')} items, pool {last.get('pool')} {d.logs()}"
        timing(f"{inst.name} pool empty after", time.monotonic() - t0)


def _health(url: str) -> int:
    try:
        return requests.get(url + "/health", timeout=5).status_code
    except requests.RequestException:
        return 0


# ------------------------------------------------------------------------------------------ cases


def test_pd_tower_is_corrupted(deploy: Deploy, baseline: Baseline) -> None:
    """The premise of every token check here: what the PD encodes itself differs from the baseline."""
    body = chat_body(deploy.model, [(96, 80), (112, 84)], "hosts-tower")
    r, _ = _post(deploy.pd.url, body)
    assert r.status_code == 200, r.text[:500]
    assert r.json()["choices"][0]["token_ids"] != baseline.token_ids(body), (
        f"the PD's corrupted tower gives the baseline's tokens: token equality would "
        f"not prove a transfer {deploy.logs()}")


ADDRESSES = [("ip", "enc_a"), ("name", "enc_b")]


@pytest.mark.parametrize("kind,attr", ADDRESSES, ids=[a[0] for a in ADDRESSES])
def test_transfers_across_hosts(deploy: Deploy, baseline: Baseline, kind: str, attr: str) -> None:
    """(a) ec_ip = E's address, announced as such; (b, c) ec_ip 0.0.0.0 with advertise_host a name
    that only the PD's host resolves. Both through the PD directly and through the proxy."""
    d = deploy
    enc: HostInstance = getattr(d, attr)
    want = {"ip": f"{d.hosts.addr('e')}:{enc.ec_transfer_config['ec_port']}",
            "name": f"encoder-host:{enc.ec_transfer_config['ec_port']}"}[kind]
    body = chat_body(d.model, [(96, 80), (56, 56)], f"hosts-direct-{kind}")
    params = producer_params(enc, body)
    producers = {e["ec_nixl"]["producer"] for e in params.values()}
    assert producers == {want}, f"{enc.name} announces {producers}, expected {want}"
    took = assert_transfers(d, baseline, d.pd.url, dict(body, ec_transfer_params=params), f"{kind} direct")
    timing(f"{kind}: PD request with E's params", took)
    proxy = d.proxy_a if attr == "enc_a" else d.proxy_b
    for i, sizes in enumerate([[(112, 84)], [(64, 100), (80, 120), (150, 120)]]):
        took = assert_transfers(d, baseline, proxy.url, chat_body(d.model, sizes, f"hosts-proxy-{kind}-{i}"),
                                f"{kind} proxy {i}")
        timing(f"{kind}: proxied request, {len(sizes)} image(s)", took)
    assert_healthy_and_drained(d, [enc])


UCX_LANE = re.compile(r"\|\s*[0-9.inf]+\s*\|[^|]*\|\s*([a-z_0-9]+/[A-Za-z_0-9.:-]+)")


def _ucx_tables(text: str) -> list[tuple[str, list[str]]]:
    """UCX_PROTO_INFO's tables: (title, lanes) for each, e.g. ("remote memory read by ucp_get*...",
    ["tcp/eth0"])."""
    out: list[tuple[str, list[str]]] = []
    title: Optional[str] = None
    for line in text.splitlines():
        cell = line.split("|")
        if len(cell) == 3 and ("by ucp_" in cell[1] or "inter-node" in cell[1] or "intra-node" in cell[1]):
            t = cell[1].strip()
            if "by ucp_" in t:
                title = t
                out.append((t, []))
            continue
        m = UCX_LANE.search(line)
        if m and title is not None and out:
            out[-1][1].append(m.group(1))
    return out


def test_ucx_moves_the_bytes_over_tcp(deploy: Deploy) -> None:
    """What UCX chose, from its own report (UCX_PROTO_INFO=y) in the E and PD logs: the peers are
    "inter-node", the transfer lane (remote memory read/write) is tcp on eth0, and no shared-memory
    transport (cma, sysv, posix, xpmem, knem) appears anywhere."""
    d = deploy
    text = {i.name: i.log_path.read_text(errors="replace") for i in (d.pd, d.enc_a, d.enc_b)}
    ucx = {n: [ln for ln in t.splitlines() if re.match(r"\[\d+\.\d+\] \[", ln)] for n, t in text.items()}
    assert ucx["pd"], f"no UCX_PROTO_INFO output in the PD log {d.logs()}"
    tables = {n: _ucx_tables("\n".join(lines)) for n, lines in ucx.items()}
    moves = {n: [(t, lanes) for t, lanes in ts if t.startswith("remote memory")] for n, ts in tables.items()}
    print("UCX transfer lanes: " + "; ".join(f"{n}: {sorted({(t.split(' by ')[0], ln) for t, ls in m for ln in ls})}"
                                              for n, m in moves.items()))
    assert any(moves.values()), f"no remote memory read/write protocol reported {d.logs()}"
    for n, m in moves.items():
        for title, lanes in m:
            assert lanes and set(lanes) == {"tcp/eth0"}, f"{n}: {title}: lanes {lanes}"
    allofit = "\n".join(ln for lines in ucx.values() for ln in lines)
    assert "inter-node" in allofit and "intra-node" not in allofit, "UCX thinks E and PD share a node"
    shm = sorted(set(re.findall(r"\b(cma|sysv|posix|xpmem|knem|shm)\b", allofit)))
    assert not shm, f"shared-memory transports in UCX's report: {shm}"


# ------------------------------------------------------------------------------------------ failures

RESUME_S = FAILED_BACKOFF_MAX_S + LOST_PRODUCER_S
"""After the network heals: the PD retries a producer it failed on after its back-off (at most
``FAILED_BACKOFF_MAX_S``), then one handshake."""


def resume(d: Deploy, baseline: Baseline, proxy: Instance, tag: str) -> None:
    """Nothing restarted: fresh requests through ``proxy`` until one is loaded again (those in the
    PD's back-off window fall back), within ``RESUME_S``; then two more must transfer with no
    fallback at all, token-identical."""
    t0, fell_back, i = time.monotonic(), 0, 0
    while True:
        body = chat_body(d.model, [(80, 120)], f"{tag}-resume-{i}")
        r, _ = _post(proxy.url, body)
        assert r.status_code == 200, f"{tag}: HTTP {r.status_code}: {r.text[:500]} {d.logs()}"
        if outcome(r).get("loaded"):
            assert r.json()["choices"][0]["token_ids"] == baseline.token_ids(body), f"{tag}: tokens differ {d.logs()}"
            break
        fell_back += 1
        assert time.monotonic() - t0 < RESUME_S, f"{tag}: no transfer {RESUME_S:.0f}s after the network healed {d.logs()}"
        time.sleep(0.25)
        i += 1
    timing(f"{tag}: first transfer after the network healed ({fell_back} fell back before)", time.monotonic() - t0)
    for j, sizes in enumerate([[(96, 96)], [(60, 90), (120, 100)]]):
        assert_transfers(d, baseline, proxy.url, chat_body(d.model, sizes, f"{tag}-after-{j}"), f"{tag} after {j}")


def silent_producer(d: Deploy, tag: str, t_local: float, params_body: tuple[dict[str, Any], dict[str, Any]],
                    t_enc: float) -> None:
    """While the PD cannot hear encoder-a: (1) a request whose item encoder-a published before,
    sent to the PD with its params; (2) a fresh request through the proxy (which still reaches
    both: E encodes, the PD cannot load). Both answered 200, encoded by the PD, within
    ``LOST_PRODUCER_S`` of one local encode (plus the encoder's step for the proxied one)."""
    body, params = params_body
    before = d.metrics()
    r, took = _post(d.pd.url, dict(body, ec_transfer_params=params))
    timing(f"{tag}: PD request, item published before", took)
    assert_fell_back(d, r, before, 1, f"{tag}, direct")
    assert took <= LOST_PRODUCER_S + t_local, (
        f"{tag}: answered after {took:.2f}s > {LOST_PRODUCER_S} + {t_local:.2f}s {d.logs()}")

    before = d.metrics()
    r, took = _post(d.proxy_a.url, chat_body(d.model, [(112, 84)], f"{tag}-proxy"))
    timing(f"{tag}: proxied request, E encodes, PD cannot reach it", took)
    assert_fell_back(d, r, before, 1, f"{tag}, proxied")
    assert took <= LOST_PRODUCER_S + t_local + t_enc, (
        f"{tag}: answered after {took:.2f}s > {LOST_PRODUCER_S} + {t_local:.2f} + {t_enc:.2f}s {d.logs()}")


def published_before(d: Deploy, tag: str) -> tuple[tuple[dict[str, Any], dict[str, Any]], float]:
    """A request encoder-a encoded (so its item is published there), and how long that took."""
    body = chat_body(d.model, [(96, 80)], f"{tag}-early")
    t0 = time.monotonic()
    params = producer_params(d.enc_a, body)
    return (body, params), timing(f"{tag}: encoder step", time.monotonic() - t0)


def test_cut_both_ways_then_heal(deploy: Deploy, baseline: Baseline) -> None:
    """E and PD cannot hear each other at all (packets dropped silently both ways; the proxy still
    reaches both). Then the cut heals and transfers resume without restarting anything."""
    d = deploy
    t_local = local_encode_s(d, "cut-local")
    early, t_enc = published_before(d, "cut")
    d.hosts.cut("e", "pd")
    try:
        silent_producer(d, "cut", t_local, early, t_enc)
    finally:
        d.hosts.heal()
    resume(d, baseline, d.proxy_a, "cut")
    assert_healthy_and_drained(d, [d.enc_a, d.enc_b])


def test_one_way_drop_then_heal(deploy: Deploy, baseline: Baseline) -> None:
    """Only E -> PD is dropped: the PD's Holds reach E, E's answers and pings never come back. The
    PD must give up as on a cut, and E must not keep what it pinned for the PD for ever."""
    d = deploy
    t_local = local_encode_s(d, "drop-local")
    early, t_enc = published_before(d, "drop")
    d.hosts.drop("e", "pd")
    try:
        silent_producer(d, "drop", t_local, early, t_enc)
    finally:
        d.hosts.heal()
    resume(d, baseline, d.proxy_a, "drop")
    assert_healthy_and_drained(d, [d.enc_a, d.enc_b])


def test_encoder_host_vanishes_then_returns(deploy: Deploy, baseline: Baseline) -> None:
    """E's interface goes down (its processes run on): nobody reaches it, the proxy included. A
    request already holding E's params is encoded by the PD within ``LOST_PRODUCER_S``; a new one
    through the proxy goes out on the proxy's idle keep-alive connection to the encoder and is
    given up on by the proxy's encoder watch (``PROXY_ENCODER_LOST_S``), then sent to the PD
    without params (``X-EC-Fallback`` names the encoder and /health). The proxy's /health says
    which backend is gone. Then the host comes back."""
    d = deploy
    t_local = local_encode_s(d, "vanish-local")
    early, _ = published_before(d, "vanish")
    d.hosts.link("e", up=False)
    try:
        body, params = early
        before = d.metrics()
        r, took = _post(d.pd.url, dict(body, ec_transfer_params=params))
        timing("vanish: PD request, item published before", took)
        assert_fell_back(d, r, before, 1, "vanish, direct")
        assert took <= LOST_PRODUCER_S + t_local, f"vanish: answered after {took:.2f}s {d.logs()}"

        before = d.metrics()
        r, took = _post(d.proxy_a.url, chat_body(d.model, [(112, 84)], "vanish-proxy"))
        timing("vanish: proxied request, encoder unreachable", took)
        assert r.status_code == 200, f"HTTP {r.status_code}: {r.text[:500]} {d.logs()}"
        note = r.headers.get("X-EC-Fallback", "")
        assert d.enc_a.url in note and "/health" in note, f"no X-EC-Fallback naming {d.enc_a.url}: {dict(r.headers)}"
        print(f"vanish: X-EC-Fallback: {note}")
        c = counters_after(d, before, 0)
        assert c[LANDED] == 0 and c[FALLBACKS] == 0 and not outcome(r), f"{c} {outcome(r)}"  # no params: plain vLLM
        assert took <= PROXY_ENCODER_LOST_S + t_local, f"vanish: proxied answer after {took:.2f}s {d.logs()}"

        h = requests.get(d.proxy_a.url + "/health", timeout=30)
        assert h.status_code == 503, h.text[:500]
        bad = [b for b in h.json()["backends"] if not b["ok"]]
        assert [b["url"] for b in bad] == [d.enc_a.url], h.text[:500]
    finally:
        d.hosts.link("e", up=True)
    resume(d, baseline, d.proxy_a, "vanish")
    assert_healthy_and_drained(d, [d.enc_a, d.enc_b])


def _post_async(url: str, body: dict[str, Any]):
    """POST in a thread; returns a function that waits for (answer, seconds since it was sent)."""
    import concurrent.futures

    pool = concurrent.futures.ThreadPoolExecutor(1)
    fut = pool.submit(_post, url, body)
    pool.shutdown(wait=False)
    return lambda: fut.result(timeout=REQUEST_TIMEOUT_S + 5)


# Keep last: encoder-b does not come back.
def test_encoder_killed_on_a_live_host(deploy: Deploy, baseline: Baseline) -> None:
    """encoder-b's process group is SIGKILLed while the PD waits at it for an item (a Hold parked
    there: ``ec_nixl_expect``, which would otherwise wait ``expect_wait_s``, 5 s) and while another
    request's params name an item it had published. Its host is up, so the kernel resets the
    connection and refuses new ones: the PD must give up at once (``REFUSED_S``), not after a
    timeout. The proxy sends encoder-b's requests to the PD without params. encoder-a and the PD
    go on."""
    from ec_nixl.params import build_expect

    d = deploy
    enc = d.enc_b
    t_local = local_encode_s(d, "kill-local")
    assert_transfers(d, baseline, d.proxy_b.url, chat_body(d.model, [(70, 90)], "kill-warm"), "kill warm-up")
    published = chat_body(d.model, [(96, 80)], "kill-published")
    params = producer_params(enc, published)
    stats = d.producer_stats(enc)
    assert stats is not None
    parked0 = stats["counters"].get("holds_parked", 0)
    waiting = chat_body(d.model, [(88, 72)], "kill-waiting")
    producer = f"encoder-host:{enc.ec_transfer_config['ec_port']}"
    before = d.metrics()
    answer = _post_async(d.pd.url, dict(waiting, ec_transfer_params=build_expect(producer)))
    assert wait_until(lambda: ((d.producer_stats(enc) or {}).get("counters") or {}).get("holds_parked", 0) > parked0,
                      10.0), f"the PD's Hold never waited at {enc.name} {d.logs()}"
    t_kill = time.monotonic()
    os.killpg(enc.proc.pid, signal.SIGKILL)
    r, _ = answer()
    took = timing("kill: waiting request answered after the kill", time.monotonic() - t_kill)
    assert_fell_back(d, r, before, 1, "kill, waiting")
    assert took <= REFUSED_S + t_local, f"kill: answered {took:.2f}s after the kill {d.logs()}"

    before = d.metrics()
    r, took = _post(d.pd.url, dict(published, ec_transfer_params=params))
    timing("kill: PD request, item published before the kill", took)
    assert_fell_back(d, r, before, 1, "kill, published")
    assert took <= REFUSED_S + t_local, f"kill: answered after {took:.2f}s {d.logs()}"

    before = d.metrics()
    r, took = _post(d.proxy_b.url, chat_body(d.model, [(112, 84)], "kill-proxy"))
    timing("kill: proxied request, encoder refused", took)
    assert r.status_code == 200 and enc.url in r.headers.get("X-EC-Fallback", ""), (
        f"HTTP {r.status_code} {dict(r.headers)} {r.text[:300]}")
    assert took <= REFUSED_S + t_local, f"kill: proxied answer after {took:.2f}s {d.logs()}"
    assert counters_after(d, before, 0)[LANDED] == 0

    assert wait_until(lambda: not group_alive(enc.proc.pid), 10.0), f"{enc.name} still running after SIGKILL"
    assert_transfers(d, baseline, d.proxy_a.url, chat_body(d.model, [(100, 64)], "kill-other"), "kill: encoder-a")
    assert_healthy_and_drained(d, [d.enc_a])
