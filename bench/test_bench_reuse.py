"""``ec-nixl bench serve --workload reuse`` and ``ec-nixl bench events``, small: correctness, not speed.

The reuse workloads' arithmetic on rows made up here (E encodes per image, the share served with
no encoder call, per-turn TTFT, cache-aware over round-robin per round, token identity, the
events threads' CPU); the deployment shapes; one small real run of ``nixl-cache:1x2`` (real vLLM
CPU servers: every request completes, turns after the first go to the PD that holds the image);
and the events' cost bench, whose subscriber must end in sync with its publisher. The numbers of
the full runs are in bench/RESULTS.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ec_nixl.bench.reuse import goals, measure, shared_requests, summarize, table
from ec_nixl.bench.serve import split_shape

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def row(turn: int, ttft: float, route: str, error: str = "") -> dict:
    return {"turn": turn, "ttft": ttft, "route": route, "error": error, "ids": [1], "key": f"k{turn}{ttft}"}


def test_measure_counts_what_the_engines_and_the_proxy_said():
    urls = {"encoders": ["http://e0"], "pds": ["http://p0", "http://p1"], "url": "http://proxy"}
    rows = [row(1, 0.2, "encoder"), row(1, 0.3, "encoder"), row(2, 0.05, "pd-cache"), row(2, 0.07, "encoder"),
            row(3, 0.04, "pd-cache"), row(3, 0.0, "pd-cache", error="HTTP 500")]
    before = {"http://e0": {"encoded": 10}, "http://p0": {}, "http://p1": {"mm_items": 5}, "_events": {"messages": 3}}
    after = {"http://e0": {"encoded": 13}, "http://p0": {"mm_items": 2, "mm_cache_hits": 1, "mm_kv_hits": 2,
                                                          "requests_done": 4},
             "http://p1": {"mm_items": 7, "mm_cache_hits": 1, "encoded": 1, "cache_route_misses": 1, "requests_done": 2},
             "_events": {"messages": 15, "batches": 6}}
    threads = {"pd0:VLLM::EngineCore:ec-nixl-events": 0.02, "pd0:VLLM::EngineCore:VLLM::Engine": 5.0,
               "encoder0:python:ec-nixl-events": 0.01}
    m = measure(urls, rows, distinct=2, wall_s=10.0, before=before, after=after, threads=threads)
    assert m["failed"] == 1 and m["e_encodes"] == 3 and m["e_encodes_per_image"] == 1.5
    assert m["no_e_share_t2"] == 0.5 and m["no_e_share_later"] == 0.75 and m["no_e_share"] == 0.5
    assert m["ttft_p50_ms_t1"] == 250.0 and m["ttft_p50_ms_t3"] == 40.0  # (the failed request has no TTFT)
    # items: p0 2 needed + 2 in the prefix cache, p1 2 needed; own caches: p0 1 + 2, p1 1
    assert m["pd_items"] == 6 and m["pd_own_cache_share"] == 0.667 and m["pd_encoder_cache_hit_rate"] == 0.5
    assert m["misroutes"] == 1 and m["pd_local_encodes"] == 1 and m["pd_busiest_share"] == 0.667
    assert m["event_messages_per_request"] == 2.0 and m["event_batches_per_request"] == 1.0
    assert m["events_cpu_pct"] == {"encoder0": 0.1, "pd0": 0.2}


def test_summary_divides_cache_aware_by_round_robin_of_its_shape_per_round():
    results = [{"workload": "multi-turn", "deployment": d, "round": r, "requests": 8, "failed": 0,
                "ttft_p50_ms_later": t, "ttft_p50_ms": t, "ttft_p99_ms": t, "e_encodes_per_image": e,
                "no_e_share_later": share, "tokens_equal": 8, "tokens_compared": 8}
               for d, r, t, e, share in [("nixl-rr:1x2", 0, 100, 1.5, 0.0), ("nixl-cache:1x2", 0, 50, 1.0, 1.0),
                                         ("nixl-rr:1x2", 1, 200, 1.5, 0.0), ("nixl-cache:1x2", 1, 60, 1.0, 0.95)]]
    s = {x["deployment"]: x for x in summarize(results)}
    assert s["nixl-cache:1x2"]["vs_rr"]["ttft_p50_ms_later"] == 0.4  # median of 0.5 and 0.3
    assert "vs_rr" not in s["nixl-rr:1x2"] and s["nixl-cache:1x2"]["tokens_equal"] == 16
    g = goals(list(s.values()))
    assert "E encodes per distinct image 1.000 (target <= 1.05): met" in g
    assert "turns 2-4 with no E call 0.975 (target >= 0.9): met" in g and "0.400 (target <= 0.7): met" in g
    assert "| multi-turn | nixl-cache:1x2 | 1.00 |" in table(list(s.values()))


def test_shapes_and_workloads_are_deterministic():
    assert split_shape("nixl-cache:2x2") == ("nixl-cache", (2, 2))
    assert split_shape("nixl-rr:1x2@events_hwm=10") == ("nixl-rr@events_hwm=10", (1, 2))
    assert split_shape("nixl") == ("nixl", (1, 1))
    for bad in ("nixl:2", "colocated:1x2", "nixl:0x1"):
        with pytest.raises(ValueError):
            split_shape(bad)
    a, b = shared_requests(8, 40, 1.1, seed=3), shared_requests(8, 40, 1.1, seed=3)
    assert a == b and len(set(a)) <= 8
    assert max(a.count(x) for x in set(a)) > 40 / 8, "Zipf: the hottest image is drawn more than its share"


def test_events_cost_bench_runs_and_its_subscriber_keeps_up(tmp_path):
    out = tmp_path / "ev.json"
    p = subprocess.run([sys.executable, "-m", "ec_nixl.cli", "bench", "events", "--seconds", "1", "--rounds", "1",
                        "--json", str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    got = json.loads(out.read_text())
    assert got["subscriber_consistent"] and got["events_per_request"] > 1.9 and len(got["rounds"]) == 1
    assert "% of a core" in p.stdout


@pytest.mark.timeout(1200)
def test_bench_serve_reuse_runs_cache_aware(tmp_path):
    pytest.importorskip("vllm", reason="bench serve starts real vLLM servers")
    out = tmp_path / "reuse.json"
    p = subprocess.run([sys.executable, "-m", "ec_nixl.cli", "bench", "serve", "--workload", "reuse",
                        "--deployments", "nixl-cache:1x2", "--rounds", "1", "--conversations", "2", "--turns", "2",
                        "--shared-images", "2", "--shared-requests", "3", "--out", str(tmp_path / "o"),
                        "--port", "23400", "--json", str(out)],
                       capture_output=True, text=True, timeout=1100, cwd=ROOT)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    res = {r["workload"]: r for r in json.loads(out.read_text())["results"]}
    mt = res["multi-turn"]
    assert mt["failed"] == 0 and mt["requests"] == 4 and mt["no_e_share_t2"] == 1.0, mt
    assert mt["e_encodes_per_image"] == 1.0 and mt["misroutes"] == 0, mt
    assert res["shared-image"]["failed"] == 0
