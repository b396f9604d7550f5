"""End to end with real vLLM servers: the engines' own encoder-cache events route a conversation's
later turns to the PD that already holds its image, and a stale index costs nothing but a local
encode (issue 49).

Servers (started at once; ~1.5 min on 2 cores): the session-wide colocated ``baseline``, and
``ec-nixl serve-disagg``'s cluster (``Cluster``) of one encoder and two PDs with NixlECConnector,
whose launcher turns every instance's events on and puts its proxy on the ``cache-aware`` route.
One more event source is added to that proxy: a publisher in this test that claims ``pd1`` holds
an image it never saw (a fault injection: the stale index of issue 49's "the PD evicted it
between the event and the request", made certain).

What each case proves:

* the events are the engines' own: after turn 1, E's encoder cache holds the image (its pool let
  it go once the PD read it) and exactly one PD's encoder cache holds it;
* turn 2 (the history with the image re-sent, as chat clients do) goes straight to that PD with
  no encoder call (``X-EC-Route: pd-cache``); E encoded the image once for both turns; that PD
  served it from its own caches (prefix or encoder cache, its counters) and counted no misroute;
  both turns' tokens equal the colocated server's;
* the stale claim: the request goes to ``pd1``, which has to encode the image itself: the answer
  is the baseline's, HTTP 200, and ``pd1`` counts one misroute.

    pytest -m e2e tests/e2e/test_e2e_cache_routing.py -v
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Iterator

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
    wait_until,
)
from ec_nixl.disagg.items import with_content_ids  # noqa: E402
from ec_nixl.disagg.launcher import Cluster, Instance, LaunchConfig, event_sources  # noqa: E402
from ec_nixl.disagg.ttft import chat_body  # noqa: E402
from ec_nixl.events import schema as S  # noqa: E402
from ec_nixl.events.publisher import EventPublisher, PublisherConfig  # noqa: E402
from ec_nixl.events.subscriber import Subscriber, parse_source  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

ENCODED = "vllm:nixl_ec_num_encoded_total"
CACHE_HITS = "vllm:nixl_ec_num_mm_cache_hits_total"
KV_HITS = "vllm:nixl_ec_num_mm_kv_hits_total"
MISROUTES = "vllm:nixl_ec_num_cache_route_misses_total"


@dataclass
class Rig:
    cluster: Cluster
    e: Instance
    pds: list[Instance]
    sources: list[str]
    liar: EventPublisher

    def post(self, body: dict) -> tuple[list[int], str]:
        """Token ids and the route the proxy took."""
        r = requests.post(self.cluster.proxy_url + "/v1/chat/completions", json=dict(body, stream=False),
                          timeout=REQUEST_TIMEOUT_S)
        assert r.status_code == 200, f"HTTP {r.status_code}: {r.text[:500]} {self.logs()}"
        return r.json()["choices"][0]["token_ids"], r.headers.get("X-EC-Route", "")

    def holders(self, item: str) -> list[tuple[str, str]]:
        r = requests.get(self.cluster.proxy_url + "/ec-nixl/routing", params={"item": item}, timeout=10)
        return sorted((h["instance"], h["medium"]) for h in r.json().get("holders", []))

    def logs(self) -> str:
        return "".join(f"\n--- {i.name}:\n{i.log_tail(25)}" for i in [*self.cluster.instances, self.cluster.proxy]
                       if i is not None)


@pytest.fixture(scope="module")
def rig(baseline: Baseline, tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    workdir = tmp_path_factory.mktemp("cache-routing")
    base = free_port_block(4)  # proxy, encoder0, pd0, pd1
    cfg = LaunchConfig(model=tiny_model, num_encoders=1, num_pd=2, port=base, base_port=base + 1,
                       connector="NixlECConnector", ec_base_port=free_port_block(24), ec_port_stride=8,
                       events_base_port=free_port_block(24), ec_buffer_size=64 << 20, ec_buffer_device="cpu",
                       vllm_args=list(COMMON_VLLM_ARGS), log_dir=workdir / "logs", env=dict(BASE_ENV),
                       startup_timeout_s=STARTUP_TIMEOUT_S,
                       extra_config={"nixl_progress_thread": "false", "peer_timeout_s": "30", "load_timeout_s": "30",
                                     "early_load_wait_s": "30"})
    liar_port = free_port_block(2)
    with Cluster(cfg) as cluster:
        sources = event_sources(cluster.instances)
        pd1 = [i for i in cluster.instances if i.role == "pd"][1]
        liar = EventPublisher(PublisherConfig(f"tcp://127.0.0.1:{liar_port}", f"tcp://127.0.0.1:{liar_port + 1}",
                                              pd1.url, (S.MEDIUM_CACHE,), heartbeat_s=0.5))
        try:
            # the launcher's route and sources, plus the liar (the last --events wins)
            cfg.proxy_args = ["--events", ",".join([*sources, liar.endpoint])]
            cluster.start()
            cluster.wait_ready()
            r = Rig(cluster, next(i for i in cluster.instances if i.role == "encoder"),
                    [i for i in cluster.instances if i.role == "pd"], sources, liar)
            state = requests.get(cluster.proxy_url + "/ec-nixl/routing", timeout=10).json()
            assert state["route"] == "cache-aware", state
            assert wait_until(lambda: all(
                s["state"] == "live" for s in requests.get(cluster.proxy_url + "/ec-nixl/routing", timeout=10)
                .json()["events"]["sources"]), 30), f"the proxy's event sources are not all live {r.logs()}"
            yield r
        finally:
            liar.close()


def _metric(url: str, name: str) -> float:
    return nixl_metrics(url).get(name, 0.0)


def test_turn_two_goes_to_the_pd_that_holds_the_image(rig: Rig, baseline: Baseline) -> None:
    turn1 = chat_body(rig.cluster.cfg.model, [(96, 80)], "conv-a")
    (item,) = with_content_ids(turn1)[1]
    e_encoded = _metric(rig.e.url, ENCODED)
    hits0 = {p.url: _metric(p.url, CACHE_HITS) + _metric(p.url, KV_HITS) for p in rig.pds}
    ids1, route1 = rig.post(turn1)
    assert route1 == "encoder" and ids1 == baseline.token_ids(turn1), rig.logs()
    # E's cache keeps it, its pool let it go once read; one PD's encoder cache has it
    want_e = (rig.e.url, S.MEDIUM_CACHE)
    held = wait_until(lambda: (h := rig.holders(item)) and want_e in h and len(h) == 2 and h, 20)
    assert held, f"the proxy's index never showed the image at E and one PD: {rig.holders(item)} {rig.logs()}"
    (pd_url, medium), = [h for h in held if h != want_e]
    assert medium == S.MEDIUM_CACHE and pd_url in {p.url for p in rig.pds}
    # a subscriber of its own, started now, agrees (snapshots)
    sub = Subscriber([parse_source(s) for s in rig.sources])
    try:
        assert wait_until(lambda: sub.poll(0.1) is not None and sub.synced(), 15)
        dump = sub.index.dump()
    finally:
        sub.close()
    assert item in dump[pd_url][S.MEDIUM_CACHE] and item in dump[rig.e.url][S.MEDIUM_CACHE]
    assert item not in dump[rig.e.url].get(S.MEDIUM_POOL, []), json.dumps(dump)

    turn2 = copy.deepcopy(turn1)
    turn2["messages"] += [{"role": "assistant", "content": ""}, {"role": "user", "content": "and then?"}]
    ids2, route2 = rig.post(turn2)
    assert route2 == "pd-cache" and ids2 == baseline.token_ids(turn2), rig.logs()
    assert wait_until(lambda: _metric(pd_url, CACHE_HITS) + _metric(pd_url, KV_HITS) > hits0[pd_url], 10), \
        f"{pd_url} did not count turn 2's image as served from its own caches {rig.logs()}"
    assert _metric(rig.e.url, ENCODED) - e_encoded == 1, "E encoded the image more than once"
    assert _metric(pd_url, MISROUTES) == 0


def test_a_stale_claim_costs_a_local_encode_not_the_answer(rig: Rig, baseline: Baseline) -> None:
    body = chat_body(rig.cluster.cfg.model, [(80, 96)], "never-seen")
    (item,) = with_content_ids(body)[1]
    pd1 = rig.pds[1]
    rig.liar.stored(item, "image", 4608, S.MEDIUM_CACHE)
    rig.liar.drain()
    assert wait_until(lambda: (pd1.url, S.MEDIUM_CACHE) in rig.holders(item), 10)
    before = _metric(pd1.url, MISROUTES)
    ids, route = rig.post(body)
    assert route == "pd-cache" and ids == baseline.token_ids(body), rig.logs()
    assert wait_until(lambda: _metric(pd1.url, MISROUTES) - before == 1, 10), \
        f"pd1 did not count the misroute {rig.logs()}"
