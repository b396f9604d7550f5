"""``ec-nixl bench serve`` itself, small: real vLLM CPU servers and vLLM's own serving benchmark,
NixlEC (overlapped flow), ECExample and ECMooncake, one round, a handful of requests. It checks
that every deployment starts, every request completes, the table has the ratios and the JSON
every row: not speed (the full run's numbers are in bench/RESULTS.md), and the arithmetic of the
summary on rows made up here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ec_nixl.bench.serve import main, pd_media, split_variant, summarize, table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_summary_takes_the_median_of_per_round_ratios():
    rows = [dict(images=1, concurrency=4, deployment=d, round=r, completed=10, failed=0, req_s=q, ttft_p50_ms=t,
                 ttft_p99_ms=2 * t)
            for d, r, t, q in [("example", 0, 100, 10), ("nixl", 0, 80, 11), ("example", 1, 200, 5),
                               ("nixl", 1, 100, 6), ("example", 2, 50, 10), ("nixl", 2, 45, 9)]]
    s = {x["deployment"]: x for x in summarize(rows, ["example", "nixl"], "example")}
    assert s["nixl"]["ttft_p50_ms_ratio"] == [0.8, 0.5, 0.9]  # 0.8, 0.5, 0.9: median 0.8, spread 0.5-0.9
    assert s["nixl"]["req_s_ratio"] == [1.1, 0.9, 1.2]
    assert s["nixl"]["ttft_p50_ms"] == 80 and s["example"]["ttft_p50_ms_ratio"] is None
    assert "0.80 (0.50-0.90)" in table(list(s.values()), "example")


def test_request_trace_summary_splits_by_window_and_counts_steps(tmp_path):
    """The engines' per-request trace lines (request_trace) are read back per role, split by a
    point's window, and summarised: queue time from queued to first scheduled, steps waited, and
    the mean wall time of one engine step over the window."""
    from ec_nixl.bench import request_trace

    lines = [{"req": f"r{i}", "arrival": 99.0 + i, "queued": 100.0 + i, "scheduled": 100.0 + i + q, "steps": s,
              "step": 10 * i + s} for i, (q, s) in enumerate([(0.001, 0), (0.002, 0), (0.030, 2), (0.004, 0)])]
    (tmp_path / "trace-ec_consumer-1.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"torn')
    (tmp_path / "trace-ec_producer-2.jsonl").write_text(json.dumps(lines[0]) + "\n")
    recs = request_trace.read(tmp_path, "ec_consumer")
    assert len(recs) == 4, "a torn last line is skipped"
    s = request_trace.summarize(recs, 100.5, 104.0)  # r1..r3
    assert s["n"] == 3 and s["queue_p50_ms"] == 4.0 and s["queue_p99_ms"] == 30.0
    assert s["steps_mean"] == round(2 / 3, 3) and s["steps_max"] == 2 and s["waited_a_step"] == 1
    assert s["arrival_to_queued_p50_ms"] == 1000.0
    assert s["step_ms"] == round((103.004 - 101.002) / (30 - 10) * 1e3, 3)
    assert request_trace.summarize(recs, 200.0, 300.0) == {}


def test_point_phases_are_the_deltas_of_the_pds_metrics():
    """The connector's admission per point: the difference of two Prometheus texts of the PD."""
    from ec_nixl.bench.serve import point_phases

    def text(admitted, steps, early, admit_sum, admit_n):
        lab = '{model_name="m",engine="0"}'
        return "\n".join([f"vllm:nixl_ec_num_admitted_total{lab} {admitted}",
                          f"vllm:nixl_ec_num_admission_steps_total{lab} {steps}",
                          f"vllm:nixl_ec_num_early_admissions_total{lab} {early}",
                          f'vllm:nixl_ec_phase_seconds_sum{{model_name="m",engine="0",phase="admit"}} {admit_sum}',
                          f'vllm:nixl_ec_phase_seconds_count{{model_name="m",engine="0",phase="admit"}} {admit_n}'])

    d = point_phases(text(10, 4, 6, 0.5, 10), text(30, 4, 26, 0.52, 30))
    assert d == {"admitted": 20, "steps_per_admitted": 0.0, "early_share": 1.0, "admit_ms": 1.0}
    assert point_phases(text(1, 0, 0, 0.1, 1), text(1, 0, 0, 0.1, 1)) == {}


def test_point_phases_from_the_pds_own_counters():
    """A vLLM without EC metrics (0.26): the PD's totals from its ec_port (``json:``), the samples
    each series gained between the two reads taken from the end of its list (by its count ever)."""
    from ec_nixl.bench.serve import point_phases

    def totals(admitted, early, xfer, waits, seen_xfer, seen_wait):
        return "json:" + json.dumps({"counters": {"admitted": admitted, "admission_steps": 0,
                                                  "early_admissions": early},
                                     "xfer_s": xfer, "wait_s": waits, "phases": {},
                                     "seen": {"xfer_s": seen_xfer, "wait_s": seen_wait}})

    a = totals(4, 4, [0.001, 0.001], [0.002], 2, 1)
    b = totals(6, 5, [0.001, 0.001, 0.004, 0.006], [0.002, 0.010], 4, 2)
    d = point_phases(a, b)
    assert d["admitted"] == 2 and d["early_share"] == 0.5
    assert d["xfer_ms"] == 5.0 and d["xfer_p50_ms"] == 5.0 and d["barrier_ms"] == 10.0
    assert "xfer_ms" not in point_phases(b, b)


def test_runs_made_in_separate_calls_merge_into_one(tmp_path, capsys):
    """``--merge``: rounds run in separate calls (one lent GPU call per round) are summarized as one
    run: each file's rounds follow the last one's, and the ratios are taken per (renumbered) round."""
    from ec_nixl.bench.serve import SCHEMA

    for i, (ex, nx) in enumerate(((100, 80), (200, 100))):
        rows = [dict(images=1, concurrency=1, deployment=d, round=0, completed=5, failed=0, req_s=1.0,
                     ttft_p50_ms=t, ttft_p99_ms=t) for d, t in (("example", ex), ("nixl", nx))]
        (tmp_path / f"r{i}.json").write_text(json.dumps({"schema": SCHEMA, "args": {"reference": "example"},
                                                         "rows": rows, "phases": []}))
    out = tmp_path / "all.json"
    assert main(["--merge", str(tmp_path / "r0.json"), str(tmp_path / "r1.json"), "--json", str(out)]) == 0
    summary = {s["deployment"]: s for s in json.loads(out.read_text())["summary"]}
    assert summary["nixl"]["rounds"] == 2 and summary["nixl"]["ttft_p50_ms_ratio"] == [0.65, 0.5, 0.8]
    assert "2 runs merged: 2 rounds" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text(json.dumps({"schema": "other"}))
    assert main(["--merge", str(tmp_path / "bad.json")]) == 2


def test_a_deployment_variant_carries_its_settings():
    """``nixl@key=value``: the same deployment with ec_connector_extra_config settings (JSON values
    where they parse), so one setting can be compared in interleaved rounds; a malformed or
    misplaced one is refused with its name before anything starts."""
    assert split_variant("nixl") == ("nixl", {})
    assert split_variant("nixl@gil_switch_interval_s=null@mode=read") == \
        ("nixl", {"gil_switch_interval_s": None, "mode": "read"})
    assert split_variant("nixl-seq@load_timeout_s=2.5") == ("nixl-seq", {"load_timeout_s": 2.5})
    assert split_variant("nixl-push+placeholders@mode=read") == ("nixl-push+placeholders", {"mode": "read"})
    for bad, why in (("nixl@mode", "is not key=value"), ("example@x=1", "for the nixl deployments")):
        with pytest.raises(ValueError, match=why):
            split_variant(bad)
    assert main(["--deployments", "nixl,example@x=1", "--rounds", "1"]) == 2


def test_placeholders_make_the_proxy_send_the_pd_no_media():
    """``+placeholders``: the same deployment behind a proxy that sends the PD vllm-router's
    ``image_embeds`` placeholders; colocated (no proxy) and unknown bases are refused up front."""
    assert pd_media("nixl-push+placeholders") == ("nixl-push", ["--pd-media", "placeholders"])
    assert pd_media("example") == ("example", [])
    with pytest.raises(ValueError, match="colocated has no proxy"):
        pd_media("colocated+placeholders")
    assert main(["--deployments", "example,colocated+placeholders", "--rounds", "1"]) == 2
    assert main(["--deployments", "example,nixl-pull+placeholders", "--rounds", "1"]) == 2


@pytest.mark.timeout(1500)
def test_bench_serve_runs_every_deployment(tmp_path):
    pytest.importorskip("vllm")
    out = tmp_path / "serve"
    deps = ["nixl", "example", "mooncake", "nixl-push+placeholders"]
    r = subprocess.run(
        [sys.executable, "-m", "ec_nixl.cli", "bench", "serve", "--out", str(out), "--deployments", ",".join(deps),
         "--rounds", "1", "--concurrency", "2", "--images", "1", "--prompts", "6", "--port", "19000",
         "--json", str(out / "r.json"), "--plot", str(out / "r.png")],
        capture_output=True, text=True, timeout=1400, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])})
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    res = json.loads((out / "r.json").read_text())
    assert res["schema"] == "ec-nixl-bench-serve/1"
    got = {(x["deployment"], x["completed"], x["failed"]) for x in res["rows"]}
    assert got == {(d, 6, 0) for d in deps}, res["rows"]
    summary = {s["deployment"]: s for s in res["summary"]}
    for d in ("nixl", "mooncake"):
        assert summary[d]["ttft_p50_ms_ratio"] and summary[d]["req_s_ratio"], summary[d]
    assert "| 1 | 2 | nixl |" in r.stdout and "p50 ÷ example" in r.stdout, r.stdout[-3000:]
    # The NixlEC run moved its items over NIXL (none re-encoded on the PD), and the overlapped
    # flow was used: after the first request, the PD expected items before E answered.
    pd, e = next((p["pd"], p["e"]) for p in res["phases"] if p["deployment"] == "nixl")
    assert pd.get("loads_landed", 0) >= 6 and pd.get("local_fallbacks", 0) == 0, pd
    assert pd.get("expected_items", 0) >= 1, pd
    # E's side, read over its side channel: it published every image and reports its publish time
    # and parked requests. Whether a PD Hold reached E before its publish (and was parked) is a
    # race between E's encode and PD's preprocessing, so it is shown, not asserted: the parked
    # path itself is proven in tests/test_expected_items.py and
    # tests/e2e/test_e2e_nixl.py::test_request_that_reaches_pd_before_its_encoder_ran.
    assert e.get("published", 0) >= 6 and "publish_ms" in e and "holds_parked" in e, e
    # CPU spent per request by each deployment's processes (E, PD, proxy: their whole trees).
    for d in deps:
        cpu = next(p["cpu_s"] for p in res["phases"] if p["deployment"] == d)
        assert {"encoder0", "pd0", "proxy"} <= set(cpu) and all(v > 0 for v in cpu.values()), (d, cpu)
    assert "CPU per completed request" in r.stdout and "  nixl: total " in r.stdout, r.stdout[-3000:]
    # ... and by thread: the trees' threads account for their CPU (threads that ended are in the
    # process totals only), and the PD's engine shows among them.
    for d in deps:
        ph = next(p for p in res["phases"] if p["deployment"] == d)
        threads, total = ph["threads_s"], sum(ph["cpu_s"].values())
        assert 0.5 * total <= sum(threads.values()) <= 1.05 * total + 0.05, (d, total, threads)
        assert any(k.startswith("pd0:") for k in threads), (d, threads)
    assert "busiest threads: " in r.stdout, r.stdout[-3000:]
    # Where the PD's requests waited, from each engine's scheduler trace: every request of the
    # point (and vLLM bench's warm-up request) was seen queued and scheduled; ECMooncake's PD too.
    for row in res["rows"]:
        q = row["pd_queue"]
        assert q.get("n", 0) >= 6 and q["queue_p50_ms"] >= 0 and q["steps_max"] >= 0, (row["deployment"], q)
        assert row["e_queue"].get("n", 0) >= 6, (row["deployment"], row["e_queue"])
    nixl_row = next(row for row in res["rows"] if row["deployment"] == "nixl")
    assert nixl_row["pd_phases"].get("admitted", 0) >= 6 and "admit_ms" in nixl_row["pd_phases"], nixl_row
    assert "PD queue p50 ms" in r.stdout, r.stdout[-3000:]
    if (out / "r.png").exists():  # matplotlib is in the test requirements; the plot is optional otherwise
        assert (out / "r.png").stat().st_size > 1000
