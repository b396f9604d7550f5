"""End to end with real vLLM servers on CPU: encoder -> EC connector -> prefill/decode, via ec-nixl's
launcher and proxy, must give the same greedy tokens as one colocated server, and the consumer must
really have taken the encoder outputs from the connector (it silently re-encodes when nothing
arrives, so equal tokens alone prove nothing).

One tiny random Qwen2-VL (built offline, tests/e2e/build_tiny_vl.py) and one colocated baseline
server per session (tests/e2e/conftest.py) and, per connector in CONNECTORS, one E + PD cluster;
all servers start at once and serve every case. ~1 min on 2 cores. Each connector has a probe
(PROBES) that counts what its producers published and its consumers loaded: files + DEBUG log lines for ECExampleConnector; a
NixlECConnector probe reads the same two counters from the connector's statistics.

    pytest -m e2e tests/e2e -v
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("vllm")
requests = pytest.importorskip("requests")

from conftest import (  # noqa: E402  (tests/e2e/conftest.py: shared baseline server and helpers)
    BASE_ENV,
    COMMON_VLLM_ARGS,
    REQUEST_TIMEOUT_S,
    STARTUP_TIMEOUT_S,
    Baseline,
    free_port_block,
    token_ids,
)
from ec_nixl.disagg.launcher import Cluster, LaunchConfig  # noqa: E402
from ec_nixl.disagg.ttft import chat_body  # noqa: E402  (the requests ttft.py measures)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

CONNECTORS = ["ECExampleConnector"]  # NixlECConnector: add its name here and its probe to PROBES

VLLM_ARGS = COMMON_VLLM_ARGS + ["--disable-log-stats"]

# (name, image sizes, stream). Every image appears in one case only: an item already in an
# instance's encoder cache is neither re-published nor re-loaded, which would skew the probe counts.
CASES = [
    ("one_image", [(96, 80)], False),
    ("three_images", [(56, 56), (112, 84), (150, 120)], False),
    ("two_images_streamed", [(80, 120), (64, 100)], True),
]


class ExampleConnectorProbe:
    """ECExampleConnector: the producer writes ``<storage>/<mm_hash>/encoder_cache.safetensors``, the
    consumer logs 'Success load encoder cache for hash ...' (DEBUG) for every item it loads."""

    def __init__(self, workdir: Path):
        self.storage = workdir / "ec_cache"

    def extra_config(self) -> dict[str, Any]:
        return {"shared_storage_path": str(self.storage)}

    def env(self) -> dict[str, str]:
        return {"VLLM_LOGGING_LEVEL": "DEBUG"}

    def counts(self, cluster: Cluster) -> dict[str, int]:
        """Items published by all producers and loaded by all consumers so far."""
        loaded = sum(i.log_path.read_text(errors="replace").count("Success load encoder cache for hash")
                     for i in cluster.instances if i.role == "pd")
        return {"published": len(list(self.storage.glob("*/encoder_cache.safetensors"))), "loads_landed": loaded}


# connector name -> probe class. A probe has extra_config(), env() and counts(cluster) -> {"published",
# "loads_landed"} (the names of ec_nixl.metrics counters, so NixlECConnector's probe can read them from
# its connector statistics instead of files and logs).
PROBES = {"ECExampleConnector": ExampleConnectorProbe}


@pytest.fixture(scope="module", params=CONNECTORS)
def disagg(request: pytest.FixtureRequest, baseline: Baseline, tiny_model: str,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Any]]:
    """E + PD + proxy for one connector. Depends on ``baseline`` so that it starts first and both
    start-ups overlap."""
    workdir = tmp_path_factory.mktemp(request.param)
    probe = PROBES[request.param](workdir)
    base = free_port_block(3)
    cfg = LaunchConfig(model=tiny_model, connector=request.param, port=base, base_port=base + 1,
                       ec_base_port=free_port_block(16), ec_port_stride=8, extra_config=probe.extra_config(),
                       vllm_args=VLLM_ARGS, log_dir=workdir / "logs", env={**BASE_ENV, **probe.env()},
                       startup_timeout_s=STARTUP_TIMEOUT_S)
    with Cluster(cfg) as cluster:
        cluster.start()
        cluster.wait_ready()
        yield cluster, probe


@pytest.mark.parametrize("case,sizes,stream", CASES, ids=[c[0] for c in CASES])
def test_disagg_matches_colocated(disagg: tuple[Cluster, Any], baseline: Baseline, tiny_model: str,
                                  case: str, sizes: list[tuple[int, int]], stream: bool) -> None:
    cluster, probe = disagg
    body = chat_body(tiny_model, sizes, case, stream=stream)
    expected = baseline.token_ids(body)
    assert len(expected) == 8

    before = probe.counts(cluster)
    got = token_ids(cluster.proxy_url, body)
    after = probe.counts(cluster)

    logs = cluster.cfg.log_dir
    assert got == expected, f"E->PD tokens differ from colocated (logs: {logs})"
    # every image went through the connector: published once by E, loaded once by PD
    assert {k: after[k] - before[k] for k in after} == {"published": len(sizes), "loads_landed": len(sizes)}, (
        f"connector counts {before} -> {after} for {len(sizes)} images (logs: {logs})")


def test_text_only_request_skips_the_connector(disagg: tuple[Cluster, Any], tiny_model: str) -> None:
    cluster, probe = disagg
    before = probe.counts(cluster)
    r = requests.post(cluster.proxy_url + "/v1/completions", timeout=REQUEST_TIMEOUT_S,
                      json={"model": tiny_model, "prompt": "hello", "max_tokens": 4, "temperature": 0.0,
                            "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text[:500]
    assert len(r.json()["choices"][0]["token_ids"]) == 4
    assert probe.counts(cluster) == before


def test_health_lists_every_backend(disagg: tuple[Cluster, Any]) -> None:
    cluster, _ = disagg
    r = requests.get(cluster.proxy_url + "/health", timeout=10)
    assert r.status_code == 200
    assert sorted(b["url"] for b in r.json()["backends"]) == sorted(i.url for i in cluster.instances)
