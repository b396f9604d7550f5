"""End to end with real vLLM servers on CPU and NixlECConnector: encoder outputs go E -> PD over NIXL
(UCX on loopback), and the PD must answer exactly like one colocated server without re-encoding.

Servers (all started at once, shared by every case of the module; ~1.5 min to come up on 2 cores):

* the session-wide colocated ``baseline`` (tests/e2e/conftest.py), no EC config;
* through ``ec_nixl.disagg.launcher.Cluster`` (what ``ec-nixl serve-disagg`` runs): ``encoder0``,
  ``encoder1`` (ec_producer, each with its own ec_port) and ``pd0`` (ec_consumer, log stats on so
  its Prometheus ``/metrics`` carries the connector's series), with the launcher's proxy in front
  round-robining the two encoders (the 2:1 shape);
* a second proxy ``encoder0 -> pd0`` (the 1:1 shape), and two more that send the PD metadata-only
  bodies (``--pd-media placeholders``, as vllm-router does), one in the pull flow and one in the
  push flow (the encoder is told the PD's consumer address; the PD gets ``ec_items``);
* ``encoder-corrupt``: a third producer started with ``EC_NIXL_FAULT_CORRUPT_PUBLISH=1`` (it
  publishes constant 3.0 instead of its encoder outputs); requests reach it by hand, E then PD.

What each case proves:

* tokens: greedy token ids (temperature 0, ignore_eos, 8 tokens) equal the baseline's, for 1 and
  3 images through the 1:1 proxy, for 4 requests through the 2:1 round-robin proxy, and for
  metadata-only PD requests (1 and 2 images, the same image twice, two turns) in both flows;
* no re-encode: the PD's counters ``vllm:nixl_ec_num_loads_landed_total`` grow by the number of
  images and ``vllm:nixl_ec_num_local_fallbacks_total`` by 0; and with the corrupting producer
  the PD's tokens differ from the baseline (it really computes from the transferred bytes);
* no leaks: the producer's pool (``ec-nixl status`` / ``Endpoint.query_stats``: ``pool.used`` and
  ``items``) is back to 0 shortly after the PD read the items, and so is the PD's
  ``vllm:nixl_ec_pool_used_bytes`` gauge. The PD gives a slot back one engine step after the
  prefill committed the embeddings, and the gauge only moves when the PD reports stats from a
  step that ran tokens: if it still lags once the request is done because the engine went idle,
  one text-only request makes it step and report, then the gauge is read again;
* robustness: idle instances do not burn CPU; a PD idle for longer than ``peer_timeout_s`` still
  loads from a producer it knew; hostile ``ec_transfer_params`` with the image attached (bad
  shape, dtype or nbytes, a producer that does not exist) still give the baseline's tokens
  through a local re-encode, counted once per item as a local fallback; a metadata-only request
  that cannot be served fails with an HTTP error (vLLM 0.32 turns every engine-side request error
  into a plain 500 "Internal server error"; the reason naming the item is in the PD log) and the
  PD keeps serving.

The last case kills the PD if the bug it checks for is present, so it stays last in the file.

    pytest -m e2e tests/e2e/test_e2e_nixl.py -v
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import pytest

pytest.importorskip("vllm")
requests = pytest.importorskip("requests")

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
from ec_nixl.disagg.launcher import (  # noqa: E402
    Cluster,
    Instance,
    LaunchConfig,
    ec_transfer_config,
    instance_env,
    vllm_argv,
)
from ec_nixl.disagg.proxy import encoder_body  # noqa: E402
from ec_nixl.disagg.ttft import chat_body  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

# No --disable-log-stats: the PD's Prometheus series of the connector need log stats.
VLLM_ARGS = list(COMMON_VLLM_ARGS)
POOL_BYTES = 64 << 20

LANDED = "vllm:nixl_ec_num_loads_landed_total"
FALLBACKS = "vllm:nixl_ec_num_local_fallbacks_total"
FAILED_LOADS = "vllm:nixl_ec_num_failed_loads_total"
TRANSFERS = "vllm:nixl_ec_num_transfers_total"
POOL_USED = "vllm:nixl_ec_pool_used_bytes"
ADMITTED = "vllm:nixl_ec_num_admitted_total"
STEPS = "vllm:nixl_ec_num_admission_steps_total"
EARLY = "vllm:nixl_ec_num_early_admissions_total"

DRAIN_TIMEOUT_S = 10.0
EXPECT_WAIT_S = 6.0  # the PD's expect_wait_s here (default 5 s): room for a slow encoder on 2 cores

@dataclass
class Nixl:
    cluster: Cluster
    encoders: list[Instance]  # encoder0, encoder1: behind the cluster's round-robin proxy
    pd: Instance
    corrupt: Instance  # EC_NIXL_FAULT_CORRUPT_PUBLISH=1
    proxy11: Instance  # encoder0 -> pd0
    meta_proxies: dict[str, Instance]  # encoder0 -> pd0, metadata-only PD bodies: flow -> proxy
    model: str
    status_ep: Any  # ec_nixl Endpoint (observer) for producers' stats

    @staticmethod
    def ec_addr(inst: Instance) -> str:
        assert inst.ec_transfer_config is not None
        return f"127.0.0.1:{inst.ec_transfer_config['ec_port']}"

    def producer_stats(self, inst: Instance) -> dict[str, Any]:
        return self.status_ep.query_stats(self.ec_addr(inst), timeout=5.0)

    def metrics(self) -> dict[str, float]:
        """The PD's ``vllm:nixl_ec_*`` series, summed over label sets."""
        return nixl_metrics(self.pd.url)

    def logs(self) -> str:
        return f"(logs: {self.cluster.cfg.log_dir})"


@pytest.fixture(scope="module")
def nixl(baseline: Baseline, tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nixl]:
    from ec_nixl.config import EndpointConfig
    from ec_nixl.endpoint import Endpoint

    workdir = tmp_path_factory.mktemp("nixl")
    base = free_port_block(8)  # proxy, encoder0, encoder1, pd0, encoder-corrupt, proxy11, 2 meta proxies
    # (events off: this module is not about them, tests/e2e/test_e2e_cache_routing.py is)
    cfg = LaunchConfig(model=tiny_model, events=False, num_encoders=2, num_pd=1, port=base, base_port=base + 1,
                       connector="NixlECConnector", ec_base_port=free_port_block(32), ec_port_stride=8,
                       ec_buffer_size=POOL_BYTES, ec_buffer_device="cpu", vllm_args=VLLM_ARGS,
                       log_dir=workdir / "logs", env=dict(BASE_ENV), startup_timeout_s=STARTUP_TIMEOUT_S,
                       # Five vLLM instances share two cores here: no spinning NIXL progress thread
                       # in the producers (ec-nixl drives NIXL itself; see docs/usage.md), and
                       # timeouts sized for threads that wait behind the instances' OpenMP spinners
                       # on the same core (the defaults, 5 s, detect dead peers on a normal host;
                       # tests/test_faults_peer_death.py checks them).
                       extra_config={"nixl_progress_thread": "false", "peer_timeout_s": "30",
                                     "load_timeout_s": "30", "early_load_wait_s": "30",
                                     "expect_wait_s": str(EXPECT_WAIT_S)})
    with Cluster(cfg) as cluster:
        cluster.start()
        # The faulty producer: 4th instance of the plan (ec_port = ec_base_port + 3 * stride).
        port = base + 4
        ec = ec_transfer_config(cfg, "encoder", f"encoder-corrupt-{port}", 3, "cpu")
        # An encoder: on the encoders' cores (never with the consumer; see launcher.cpu_binds).
        enc0 = next(i for i in cluster.instances if i.role == "encoder")
        env = instance_env(dict(os.environ), enc0.env["VLLM_CPU_OMP_THREADS_BIND"], None,
                           {**BASE_ENV, "EC_NIXL_FAULT_CORRUPT_PUBLISH": "1"})
        corrupt = cluster.spawn(Instance(name="encoder-corrupt", role="encoder", port=port,
                                         argv=vllm_argv(tiny_model, port, VLLM_ARGS, ec), env=env,
                                         log_path=cfg.log_dir / "encoder-corrupt.log", ec_transfer_config=ec))
        cluster.wait_ready()
        cluster.wait_healthy([corrupt], STARTUP_TIMEOUT_S)
        encoders = [i for i in cluster.instances if i.role == "encoder"]
        pd = next(i for i in cluster.instances if i.role == "pd")
        proxy11 = cluster.spawn(Instance(
            name="proxy11", role="proxy", port=base + 5, env=dict(os.environ), log_path=cfg.log_dir / "proxy11.log",
            argv=[sys.executable, "-m", "ec_nixl.disagg.proxy", "--encoders", encoders[0].url, "--pd", pd.url,
                  "--host", "127.0.0.1", "--port", str(base + 5)]))
        # vllm-router's shape of the E->PD protocol: placeholders instead of media, in the pull
        # flow and in the push flow (the encoder is named the PD's consumer address up front)
        meta = {}
        for k, (flow, extra) in enumerate([("pull", []), ("push", ["--pd-ec-addresses", "tcp://" + Nixl.ec_addr(pd)])]):
            meta[flow] = cluster.spawn(Instance(
                name=f"proxy-meta-{flow}", role="proxy", port=base + 6 + k, env=dict(os.environ),
                log_path=cfg.log_dir / f"proxy-meta-{flow}.log",
                argv=[sys.executable, "-m", "ec_nixl.disagg.proxy", "--encoders", encoders[0].url, "--pd", pd.url,
                      "--host", "127.0.0.1", "--port", str(base + 6 + k), "--flow", flow,
                      "--pd-media", "placeholders", *extra]))
        cluster.wait_healthy([proxy11, *meta.values()], 60.0)
        ep = Endpoint(EndpointConfig(name=f"e2e-status-{os.getpid()}", pool_bytes=0, threaded=True, observer=True))
        try:
            yield Nixl(cluster, encoders, pd, corrupt, proxy11, meta, tiny_model, ep)
        finally:
            ep.close()


# ------------------------------------------------------------------------------------------ helpers


def counters_after(nixl: Nixl, before: dict[str, float], landed: int) -> dict[str, float]:
    """Deltas of the PD counters once ``landed`` loads have been counted (the front-end records a
    step's stats right around the answer, so give it a moment), or after a few seconds."""
    def delta() -> dict[str, float]:
        m = nixl.metrics()
        return {k: m.get(k, 0.0) - before.get(k, 0.0) for k in (LANDED, FALLBACKS, FAILED_LOADS, TRANSFERS)}

    d = wait_until(lambda: (x := delta())[LANDED] >= landed and x, 5.0)
    return d or delta()


def assert_producer_drained(nixl: Nixl, inst: Instance) -> dict[str, Any]:
    """Items are freed once read: pool.used and items back to 0 within a few seconds."""
    last: dict[str, Any] = {}

    def drained() -> bool:
        last.update(nixl.producer_stats(inst))
        return last["pool"]["used"] == 0 and last["items"] == 0

    wait_until(drained, DRAIN_TIMEOUT_S)
    assert last["pool"]["used"] == 0 and last["items"] == 0, (
        f"{inst.name} still holds {last['items']} items, {last['pool']['used']} pool bytes: {last['pool']} "
        f"{nixl.logs()}")
    return last


def assert_consumer_drained(nixl: Nixl) -> None:
    """The PD gauge back to 0; if the idle engine has not reported yet, one text-only request makes
    it step (and report), then read again."""
    if wait_until(lambda: nixl.metrics().get(POOL_USED, 0.0) == 0.0, 3.0):
        return
    r = requests.post(nixl.pd.url + "/v1/completions", timeout=REQUEST_TIMEOUT_S,
                      json={"model": nixl.model, "prompt": "nudge", "max_tokens": 2, "temperature": 0.0})
    assert r.status_code == 200, r.text[:300]
    ok = wait_until(lambda: nixl.metrics().get(POOL_USED, 0.0) == 0.0, DRAIN_TIMEOUT_S)
    assert ok, f"PD pool gauge {POOL_USED} = {nixl.metrics().get(POOL_USED)} after the requests {nixl.logs()}"


def producer_params(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """What the proxy does first: the encoder's 1-token answer carries ``ec_transfer_params``."""
    r = requests.post(url + "/v1/chat/completions", json=encoder_body(body), timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 200, r.text[:500]
    params = r.json().get("ec_transfer_params")
    assert isinstance(params, dict) and params, f"no ec_transfer_params from {url}: {r.text[:500]}"
    return params


def pd_log_line(nixl: Nixl, *needles: str) -> Optional[str]:
    text = nixl.pd.log_path.read_text(errors="replace")
    return next((ln for ln in text.splitlines() if all(n in ln for n in needles)), None)


def assert_pd_serves(nixl: Nixl, baseline: Baseline, tag: str) -> None:
    """The PD is alive and still right: /health, then an image request through the 1:1 proxy."""
    h = requests.get(nixl.pd.url + "/health", timeout=10)
    assert h.status_code == 200, f"PD /health {h.status_code} {nixl.logs()}"
    body = chat_body(nixl.model, [(64, 100)], tag)
    assert token_ids(nixl.proxy11.url, body) == baseline.token_ids(body)


# ------------------------------------------------------------------------------------------ cases

CASES = [
    ("one_image", [(96, 80)]),
    ("three_images", [(56, 56), (112, 84), (150, 120)]),
]


@pytest.mark.parametrize("case,sizes", CASES, ids=[c[0] for c in CASES])
def test_matches_colocated_without_reencoding(nixl: Nixl, baseline: Baseline, case: str,
                                              sizes: list[tuple[int, int]]) -> None:
    """1:1 through the proxy: baseline tokens, every image landed over NIXL, pools drained."""
    body = chat_body(nixl.model, sizes, f"nixl-{case}")
    expected = baseline.token_ids(body)
    assert len(expected) == 8
    before = nixl.metrics()
    got = token_ids(nixl.proxy11.url, body)
    d = counters_after(nixl, before, len(sizes))
    assert got == expected, f"E->PD tokens differ from colocated {nixl.logs()}"
    assert d[LANDED] == len(sizes) and d[FALLBACKS] == 0 and d[FAILED_LOADS] == 0, (
        f"PD counter deltas {d} for {len(sizes)} images {nixl.logs()}")
    assert_producer_drained(nixl, nixl.encoders[0])
    assert_consumer_drained(nixl)


def _tree_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and its descendants so far (``bench serve``'s reader)."""
    import psutil  # noqa: F401  (required: without it the reader reports nothing and 0 CPU would pass)

    from ec_nixl.bench.serve import cpu_seconds

    return cpu_seconds({"p": pid}).get("p", 0.0)


def test_idle_instances_do_not_spin(nixl: Nixl, baseline: Baseline) -> None:
    """An idle instance must leave the CPU alone: on a small host (2 cores here) a busy-polling
    thread per instance starves the others and makes loads time out."""
    insts = [*nixl.encoders, nixl.pd, nixl.corrupt, baseline.inst]
    window = 4.0
    time.sleep(2.0)  # let the last request's engine steps and stats logging settle
    t0 = [_tree_cpu_s(i.proc.pid) for i in insts]
    time.sleep(window)
    use = {i.name: round((_tree_cpu_s(i.proc.pid) - a) / window, 2) for i, a in zip(insts, t0, strict=True)}
    hot = {k: v for k, v in use.items() if v > 0.25}
    assert not hot, (f"idle CPU use in cores: {use}; with nixl_progress_thread=false no NIXL thread "
                     f"should spin (it busy-polls with pthrDelay=0 when on)")


def test_status_cli_shows_drained_producer(nixl: Nixl) -> None:
    """``ec-nixl status HOST:PORT`` (the operator's view) agrees: nothing held, 4 items went through."""
    out = subprocess.run([sys.executable, "-m", "ec_nixl.cli", "status", nixl.ec_addr(nixl.encoders[0])],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    st = json.loads(out.stdout)
    assert st["pool"]["used"] == 0 and st["items"] == 0, st
    assert st["pool"]["allocations"] >= 4, st  # the 1 + 3 images published by encoder0 above


def test_corrupt_producer_changes_the_output(nixl: Nixl, baseline: Baseline) -> None:
    """The PD computes from the transferred bytes: a producer publishing constant 3.0 changes its
    tokens (a re-encode would reproduce the baseline)."""
    body = chat_body(nixl.model, [(112, 84)], "nixl-corrupt-probe")
    expected = baseline.token_ids(body)
    params = producer_params(nixl.corrupt.url, body)
    (h, entry), = params.items()
    c = entry["ec_nixl"]
    assert c["v"] == 1 and c["producer"] == nixl.ec_addr(nixl.corrupt) and c["dtype"] == "bfloat16", entry
    assert len(c["shape"]) == 2 and c["nbytes"] == c["shape"][0] * c["shape"][1] * 2, entry
    assert "item_indices" in entry and "metadata" in entry, entry  # vLLM's own entry is kept

    before = nixl.metrics()
    got = token_ids(nixl.pd.url, dict(body, ec_transfer_params=params))
    d = counters_after(nixl, before, 1)
    assert d[LANDED] == 1 and d[FALLBACKS] == 0, f"PD counter deltas {d} {nixl.logs()}"
    assert got != expected, f"corrupted embeddings did not change the PD's tokens ({got}) {nixl.logs()}"
    assert_producer_drained(nixl, nixl.corrupt)
    assert_consumer_drained(nixl)


def test_two_encoders_round_robin(nixl: Nixl, baseline: Baseline) -> None:
    """2 E -> 1 PD through the launcher's proxy: both encoders serve, tokens equal the baseline."""
    reqs = [chat_body(nixl.model, sizes, f"nixl-nm-{i}")
            for i, sizes in enumerate([[(80, 120)], [(96, 96), (60, 90)], [(100, 64)], [(120, 100)]])]
    n_images = sum(len(b["messages"][0]["content"]) - 1 for b in reqs)
    alloc0 = [nixl.producer_stats(e)["pool"]["allocations"] for e in nixl.encoders]
    before = nixl.metrics()
    for body in reqs:
        assert token_ids(nixl.cluster.proxy_url, body) == baseline.token_ids(body), (
            f"E->PD tokens differ from colocated {nixl.logs()}")
    d = counters_after(nixl, before, n_images)
    assert d[LANDED] == n_images and d[FALLBACKS] == 0 and d[FAILED_LOADS] == 0, (
        f"PD counter deltas {d} for {n_images} images {nixl.logs()}")
    for e, a0 in zip(nixl.encoders, alloc0, strict=True):
        st = assert_producer_drained(nixl, e)
        assert st["pool"]["allocations"] > a0, f"{e.name} published nothing: round-robin skipped it"
    assert_consumer_drained(nixl)


def test_request_after_idle_period(nixl: Nixl, baseline: Baseline) -> None:
    """A PD idle for longer than ``peer_timeout_s`` (5 s by default) must still load from a
    producer it talked to before (its worker endpoint only runs while the engine steps)."""
    warm = chat_body(nixl.model, [(70, 90)], "nixl-idle-warm")
    assert token_ids(nixl.proxy11.url, warm) == baseline.token_ids(warm)
    time.sleep(6.5)
    body = chat_body(nixl.model, [(90, 60)], "nixl-idle-after")
    expected = baseline.token_ids(body)
    before = nixl.metrics()
    got = token_ids(nixl.proxy11.url, body)
    d = counters_after(nixl, before, 1)
    assert got == expected, f"E->PD tokens differ from colocated {nixl.logs()}"
    assert d[LANDED] == 1 and d[FALLBACKS] == 0, f"PD counter deltas {d} {nixl.logs()}"


def test_chat_sequence_is_admitted_in_the_step_it_arrives(nixl: Nixl, baseline: Baseline) -> None:
    """The standard flow as a chat client drives it, one request after another through the 1:1
    proxy (E answers, then the PD gets its params): the same image three times, another image, then
    a two-turn conversation whose second turn carries the first turn's image in its history. Every
    answer equals the colocated server's; every request with remote items is admitted early, in the
    step a local cache hit would be (``admission_steps`` does not grow); nothing is re-encoded on
    the PD; and both pools drain (an item the PD already had cached is given back to E, not kept
    for its 60 s lease)."""
    warm = chat_body(nixl.model, [(60, 60)], "nixl-chat-warm")  # the links are up (a fresh link is gated)
    assert token_ids(nixl.proxy11.url, warm) == baseline.token_ids(warm)
    same = chat_body(nixl.model, [(96, 80)], "nixl-chat-same")
    turn1 = chat_body(nixl.model, [(70, 90)], "nixl-chat-turn")
    turn2 = dict(turn1, messages=turn1["messages"] + [{"role": "assistant", "content": "a gradient"},
                                                        {"role": "user", "content": "which colours?"}])
    seq = [same, same, same, chat_body(nixl.model, [(84, 56)], "nixl-chat-other"), turn1, turn2]
    keys = (LANDED, FALLBACKS, FAILED_LOADS, ADMITTED, STEPS, EARLY)
    before = nixl.metrics()
    for i, body in enumerate(seq):
        assert token_ids(nixl.proxy11.url, body) == baseline.token_ids(body), (
            f"request {i} of the chat sequence differs from colocated {nixl.logs()}")

    def delta() -> dict[str, float]:
        m = nixl.metrics()
        return {k: m.get(k, 0.0) - before.get(k, 0.0) for k in keys}

    d = wait_until(lambda: (x := delta())[LANDED] >= 3 and x[ADMITTED] >= 3 and x, 5.0) or delta()
    assert d[LANDED] >= 3 and d[FALLBACKS] == 0 and d[FAILED_LOADS] == 0, f"PD counter deltas {d} {nixl.logs()}"
    assert d[ADMITTED] >= 3 and d[EARLY] == d[ADMITTED] and d[STEPS] == 0, (
        f"a request waited for its Hold: PD counter deltas {d} {nixl.logs()}")
    assert_producer_drained(nixl, nixl.encoders[0])
    assert_consumer_drained(nixl)


@pytest.mark.parametrize("flow", ["pull", "push"])
def test_metadata_only_pd_requests_match_colocated(nixl: Nixl, baseline: Baseline, flow: str) -> None:
    """vllm-router's PD requests: the proxy replaces each image the encoder described by an
    ``image_embeds`` placeholder (its metadata and mm_hash), so the PD never sees the image, and
    (flow push) the encoder is told the PD's consumer address and the PD gets ``ec_items`` beside
    the encoder's entries. One image, two, the same image twice in one request, and a two-turn
    conversation (the second turn's image is the first's, which the PD's encoder cache still has:
    its prefetched slot must be given back): every answer equals the colocated server's (which
    got the images), the PD got placeholders for each, nothing was encoded on the PD, and both
    pools drain. In the push flow the PD's control port is first asked what vllm-router asks (its
    peers, a cancel for a transfer it never had, garbage) over a real ZMQ REQ socket; the
    requests after it are the proof that it kept serving."""
    proxy = nixl.meta_proxies[flow]
    tag = f"nixl-meta-{flow}"
    if flow == "push":
        pd_ec = nixl.ec_addr(nixl.pd)
        port = int(pd_ec.rsplit(":", 1)[1])
        assert router_asks(pd_ec, {"op": "peers"}) == {"ok": True, "result": {"ports": [port]}}, nixl.logs()
        got = router_asks(pd_ec, {"op": "cancel", "transfer_id": "never-sent", "abandon": True})
        assert got["ok"] is True and got["result"]["cancelled"] is False, got
        got = router_asks(pd_ec, b"\x00 not json")
        assert got["ok"] is False and "not JSON" in got["error"], got
    turn1 = chat_body(nixl.model, [(70, 84)], f"{tag}-turn")
    turn2 = dict(turn1, messages=turn1["messages"] + [{"role": "assistant", "content": "a gradient"},
                                                        {"role": "user", "content": "which colours?"}])
    twice = chat_body(nixl.model, [(90, 60)], f"{tag}-twice")
    parts = twice["messages"][0]["content"]
    parts.insert(1, copy.deepcopy(parts[0]))
    seq = [("one", chat_body(nixl.model, [(96, 84)], f"{tag}-one")),
           ("two", chat_body(nixl.model, [(56, 84), (84, 112)], f"{tag}-two")),
           ("same image twice", twice), ("turn 1", turn1), ("turn 2", turn2)]
    before = nixl.metrics()
    media: dict[str, str] = {}
    for name, body in seq:
        r = requests.post(proxy.url + "/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S)
        assert r.status_code == 200, f"{name}: HTTP {r.status_code}: {r.text[:500]} {nixl.logs()}"
        media[name] = r.headers.get("X-EC-PD-Media", "")
        assert r.json()["choices"][0]["token_ids"] == baseline.token_ids(body), (
            f"{name} ({media[name]}): differs from colocated {nixl.logs()}")
    print(f"[info] flow {flow}: what the PD got per request: {media}")
    assert all(m == "placeholders" for m in media.values()), f"the PD got media, not placeholders: {media}"
    d = counters_after(nixl, before, 5)
    assert d[LANDED] >= 5 and d[FALLBACKS] == 0 and d[FAILED_LOADS] == 0, f"PD counter deltas {d} {nixl.logs()}"
    assert_producer_drained(nixl, nixl.encoders[0])
    assert_consumer_drained(nixl)


def router_asks(address: str, req: Any) -> dict:
    """One control request over ZMQ REQ/REP, as vllm-router sends it to a consumer."""
    import zmq

    s = zmq.Context.instance().socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 5000)
    s.connect(f"tcp://{address}")
    try:
        s.send(req if isinstance(req, bytes) else json.dumps(req).encode())
        return json.loads(s.recv())
    finally:
        s.close()


def _post_async(url: str, body: dict[str, Any]) -> Callable[[], requests.Response]:
    """POST in a thread; returns a function that waits for the answer."""
    import concurrent.futures

    pool = concurrent.futures.ThreadPoolExecutor(1)
    fut = pool.submit(requests.post, url + "/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    pool.shutdown(wait=False)
    return lambda: fut.result(timeout=REQUEST_TIMEOUT_S + 5)


def test_request_that_reaches_pd_before_its_encoder_ran(nixl: Nixl, baseline: Baseline) -> None:
    """The overlapped flow, ordered by hand: the PD gets the request first (``ec_nixl_expect``
    names encoder0), its Holds are seen parked at encoder0, and only then does encoder0 get the
    request. The PD must wait for the items, load them (no re-encode) and answer the baseline."""
    from ec_nixl.params import build_expect

    body = chat_body(nixl.model, [(88, 72), (64, 96)], "nixl-expect-ordered")
    expected = baseline.token_ids(body)
    before = nixl.metrics()
    parked0 = nixl.producer_stats(nixl.encoders[0])["counters"].get("holds_parked", 0)
    answer = _post_async(nixl.pd.url, dict(body, ec_transfer_params=build_expect(nixl.ec_addr(nixl.encoders[0]))))
    assert wait_until(lambda: nixl.producer_stats(nixl.encoders[0])["counters"].get("holds_parked", 0) > parked0,
                      60.0), f"the PD's Hold never waited at encoder0 {nixl.logs()}"
    r = requests.post(nixl.encoders[0].url + "/v1/chat/completions", json=encoder_body(body),
                      timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 200, r.text[:500]
    pd = answer()
    assert pd.status_code == 200, f"HTTP {pd.status_code}: {pd.text[:500]} {nixl.logs()}"
    assert pd.json()["choices"][0]["token_ids"] == expected, f"tokens differ from colocated {nixl.logs()}"
    d = counters_after(nixl, before, 2)
    assert d[LANDED] == 2 and d[FALLBACKS] == 0 and d[FAILED_LOADS] == 0, f"PD counter deltas {d} {nixl.logs()}"
    assert_producer_drained(nixl, nixl.encoders[0])
    assert_consumer_drained(nixl)


def test_expected_item_that_is_never_encoded_is_encoded_locally(nixl: Nixl, baseline: Baseline) -> None:
    """``ec_nixl_expect`` names a producer that never gets the request (its encoder call was lost):
    the PD waits ``expect_wait_s``, then encodes the image itself; the answer is the baseline's."""
    from ec_nixl.params import build_expect

    body = chat_body(nixl.model, [(76, 92)], "nixl-expect-lost")
    expected = baseline.token_ids(body)
    before = nixl.metrics()
    t0 = time.monotonic()
    r = requests.post(nixl.pd.url + "/v1/chat/completions", timeout=REQUEST_TIMEOUT_S,
                      json=dict(body, ec_transfer_params=build_expect(nixl.ec_addr(nixl.encoders[1]))))
    took = time.monotonic() - t0
    assert r.status_code == 200, f"HTTP {r.status_code}: {r.text[:500]} {nixl.logs()}"
    assert r.json()["choices"][0]["token_ids"] == expected, f"local re-encode differs from colocated {nixl.logs()}"
    assert EXPECT_WAIT_S * 0.9 <= took < EXPECT_WAIT_S + 20, f"answered after {took:.1f}s {nixl.logs()}"
    time.sleep(0.5)
    d = counters_after(nixl, before, 0)
    assert d[LANDED] == 0 and d[FALLBACKS] == 1, f"PD counter deltas {d} {nixl.logs()}"


def _shape(c: dict[str, Any]) -> None:
    c["shape"] = [c["shape"][0] + 1, c["shape"][1]]
    c["nbytes"] = c["shape"][0] * c["shape"][1] * 2


def _dtype(c: dict[str, Any]) -> None:
    c["dtype"] = "float32"
    c["nbytes"] = c["shape"][0] * c["shape"][1] * 4


def _nbytes(c: dict[str, Any]) -> None:
    c["nbytes"] = -1


def _producer(c: dict[str, Any]) -> None:
    c["producer"] = f"127.0.0.1:{free_port_block(1)}"  # nobody listens there


HOSTILE: list[tuple[str, Callable[[dict[str, Any]], None]]] = [
    ("wrong_shape", _shape), ("wrong_dtype", _dtype), ("negative_nbytes", _nbytes),
    ("unreachable_producer", _producer),
]


@pytest.mark.parametrize("name,mutate", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_params_with_media_reencode_locally(nixl: Nixl, baseline: Baseline, name: str,
                                                    mutate: Callable[[dict[str, Any]], None]) -> None:
    """Real coordinates from the corrupting producer, then damaged: the PD must neither load them
    (that would change the tokens) nor fail: it encodes the attached image itself, once."""
    body = chat_body(nixl.model, [(90, 70)], f"nixl-hostile-{name}")
    expected = baseline.token_ids(body)
    params = producer_params(nixl.corrupt.url, body)
    for entry in params.values():
        mutate(entry["ec_nixl"])
    before = nixl.metrics()
    t0 = time.monotonic()
    r = requests.post(nixl.pd.url + "/v1/chat/completions", json=dict(body, ec_transfer_params=params),
                      timeout=REQUEST_TIMEOUT_S)
    took = time.monotonic() - t0
    assert r.status_code == 200, f"HTTP {r.status_code}: {r.text[:500]} {nixl.logs()}"
    assert r.json()["choices"][0]["token_ids"] == expected, f"local re-encode differs from colocated {nixl.logs()}"
    time.sleep(0.5)  # let the front-end record the last step's stats
    d = counters_after(nixl, before, 0)
    assert d[LANDED] == 0, d
    assert d[FALLBACKS] == 1, (f"{name}: local fallbacks counted {d[FALLBACKS]:g} times for 1 image "
                               f"(request took {took:.1f}s) {nixl.logs()}")
    assert requests.get(nixl.pd.url + "/health", timeout=10).status_code == 200


def _meta_only_body(model: str, uuid: str, params: Optional[dict[str, Any]]) -> dict[str, Any]:
    """An image given only by its placeholder metadata (grid 1x6x6 -> 9 embeddings) and a uuid:
    the PD cannot encode it, the embeddings must come from a producer."""
    body: dict[str, Any] = {
        "model": model, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
        "messages": [{"role": "user", "content": [
            {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 6, 6]}, "uuid": uuid},
            {"type": "text", "text": "describe"}]}],
    }
    if params is not None:
        body["ec_transfer_params"] = params
    return body


def _meta_params(uuid: str, producer: str, rows: int = 9) -> dict[str, Any]:
    return {uuid: {"item_indices": [0], "metadata": {"image_grid_thw": [1, 6, 6]},
                   "ec_nixl": {"v": 1, "producer": producer, "shape": [rows, 128], "dtype": "bfloat16",
                               "nbytes": rows * 128 * 2}}}


META_ONLY = ["unreachable_producer", "not_at_producer", "wrong_shape"]


@pytest.mark.parametrize("name", META_ONLY)
def test_metadata_only_unservable_fails_cleanly(nixl: Nixl, baseline: Baseline, name: str) -> None:
    """No media to fall back on: the request fails with an HTTP error, the PD log says which item
    and why, and the PD keeps serving."""
    uuid = f"meta-only-{name}-{time.time_ns()}"
    producer = {"unreachable_producer": f"127.0.0.1:{free_port_block(1)}",
                "not_at_producer": nixl.ec_addr(nixl.encoders[1])}.get(name, nixl.ec_addr(nixl.encoders[1]))
    params = _meta_params(uuid, producer, rows=10 if name == "wrong_shape" else 9)
    r = requests.post(nixl.pd.url + "/v1/chat/completions", json=_meta_only_body(nixl.model, uuid, params),
                      timeout=REQUEST_TIMEOUT_S)
    assert 400 <= r.status_code < 600, f"HTTP {r.status_code}: {r.text[:500]}"
    assert r.json().get("error", {}).get("message"), r.text[:500]
    # (gated: "unavailable" at admission; admitted early, as metadata-only requests are by
    # default: "did not land", from the load; either way the line names the item and the reason)
    line = wait_until(lambda: pd_log_line(nixl, uuid, "unavailable") or pd_log_line(nixl, uuid, "bad ec_transfer_params")
                      or pd_log_line(nixl, uuid, "did not land"), 5.0)
    assert line, f"the PD log does not say why {uuid} failed {nixl.logs()}"
    assert_pd_serves(nixl, baseline, f"nixl-after-meta-{name}")


# Keep last: with the bug it checks for, this request kills the PD's engine.
def test_metadata_only_without_params_fails_cleanly(nixl: Nixl, baseline: Baseline) -> None:
    """A metadata-only image and no ``ec_transfer_params`` (or none of ours): nothing can provide
    the embeddings, so the request must fail, not fall through to a local encode of no pixels."""
    uuid = f"meta-only-no-params-{time.time_ns()}"
    r = requests.post(nixl.pd.url + "/v1/chat/completions", json=_meta_only_body(nixl.model, uuid, None),
                      timeout=REQUEST_TIMEOUT_S)
    assert 400 <= r.status_code < 600, f"HTTP {r.status_code}: {r.text[:500]}"
    time.sleep(1.0)
    assert requests.get(nixl.pd.url + "/health", timeout=10).status_code == 200, (
        f"the PD died on a metadata-only request without ec_transfer_params "
        f"(see 'EngineCore encountered a fatal error' in {nixl.pd.log_path})")
    assert_pd_serves(nixl, baseline, "nixl-after-meta-no-params")
