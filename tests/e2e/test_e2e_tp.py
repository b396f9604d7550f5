"""Tensor and data parallelism for real: vLLM CPU servers with ``--tensor-parallel-size 2`` (one
process per rank, ``VLLM_CPU_OMP_THREADS_BIND="0|1"``) and ``--data-parallel-size 2`` on both
sides of NixlECConnector.

Why: what the connector promises for TP > 1 (a producer serves from TP rank 0 only; every
consumer rank loads its own copy and the item is freed once the whole reader group read it; a
load that fails after admission on one rank is agreed on by all ranks with one all-reduce, so
they run the same encoder batch) and for DP (rank r of DP rank d on ``ec_port + d*tp + r``) was
shown only with unit tests and single-process fakes.

The tiny model of the e2e tests divides by 2 everywhere TP splits it (text: 2 heads, hidden 128,
MLP 256, vocab 512; its 1 KV head is replicated, which vLLM allows when tp % kv_heads == 0;
vision: 2 heads, embed 64, MLP 128, merger 256): it runs unchanged.

Servers (``tp``, started at once; each instance's KV cache is 64 MiB instead of the 1 GiB of
``VLLM_CPU_KVCACHE_SPACE``, which each TP rank would fill: 5 instances and 8 ranks share 2
cores and this machine's memory with other tests):

* ``e2``: producer, TP=2; ``e1``: producer, TP=1 (short ``announce_lease_s``, see the late case);
* ``pd1c``: consumer, TP=1, and ``pd2c``: consumer, TP=2, both with a corrupted vision tower (a
  copy of the model with other random ``visual.*`` weights bind-mounted over the model directory
  in the server's own mount namespace, as tests/e2e/test_e2e_hosts.py does: same path, so the same
  mm hashes and compat hash): their tokens equal the colocated ones only when they used the
  transferred embeddings;
* ``pd2``: consumer, TP=2, tower intact, with tests/e2e/shim_tp on its PYTHONPATH (a load failing
  on one chosen rank only, while a flag file exists). Asked without ``ec_transfer_params`` it
  is a colocated TP=2 server: the TP=2 baseline.

Baselines: greedy tokens of a TP=2 server can differ from TP=1 (reduction order: one prompt of
the five here, ``SPLIT_PROMPT``), so each PD is compared with a colocated server of its own TP
size: PD TP=1 with the session's ``baseline`` (conftest), PD TP=2 with ``pd2`` asked directly.
The encoder's TP size changes its output too (vLLM shards the vision tower): with E and PD of
different TP sizes only prompts on which both colocated servers agree are held to them; the
others are recorded.

The DP case stops those servers and starts ``edp`` (producer, DP=2) and ``pddpc`` (consumer, DP=2,
corrupted tower), requests pinned to a DP rank with vLLM's ``X-data-parallel-rank`` header.

    pytest -p no:cacheprovider -ra tests/e2e/test_e2e_tp.py -s
"""

from __future__ import annotations

import concurrent.futures
import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

pytest.importorskip("vllm")
requests = pytest.importorskip("requests")
psutil = pytest.importorskip("psutil")

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
from test_e2e_hosts import corrupt_tower  # noqa: E402  (the same corrupted tower as the hosts test)
from ec_nixl.disagg.launcher import Instance, Supervisor, group_alive, instance_env, vllm_argv  # noqa: E402
from ec_nixl.disagg.proxy import encoder_body  # noqa: E402
from ec_nixl.disagg.ttft import chat_body  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

KV_BYTES = 64 << 20
VLLM_ARGS = [*COMMON_VLLM_ARGS, "--kv-cache-memory-bytes", str(KV_BYTES)]  # log stats on: /metrics
POOL_BYTES = 64 << 20
E1_LEASE_S = 6.0
"""``announce_lease_s`` of ``e1`` (default 60 s): in the late case one PD rank never reads the item,
so ``e1`` frees it when its lease ends; this keeps that wait short."""
EXTRA = {"nixl_progress_thread": "false", "peer_timeout_s": "30", "load_timeout_s": "30", "early_load_wait_s": "30"}
"""As in test_e2e_nixl.py: up to 9 vLLM processes per core here, so no spinning NIXL progress
thread and timeouts sized for threads that wait behind OpenMP spinners."""
SHIM_TP = Path(__file__).with_name("shim_tp")
SPLIT_PROMPT = ([(80, 120)], "tp-d")
"""A prompt whose greedy tokens differ between a TP=1 and a TP=2 colocated server (the 5th token:
273 at TP=1, 101 at TP=2; seen in every run here). Sent in every E -> PD case, with fresh uuids per
case so that no server finds it in a cache. Measured: the TP=2 answer came only when both the
vision tower and the LM ran at TP=2 (E TP=2 -> PD TP=2); E TP=1 -> PD TP=2 gave the TP=1 answer:
the encoder's TP changes its output too (``test_encoder_output_depends_on_tp``), so for mixed TP
sizes no colocated server computes what the pair computes, and such prompts are only recorded."""

LANDED = "vllm:nixl_ec_num_loads_landed_total"
FALLBACKS = "vllm:nixl_ec_num_local_fallbacks_total"
LATE = "vllm:nixl_ec_num_late_fallbacks_total"
FAILED_LOADS = "vllm:nixl_ec_num_failed_loads_total"
TRANSFERS = "vllm:nixl_ec_num_transfers_total"
POOL_USED = "vllm:nixl_ec_pool_used_bytes"
COUNTED = (LANDED, FALLBACKS, LATE, FAILED_LOADS, TRANSFERS)
OUTCOME = "ec_nixl_consumer"
DRAIN_S = 15.0

REPORT: dict[str, Any] = {}
"""What each case observed, printed at the end of the module (``[tp]`` lines) for the record."""


def note(key: str, value: Any) -> None:
    REPORT[key] = value
    print(f"[tp] {key}: {json.dumps(value, default=str)}", flush=True)


@dataclass
class Server:
    inst: Instance
    tp: int = 1
    dp: int = 1

    @property
    def name(self) -> str:
        return self.inst.name

    @property
    def url(self) -> str:
        return self.inst.url

    @property
    def ec_port(self) -> int:
        assert self.inst.ec_transfer_config is not None
        return int(self.inst.ec_transfer_config["ec_port"])

    def ec_addr(self, offset: int = 0) -> str:
        return f"127.0.0.1:{self.ec_port + offset}"

    def log(self) -> str:
        return self.inst.log_path.read_text(errors="replace")

    def metrics(self, per_engine: bool = False) -> dict[str, float]:
        """The ``vllm:nixl_ec_*`` series, summed over label sets (or per ``engine`` label: DP)."""
        return nixl_metrics(self.url, per_engine)


@dataclass
class TP:
    sup: Supervisor
    model: str
    log_dir: Path
    e2: Server
    e1: Server
    pd1c: Server
    pd2c: Server
    pd2: Server
    fail_flag: Path
    status_ep: Any
    t_ready: float = 0.0
    tp2_results: dict[str, list[int]] = field(default_factory=dict)

    def producer_stats(self, e: Server, offset: int = 0) -> dict[str, Any]:
        return self.status_ep.query_stats(e.ec_addr(offset), timeout=5.0)

    def tp2_tokens(self, body: dict[str, Any]) -> list[int]:
        """The colocated TP=2 answer: ``pd2`` asked without ``ec_transfer_params`` (cached per body)."""
        key = json.dumps(dict(body, stream=False), sort_keys=True)
        if key not in self.tp2_results:
            self.tp2_results[key] = token_ids(self.pd2.url, dict(body, stream=False))
        return self.tp2_results[key]

    def logs(self) -> str:
        return f"(logs: {self.log_dir})"


def _ec(role: str, name: str, port: int, extra: dict[str, str]) -> dict[str, Any]:
    return {"ec_connector": "NixlECConnector", "ec_role": role, "engine_id": name, "ec_ip": "127.0.0.1",
            "ec_port": port, "ec_buffer_device": "cpu", "ec_buffer_size": POOL_BYTES,
            "ec_connector_extra_config": {**EXTRA, **extra}}


def vllm_server(name: str, role: str, port: int, model: str, log_dir: Path, *, tp: int = 1, dp: int = 1,
                bind: str, ec_port: int, extra: Optional[dict[str, str]] = None, tower: Optional[str] = None,
                env: Optional[dict[str, str]] = None) -> Server:
    """One vLLM instance; ``tower``: a corrupted copy of the model mounted over ``model`` for this
    process tree only (a private mount namespace: the path, and so every hash, stays the same)."""
    ec = _ec(role, name, ec_port, extra or {})
    args = [*VLLM_ARGS, "--tensor-parallel-size", str(tp)] + (["--data-parallel-size", str(dp)] if dp > 1 else [])
    argv = vllm_argv(model, port, args, ec)
    if tower is not None:
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                'mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh", tower, model, *argv]
    e = instance_env(dict(os.environ), bind, None, {**BASE_ENV, **(env or {})})
    e.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes (1 GiB per rank)
    return Server(Instance(name=name, role="pd" if role == "ec_consumer" else "encoder", port=port, argv=argv,
                           env=e, log_path=log_dir / f"{name}.log", ec_transfer_config=ec), tp=tp, dp=dp)


def _need_mounts() -> None:
    if os.geteuid() != 0:
        pytest.skip("the corrupted tower is bind-mounted in a private mount namespace: needs root "
                    "(CI runs as root)")


@pytest.fixture(scope="module")
def tp(baseline: Baseline, tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TP]:
    from ec_nixl.config import EndpointConfig
    from ec_nixl.endpoint import Endpoint

    _need_mounts()
    t0 = time.monotonic()
    work = tmp_path_factory.mktemp("tp")
    log_dir = work / "logs"
    tower = corrupt_tower(tiny_model, work / "tiny-vl-corrupt")
    http, ec = free_port_block(5), free_port_block(40)
    cores = sorted(os.sched_getaffinity(0))
    both, first, last = "|".join(map(str, cores[:2])), str(cores[0]), str(cores[-1])
    flag = work / "fail-reader-1"
    e2 = vllm_server("e2", "ec_producer", http, tiny_model, log_dir, tp=2, bind=both, ec_port=ec)
    e1 = vllm_server("e1", "ec_producer", http + 1, tiny_model, log_dir, bind=first, ec_port=ec + 8,
                     extra={"announce_lease_s": str(E1_LEASE_S)})
    pd1c = vllm_server("pd1c", "ec_consumer", http + 2, tiny_model, log_dir, bind=last, ec_port=ec + 16,
                       tower=tower)
    pd2c = vllm_server("pd2c", "ec_consumer", http + 3, tiny_model, log_dir, tp=2, bind=both, ec_port=ec + 24,
                       tower=tower)
    pd2 = vllm_server("pd2", "ec_consumer", http + 4, tiny_model, log_dir, tp=2, bind=both, ec_port=ec + 32,
                      env={"PYTHONPATH": os.pathsep.join([str(SHIM_TP), BASE_ENV["PYTHONPATH"]]),
                           "EC_NIXL_E2E_FAIL_READER": "1", "EC_NIXL_E2E_FAIL_FLAG": str(flag)})
    servers = [e2, e1, pd1c, pd2c, pd2]
    with Supervisor() as sup:
        for s in servers:
            sup.spawn(s.inst)
        sup.wait_healthy([s.inst for s in servers], STARTUP_TIMEOUT_S)
        baseline.token_ids(chat_body(tiny_model, [(64, 64)], "tp-warm"))  # the session's baseline is up too
        ep = Endpoint(EndpointConfig(name=f"e2e-tp-status-{os.getpid()}", pool_bytes=0, threaded=True, observer=True))
        rig = TP(sup, tiny_model, log_dir, e2, e1, pd1c, pd2c, pd2, flag, ep)
        rig.t_ready = time.monotonic() - t0
        note("servers healthy after (s)", round(rig.t_ready, 1))
        try:
            yield rig
        finally:
            ep.close()
            print("[tp] summary: " + json.dumps(REPORT, default=str), flush=True)


# ------------------------------------------------------------------------------------------ helpers


def producer_params(e: Server, body: dict[str, Any], headers: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """What the proxy does first: the encoder's 1-token answer carries ``ec_transfer_params``."""
    r = requests.post(e.url + "/v1/chat/completions", json=encoder_body(body), headers=headers,
                      timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 200, r.text[:500]
    params = r.json().get("ec_transfer_params")
    assert isinstance(params, dict) and params, f"no ec_transfer_params from {e.name}: {r.text[:500]}"
    return params


def post(url: str, body: dict[str, Any], headers: Optional[dict[str, str]] = None) -> requests.Response:
    return requests.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=REQUEST_TIMEOUT_S)


def deltas(pd: Server, before: dict[str, float], landed: int, per_engine: bool = False,
           keys: tuple[str, ...] = COUNTED) -> dict[str, float]:
    """Counter deltas once ``landed`` loads are counted (the front-end records a step's stats
    around the answer), or after a few seconds."""
    def delta() -> dict[str, float]:
        m = pd.metrics(per_engine)
        names = {k for k in m if k.split("@")[0] in keys} | set(keys if not per_engine else ())
        return {k: m.get(k, 0.0) - before.get(k, 0.0) for k in sorted(names)}

    def total_landed(d: dict[str, float]) -> float:
        return sum(v for k, v in d.items() if k.split("@")[0] == LANDED)

    got = wait_until(lambda: total_landed(x := delta()) >= landed and x, 8.0)
    time.sleep(0.3)
    return delta() if got else delta()


def drained(rig: TP, e: Server, offset: int = 0, timeout_s: float = DRAIN_S) -> tuple[dict[str, Any], float]:
    """The producer's items and pool back to 0 (polled through the observer endpoint)."""
    last: dict[str, Any] = {}
    t0 = time.monotonic()

    def empty() -> bool:
        last.update(rig.producer_stats(e, offset))
        return last["pool"]["used"] == 0 and last["items"] == 0

    ok = wait_until(empty, timeout_s, 0.25)
    assert ok, f"{e.name} still holds {last.get('items')} items, pool {last.get('pool')} {rig.logs()}"
    return last, time.monotonic() - t0


def status_cli(addr: str) -> dict[str, Any]:
    """``ec-nixl status HOST:PORT``, the operator's view of a producer rank."""
    out = subprocess.run([sys.executable, "-m", "ec_nixl.cli", "status", addr], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, f"ec-nixl status {addr}: {out.stderr[-2000:]}"
    return json.loads(out.stdout)


def refused(addr: str) -> bool:
    """Nobody listens at ``addr`` (the connection is refused)."""
    host, port = addr.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=2.0):
            return False
    except ConnectionRefusedError:
        return True


def consumer_gauge_zero(rig: TP, pd: Server) -> bool:
    """The PD pool gauge back to 0; an idle engine reports only after a step, so nudge it once."""
    if wait_until(lambda: pd.metrics().get(POOL_USED, 0.0) == 0.0, 3.0):
        return True
    r = requests.post(pd.url + "/v1/completions", timeout=REQUEST_TIMEOUT_S,
                      json={"model": rig.model, "prompt": "nudge", "max_tokens": 2, "temperature": 0.0})
    assert r.status_code == 200, r.text[:300]
    return bool(wait_until(lambda: pd.metrics().get(POOL_USED, 0.0) == 0.0, 10.0))


def rank_procs(s: Server) -> dict[str, psutil.Process]:
    """The instance's processes by vLLM's process title (``VLLM::Worker_TP1``, ``VLLM::EngineCore``...)."""
    assert s.inst.proc is not None
    out = {}
    for p in psutil.Process(s.inst.proc.pid).children(recursive=True):
        try:
            title = " ".join(p.cmdline())
        except psutil.NoSuchProcess:
            continue
        if title.startswith("VLLM::"):
            out[title.split()[0]] = p
    return out


def with_uuids(body: dict[str, Any], tag: str) -> dict[str, Any]:
    """The same request with its images named by uuids (their mm identifiers): same pixels, but
    no encoder-cache or prefix-cache hit on a server that saw the other copy."""
    b = copy.deepcopy(body)
    for i, part in enumerate(p for p in b["messages"][0]["content"] if p.get("type") == "image_url"):
        part["uuid"] = f"{tag}-{i}-{time.time_ns()}"
    return b


# ------------------------------------------------------------------------------------------ 1. TP=2 runs


def test_tp2_colocated_server_runs(tp: TP, baseline: Baseline) -> None:
    """A TP=2 vLLM CPU server runs here with one process per rank, each rank with its own consumer
    endpoint and pool; its greedy tokens are stable. Against TP=1 they are recorded, not asserted
    (reduction order may flip a token)."""
    procs = rank_procs(tp.pd2)
    assert {"VLLM::Worker_TP0", "VLLM::Worker_TP1"} <= set(procs), f"rank processes: {sorted(procs)}"
    log = tp.pd2.log()
    for r in (0, 1):
        assert f"NixlECConnector pd2-dp0-tp{r}: DRAM pool" in log, f"rank {r} of pd2 has no endpoint {tp.logs()}"
    assert "core ids=[0]" in log and "core ids=[1]" in log, "VLLM_CPU_OMP_THREADS_BIND='0|1' not applied"
    same = {}
    for tag, sizes in [("one", [(96, 80)]), ("three", [(56, 56), (112, 84), (150, 120)]),
                       ("two", [(64, 100), (120, 90)]), ("tall", [(80, 120)])]:
        body = chat_body(tp.model, sizes, f"tp-colocated-{tag}")
        t2 = tp.tp2_tokens(body)
        assert len(t2) == 8 and token_ids(tp.pd2.url, body) == t2, "TP=2 greedy tokens are not stable"
        same[tag] = t2 == baseline.token_ids(body)
    body = chat_body(tp.model, *SPLIT_PROMPT)
    same["split"] = {"tp1": baseline.token_ids(body), "tp2": tp.tp2_tokens(body)}
    note("1. TP=2 colocated equals TP=1 colocated, per prompt", same)


def test_pd_towers_are_corrupted(tp: TP, baseline: Baseline) -> None:
    """The premise of every token check below: what ``pd1c`` and ``pd2c`` encode themselves differs
    from the colocated servers of their TP size."""
    body = chat_body(tp.model, [(96, 80), (112, 84)], "tp-tower")
    assert token_ids(tp.pd1c.url, body) != baseline.token_ids(body), "pd1c's tower is not corrupted"
    assert token_ids(tp.pd2c.url, body) != tp.tp2_tokens(body), "pd2c's tower is not corrupted"


def fetch(rig: TP, params: dict[str, Any]) -> dict[str, Any]:
    """Read announced items over NIXL into this process, as one more consumer group (its own
    claim: the item stays for the others and is freed once every group read it)."""
    from types import SimpleNamespace

    from ec_nixl import protocol as P
    from ec_nixl.barrier import LoadBarrier
    from ec_nixl.config import EndpointConfig
    from ec_nixl.endpoint import Endpoint
    from ec_nixl.tickets import ItemRef
    from ec_nixl.vllm.options import compat_fields, parse_extra

    compat = compat_fields(SimpleNamespace(model_config=SimpleNamespace(model=rig.model, dtype="bfloat16")),
                           parse_extra({}))
    ep = Endpoint(EndpointConfig(name=f"e2e-tp-reader-{os.getpid()}-{time.time_ns()}", pool_bytes=8 << 20,
                                 threaded=True, compat=compat, group=f"e2e-tp-reader-{time.time_ns()}"))
    try:
        refs = []
        for h, entry in params.items():
            c = entry["ec_nixl"]
            refs.append(ItemRef(desc=P.ItemDesc(mm_hash=h, shape=c["shape"], dtype=c["dtype"], nbytes=c["nbytes"]),
                                producer=c["producer"]))
        tickets = ep.load(refs, timeout=30.0)
        got = LoadBarrier(ep).wait(tickets)
        out = {h: t.clone() for h, t in got.items()}
        for t in tickets:
            t.release()
        return out
    finally:
        ep.close()


def test_encoder_output_depends_on_tp(tp: TP) -> None:
    """Why the mixed-TP pairs below cannot all be held to one colocated answer: the same image,
    encoded by E TP=1 and by E TP=2 (vLLM shards Qwen2-VL's vision tower across TP ranks and
    all-reduces), published and read back over NIXL, byte-compared."""
    body = chat_body(tp.model, *SPLIT_PROMPT)
    emb, sessions = {}, {}
    for e in (tp.e1, tp.e2):
        sessions[e.name] = tp.producer_stats(e)["sessions"]
        (t,) = fetch(tp, producer_params(e, body)).values()
        emb[e.name] = t.float()
    a, b = emb["e1"], emb["e2"]
    assert a.shape == b.shape
    diff = (a - b).abs()
    rel = float(diff.max() / a.abs().max())
    note("1b. encoder output, E TP=1 vs E TP=2 (split prompt's image)", {
        "shape": list(a.shape), "elements_differing": int((diff > 0).sum()), "of": a.numel(),
        "max_abs_diff": float(diff.max()), "max_abs_diff_rel_to_max": round(rel, 5)})
    assert rel < 0.05, "E TP=1 and TP=2 encodings are not even close: a bug, not reduction order"
    for e in (tp.e1, tp.e2):
        drained(tp, e)
        # our reader's session is gone too (the next cases count the PDs' sessions)
        assert wait_until(lambda: tp.producer_stats(e)["sessions"] == sessions[e.name], 5.0)


# ------------------------------------------------------------------------------------------ 2. E -> PD across TP sizes

PAIRS = [("e2", "pd1c"), ("e1", "pd2c"), ("e2", "pd2c")]


@pytest.mark.parametrize("e_name,pd_name", PAIRS, ids=[f"E-TP{e[1]}-to-PD-TP{p[2]}" for e, p in PAIRS])
def test_transfer_across_tp_sizes(tp: TP, baseline: Baseline, e_name: str, pd_name: str) -> None:
    """E then PD by hand (the proxy's flow), three requests (4 images): the corrupted PD gives the
    colocated tokens of its TP size when E has the same TP size, and, for mixed sizes, on every
    prompt where TP=1 and TP=2 colocated agree (the others, like SPLIT_PROMPT, are recorded: no
    colocated server computes a TP=1 tower with a TP=2 LM); each PD rank loaded every item once
    (landed = items x PD TP) over a session of its own at E's rank 0; only that rank published
    and serves (``ec-nixl status`` there; nobody on ``ec_port + 1``); E's pool and the PD's gauge
    end at 0."""
    e, pd = getattr(tp, e_name), getattr(tp, pd_name)
    bodies = [chat_body(tp.model, [(96, 80)], f"tp-{e_name}-{pd_name}-a"),
              chat_body(tp.model, [(56, 84), (120, 100)], f"tp-{e_name}-{pd_name}-b"),
              with_uuids(chat_body(tp.model, *SPLIT_PROMPT), f"tp-{e_name}-{pd_name}-split")]
    items = 4
    st0 = tp.producer_stats(e)
    alloc0 = st0["pool"]["allocations"]
    before = pd.metrics()
    answers = {}
    for i, body in enumerate(bodies):
        colocated = {1: baseline.token_ids(body), 2: tp.tp2_tokens(body)}
        params = producer_params(e, body)
        assert {c["ec_nixl"]["producer"] for c in params.values()} == {e.ec_addr()}, params
        r = post(pd.url, dict(body, ec_transfer_params=params))
        assert r.status_code == 200, f"HTTP {r.status_code}: {r.text[:500]} {tp.logs()}"
        out = r.json()
        got = out["choices"][0]["token_ids"]
        assert sorted(out["ec_transfer_params"][OUTCOME]["loaded"]) == sorted(params), out["ec_transfer_params"]
        if e.tp == pd.tp or colocated[1] == colocated[2]:
            assert got == colocated[pd.tp], f"{e.name} -> {pd.name}: request {i} differs from colocated {tp.logs()}"
        if colocated[1] != colocated[2]:
            answers[f"request {i} (TP=1 and TP=2 colocated differ)"] = next(
                (f"= TP={k} colocated" for k, v in colocated.items() if v == got), f"neither: {got}")
    d = deltas(pd, before, items * pd.tp)
    assert d[LANDED] == items * pd.tp and d[FALLBACKS] == 0 and d[FAILED_LOADS] == 0, (
        f"{pd.name} counter deltas {d}: want {items} items x {pd.tp} ranks landed {tp.logs()}")
    st, took = drained(tp, e)
    # This PD talked to this E for the first time: its scheduler's control endpoint and one reader
    # per rank opened a session each at E's rank 0 (the observer's own session is in both counts).
    sessions = st["sessions"] - st0["sessions"]
    assert sessions == 1 + pd.tp, f"{pd.name} opened {sessions} sessions at {e.name}, want 1 + {pd.tp} ranks"
    cli = status_cli(e.ec_addr())
    assert cli["pool"]["used"] == 0 and cli["items"] == 0, cli
    assert cli["pool"]["allocations"] - alloc0 == items, f"{e.name} rank 0 published {cli['pool']} for {items} items"
    if e.tp == 2:
        assert refused(e.ec_addr(1)), f"something listens on {e.name}'s rank-1 port {e.ec_addr(1)}"
        assert e.log().count("serving on 127.0.0.1:") == 1, f"{e.name}: more than one rank serves {tp.logs()}"
        assert "NixlECConnector e2-dp0-tp1" not in e.log(), "E's rank 1 made an endpoint"
    assert consumer_gauge_zero(tp, pd), f"{pd.name} pool gauge {pd.metrics().get(POOL_USED)} {tp.logs()}"
    note(f"2. {e.name}(TP{e.tp}) -> {pd.name}(TP{pd.tp})", {
        "pd_counter_deltas": {k.split(":")[1]: v for k, v in d.items()},
        "e_status_rank0": {"items": cli["items"], "pool_used": cli["pool"]["used"],
                           "allocations": cli["pool"]["allocations"] - alloc0, "sessions": cli["sessions"],
                           "counters": {k: v for k, v in cli["counters"].items() if v}},
        "e_rank1_port_refused": refused(e.ec_addr(1)) if e.tp == 2 else None, "pd_sessions_at_e": sessions,
        "e_drained_after_s": round(took, 2), "answers": answers})


# ------------------------------------------------------------------------------------------ 3. late failure on one rank


def test_late_failure_on_one_pd_rank_is_agreed(tp: TP) -> None:
    """Rank 1 of ``pd2`` cannot reach E for this request's items (tests/e2e/shim_tp), rank 0 loads
    them: all ranks agree (one all-reduce), both encode the items in the same step, the answer
    equals the colocated TP=2 one and says the items were encoded here. Without the agreement the
    ranks would enter the vision tower's collectives with different batches."""
    body = chat_body(tp.model, [(88, 72), (64, 96)], "tp-late")
    expected = tp.tp2_tokens(with_uuids(body, "tp-late-colocated"))
    body = with_uuids(body, "tp-late")
    e, pd = tp.e1, tp.pd2
    params = producer_params(e, body)
    st0 = tp.producer_stats(e)
    before = pd.metrics()
    log0 = len(pd.log())
    tp.fail_flag.write_text(f"127.0.0.1:{free_port_block(1)}")
    try:
        r = post(pd.url, dict(body, ec_transfer_params=params))
    finally:
        tp.fail_flag.unlink()
    assert r.status_code == 200, f"HTTP {r.status_code}: {r.text[:500]} {tp.logs()}"
    out = r.json()
    assert out["choices"][0]["token_ids"] == expected, f"late fallback differs from colocated TP=2 {tp.logs()}"
    assert sorted(out["ec_transfer_params"][OUTCOME]["local"]) == sorted(params), out["ec_transfer_params"]
    d = deltas(pd, before, 2)
    log = pd.log()[log0:]
    lines = [ln for ln in log.splitlines() if "ec-nixl e2e fault" in ln or "encoding it here" in ln
             or "here too" in ln or "encoded locally in the same step" in ln]
    for h in params:
        assert any("Worker_TP1" in ln and h in ln and "encoding it here" in ln for ln in lines), (
            f"rank 1 did not say it encodes {h} {tp.logs()}")
        assert any("Worker_TP0" in ln and h in ln and "here too" in ln for ln in lines), (
            f"rank 0 did not join the local encode of {h} {tp.logs()}")
        assert any(h in ln and "encoded locally in the same step" in ln for ln in lines), lines
    # Rank 0 landed both items (then dropped them), rank 1 failed them; counted once per item.
    assert d[LATE] == 2 and d[FALLBACKS] == 2 and d[LANDED] == 2 and d[FAILED_LOADS] >= 2, (
        f"pd2 counter deltas {d} {tp.logs()}")
    # E: rank 0 read both, rank 1 never will: freed when e1's lease ends, counted as expired.
    st, took = drained(tp, e, timeout_s=E1_LEASE_S + DRAIN_S)
    assert st["counters"]["expired_leases"] - st0["counters"]["expired_leases"] == 2, st["counters"]
    assert consumer_gauge_zero(tp, pd), f"pd2 pool gauge {pd.metrics().get(POOL_USED)} {tp.logs()}"
    note("3. late failure on pd2 rank 1", {
        "pd_counter_deltas": {k.split(":")[1]: v for k, v in d.items()}, "pd_log": lines,
        "e1_drained_after_s": round(took, 2), "e1_expired_leases": 2})


# ------------------------------------------------------------------------------------------ 4. a PD rank killed


def test_killed_pd_rank(tp: TP, baseline: Baseline) -> None:
    """``pd2c``'s rank 1 is stopped, a request held at ``e2`` for pd2c's reader group reaches it
    (rank 0 loads and waits in the step for rank 1), then rank 1 is SIGKILLed. vLLM's executor sees
    its worker die and takes the engine down: the request fails, /health stops answering 200, the
    API server exits. ``e2`` ends the group's sessions and frees the item in about
    ``link_timeout_s``, not at its 60 s lease."""
    e, pd = tp.e2, tp.pd2c
    body = chat_body(tp.model, [(100, 76)], "tp-kill")
    params = producer_params(e, body)
    st0 = tp.producer_stats(e)
    assert st0["items"] == 1, st0
    procs = rank_procs(pd)
    rank1 = procs["VLLM::Worker_TP1"]
    rank1.send_signal(signal.SIGSTOP)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    fut = pool.submit(post, pd.url, dict(body, ec_transfer_params=params))
    pool.shutdown(wait=False)
    time.sleep(3.0)  # admitted (the group's hold at e2) and rank 0 in the step
    assert not fut.done(), "the request finished with rank 1 stopped"
    t_kill = time.monotonic()
    rank1.send_signal(signal.SIGKILL)
    try:
        r = fut.result(timeout=REQUEST_TIMEOUT_S)
        answer: Any = (r.status_code, r.text[:300])
    except requests.RequestException as ex:
        answer = f"{type(ex).__name__}: {ex}"[:300]
    t_answer = time.monotonic() - t_kill
    health = []

    def down() -> bool:
        try:
            code: Any = requests.get(pd.url + "/health", timeout=2).status_code
        except requests.RequestException as ex:
            code = type(ex).__name__
        if not health or health[-1][1] != code:
            health.append((round(time.monotonic() - t_kill, 2), code))
        return pd.inst.proc.poll() is not None

    assert wait_until(down, 60.0, 0.25), f"pd2c's API server still runs after its rank died: {health}"
    exit_code = pd.inst.proc.returncode
    e_freed, took = drained(tp, e, timeout_s=30.0)
    freed_after = time.monotonic() - t_kill
    cli = status_cli(e.ec_addr())
    log = pd.log()
    died = next((ln for ln in log.splitlines() if "died unexpectedly" in ln), None)
    note("4. pd2c rank 1 SIGKILLed", {
        "request": answer, "request_answered_after_s": round(t_answer, 2), "health": health,
        "api_server_exit_code": exit_code, "log": died,
        "e2_freed_after_kill_s": round(freed_after, 2),
        "e2_status": {"items": cli["items"], "pool_used": cli["pool"]["used"], "sessions": cli["sessions"],
                      "reclaimed_sessions": cli["counters"]["reclaimed_sessions"] -
                      st0["counters"]["reclaimed_sessions"]}})
    assert isinstance(answer, str) or answer[0] >= 500, f"the request did not fail: {answer}"
    assert died is not None, f"pd2c's log does not say its worker died {tp.logs()}"
    assert all(c != 200 for _, c in health), health
    assert cli["items"] == 0 and cli["pool"]["used"] == 0, cli
    assert freed_after < 30.0, "e2 kept the dead group's item until its lease"
    assert cli["counters"]["reclaimed_sessions"] > st0["counters"]["reclaimed_sessions"], cli["counters"]
    # The rest of pd2c's process group (if anything is left), so the supervisor does not count it.
    if group_alive(pd.inst.proc.pid):
        os.killpg(pd.inst.proc.pid, signal.SIGKILL)
    tp.sup.running.remove(pd.inst)


# ------------------------------------------------------------------------------------------ 5. DP


def test_data_parallel_pair(tp: TP, baseline: Baseline) -> None:
    """E DP=2 -> PD DP=2 (TP=1 each): E's DP rank d serves on ``ec_port + d`` and announces it,
    requests pinned to any DP rank on either side (``X-data-parallel-rank``) load over NIXL (PD's
    tower corrupted) into the DP rank that got them, and each E rank drains. Before the placement
    fix, E's second DP rank failed to start (both took ``ec_port``: vLLM resets
    ``data_parallel_rank`` to 0 for independent dense-model DP ranks)."""
    tp.sup.stop()  # 2 cores and this machine's memory: the TP servers make room
    tp.sup.running.clear()
    cores = sorted(os.sched_getaffinity(0))
    both = "|".join(map(str, cores[:2]))
    http, ec = free_port_block(2), free_port_block(16)
    tower = str(tp.log_dir.parent / "tiny-vl-corrupt")
    edp = vllm_server("edp", "ec_producer", http, tp.model, tp.log_dir, dp=2, bind=both, ec_port=ec)
    pddp = vllm_server("pddpc", "ec_consumer", http + 1, tp.model, tp.log_dir, dp=2, bind=both, ec_port=ec + 8,
                       tower=tower)
    t0 = time.monotonic()
    for s in (edp, pddp):
        tp.sup.spawn(s.inst)
    tp.sup.wait_healthy([edp.inst, pddp.inst], STARTUP_TIMEOUT_S)
    started = time.monotonic() - t0
    assert not refused(edp.ec_addr(0)) and not refused(edp.ec_addr(1)), "E's DP ranks do not both listen"
    for g in ("pddpc-dp0-tp0", "pddpc-dp1-tp0"):
        assert f"NixlECConnector {g}: DRAM pool" in pddp.log(), f"no consumer rank {g} {tp.logs()}"
    observed = {}
    for i, (ed, pd_d) in enumerate([(0, 1), (1, 0), (1, 1)]):
        body = chat_body(tp.model, [(90, 70), (70, 90)][: 1 + i % 2], f"tp-dp-{ed}-{pd_d}")
        expected = baseline.token_ids(body)
        alloc0 = tp.producer_stats(edp, ed)["pool"]["allocations"]
        params = producer_params(edp, body, {"X-data-parallel-rank": str(ed)})
        assert {c["ec_nixl"]["producer"] for c in params.values()} == {edp.ec_addr(ed)}, params
        before = pddp.metrics(per_engine=True)
        r = post(pddp.url, dict(body, ec_transfer_params=params), {"X-data-parallel-rank": str(pd_d)})
        assert r.status_code == 200, f"HTTP {r.status_code}: {r.text[:500]} {tp.logs()}"
        assert r.json()["choices"][0]["token_ids"] == expected, f"E dp{ed} -> PD dp{pd_d}: tokens differ {tp.logs()}"
        n = len(params)
        d = deltas(pddp, before, n, per_engine=True, keys=(LANDED, FALLBACKS))
        assert d.get(f"{LANDED}@{pd_d}") == n and not d.get(f"{LANDED}@{1 - pd_d}"), d
        assert not any(v for k, v in d.items() if k.startswith(FALLBACKS)), d
        st, _ = drained(tp, edp, ed)
        assert st["pool"]["allocations"] - alloc0 == n, st["pool"]
        observed[f"E dp{ed} -> PD dp{pd_d}"] = {
            "items": n, "pd_deltas": {k.split(":")[1]: v for k, v in d.items() if v}, "e_rank_port": edp.ec_addr(ed)}
    for ed in (0, 1):
        cli = status_cli(edp.ec_addr(ed))
        assert cli["items"] == 0 and cli["pool"]["used"] == 0, cli
        observed[f"ec-nixl status {edp.ec_addr(ed)}"] = {"allocations": cli["pool"]["allocations"],
                                                         "sessions": cli["sessions"]}
    note("5. DP=2 -> DP=2", {"started_after_s": round(started, 1), **observed})
