"""``ec-nixl bench serve``: what a user measures first: vLLM's own serving benchmark against whole
deployments, one connector against another, on this machine.

Each round starts every deployment afresh in turn (interleaved: a noisy host drifts between
deployments, not within a round), drives it with ``vllm.benchmarks.serve`` (dataset
``random-mm``, a sweep over concurrency and images per request, ``--ignore-eos``; each point
draws its images from its own seed, the same for every deployment of a round, so no point is
served from the encoder caches an earlier point filled), reads the connector's control-path
phases from the instances' Prometheus ``/metrics`` and stops it. The deployments:

* ``colocated``: one vLLM instance, no EC connector (on all the cores the others share);
* ``nixl``: 1 E + 1 PD with NixlECConnector behind ``ec-nixl serve-disagg``'s proxy in its
  overlapped flow (the PD gets the request while E encodes; ``proxy --flow overlap``);
* ``nixl-seq``: the same with the plain E-then-PD flow;
* ``nixl-push``: the same under vLLM's EPD push flow (``proxy --flow push``: the E request names
  the PD's control address and a ``transfer_id`` per item, as vllm-router and ``mooncake`` do);
* any of them with ``+placeholders`` (``nixl-push+placeholders``, ``example+placeholders``): the
  PD gets ``image_embeds`` placeholders built from E's answer instead of the images, as
  vllm-router sends them (``proxy --pd-media placeholders``); it never fetches or preprocesses them;
* ``example``: 1 E + 1 PD with vLLM's ECExampleConnector (disk), E then PD;
* ``nixl@key=value[@key=value...]`` (or ``nixl-seq@...``): ``nixl`` with those
  ``ec_connector_extra_config`` settings on every instance (values parsed as JSON, else strings),
  to compare one setting in interleaved rounds: ``--deployments nixl,nixl@gil_switch_interval_s=null``;
* ``mooncake``: 1 E + 1 PD with vLLM's ECMooncakeConnector (over TCP on CPU), driven by the
  protocol it expects (the E request names the consumer; ``proxy --flow push``). Needs
  ``mooncake-transfer-engine-non-cuda`` and ``libibverbs.so.1`` on CPU (``scripts/setup_env.sh``
  puts Debian's into ``VENV/opt/ibverbs``, used by these instances only); on vLLM's CPU
  backend its instances get a fix of a vLLM gap (``mooncake_shim/sitecustomize.py``).

Reported per (images, concurrency): each deployment's TTFT p50/p99, req/s and failures (medians
over rounds), and each one's ratios to the reference deployment (``--reference``, default
``example``) computed per round, then the median with its spread; where the PD's requests waited
(vLLM's queue time and the engine steps in between, from every engine's scheduler trace:
``request_trace``), E's engine step (its encode) from E's trace, and for NixlEC the connector's
admission and the PD's load time (post to landed, and the barrier's wait) per point (from the
PD's ``/metrics`` before and after it, or, on a vLLM without EC metrics (0.26), from its
counters on its ``ec_port``, as ``ec-nixl status`` reads them). ``--json`` keeps every row,
``--plot`` draws TTFT p50 against concurrency, ``--merge`` summarizes several runs' JSON as one
(rounds run in separate calls). Each deployment's CPU per completed request is printed by
instance and by its busiest threads, and on a GPU each process's GPU memory. Runs on CPU with a
tiny model (``--model`` omitted: the e2e tests' tiny Qwen2-VL is built under ``--out``) or on a
GPU host with a real model, or a real model's shapes with dummy weights (``--model-shape
qwen2.5-vl-7b``). On one GPU, give each instance its share: ``--colocated-vllm-args``,
``--encoder-vllm-args``, ``--pd-vllm-args`` (e.g. their ``--gpu-memory-utilization``).
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
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

from ec_nixl.bench import request_trace

DEPLOYMENTS = ("colocated", "nixl", "nixl-seq", "nixl-push", "nixl-rr", "nixl-cache", "example", "mooncake")
DEFAULT_DEPLOYMENTS = "colocated,nixl,example,mooncake"
CONNECTOR = {"nixl": "NixlECConnector", "nixl-seq": "NixlECConnector", "nixl-push": "NixlECConnector",
             "nixl-rr": "NixlECConnector", "nixl-cache": "NixlECConnector", "example": "ECExampleConnector",
             "mooncake": "ECMooncakeConnector"}
ROUTES = {"nixl-rr": ["--route", "round-robin", "--content-ids"], "nixl-cache": ["--route", "cache-aware"]}
"""The E-then-PD flow under each proxy route (issue 49): round-robin (today's), and cache-aware
from the engines' encoder-cache events (only that one publishes them). Round-robin also gets
the content uuids, so that the two differ in where requests go and nothing else."""
FLOW = {"nixl": "overlap", "nixl-push": "push"}  # the proxy's --flow where the launcher's choice is not it
PLACEHOLDERS = "+placeholders"
CPU_VLLM_ARGS = ["--max-model-len", "1024", "--max-num-seqs", "8", "--enforce-eager", "--dtype", "bfloat16",
                 "--limit-mm-per-prompt", '{"image":4,"video":0}']
COUNTERS = ("admitted", "admission_steps", "early_admissions", "unplaced_loads", "prefetch_defers", "local_fallbacks",
            "loads_landed", "expected_items")
SCHEMA = "ec-nixl-bench-serve/1"
POOL_BYTES = 256 << 20  # ec_buffer_size of the NixlEC and ECMooncake instances (Mooncake's default is 1 GB)

# One process per deployment and round runs every (images, concurrency) point: vLLM's import
# costs ~10 s here, paid once.
# Each point's wall-clock window goes to the file named second: the engines' request traces are
# split by it (request_trace). With a third argument (the PD's URL), the PD's Prometheus text
# before the first point and after each one goes there too: the connector's phases per point; the
# fourth (the PD's ec_port address) stands in where that text has no NixlEC series (vLLM 0.26).
DRIVER = r"""
import argparse, json, sys, time, urllib.request
from vllm.benchmarks import serve
points, windows, pd, pd_ec, common = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
def metrics():
    try:
        text = urllib.request.urlopen(pd + "/metrics", timeout=10).read().decode() if pd else ""
    except OSError:
        text = ""
    if pd_ec and "vllm:nixl_ec_" not in text:  # a vLLM without EC metrics: the PD's own counters
        from ec_nixl.bench.serve import instance_stats
        text = "json:" + json.dumps(instance_stats(pd_ec).get("connector", {}))
    return text
spans = {"": [0.0, 0.0, metrics()]}
for pt in points:
    p = argparse.ArgumentParser(); serve.add_cli_args(p)
    a = p.parse_args(common + pt["argv"])
    t0 = time.time()
    try:
        serve.main(a)
    except Exception as e:  # one point failing must not lose the others
        print(f"bench point {pt['tag']} failed: {e!r}", flush=True)
    spans[pt["tag"]] = [t0, time.time(), metrics()]
    open(windows, "w").write(json.dumps(spans))
"""


def split_variant(name: str) -> tuple[str, dict[str, Any]]:
    """``'nixl@k=v@k2=v2'`` -> ``('nixl', {k: v, k2: v2})``: a NixlEC deployment with extra-config
    settings (values as JSON where they parse, else strings). ValueError names a malformed one.
    A ``+placeholders`` suffix of the base (see ``pd_media``) stays on it."""
    base, *pairs = name.split("@")
    if pairs and base.removesuffix(PLACEHOLDERS) not in ("nixl", "nixl-seq", "nixl-push"):
        raise ValueError(f"settings (@key=value) are for the nixl deployments, not {base!r}")
    extra: dict[str, Any] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not key or not eq:
            raise ValueError(f"deployment {name!r}: {pair!r} is not key=value")
        try:
            extra[key] = json.loads(value)
        except ValueError:
            extra[key] = value
    return base, extra


def split_shape(name: str) -> tuple[str, tuple[int, int]]:
    """``'nixl-cache:2x2@k=v'`` -> ``('nixl-cache@k=v', (2, 2))``: encoders x PDs (default 1x1)."""
    head, sep, rest = name.partition(":")
    if not sep:
        return name, (1, 1)
    shape, at, tail = rest.partition("@")
    try:
        n_e, n_pd = (int(x) for x in shape.lower().split("x"))
    except ValueError:
        raise ValueError(f"deployment {name!r}: shape {shape!r} is not ExPD, e.g. 2x2") from None
    if n_e < 1 or n_pd < 1 or head == "colocated":
        raise ValueError(f"deployment {name!r}: a shape needs an E + PD deployment and at least 1x1")
    return head + at + tail, (n_e, n_pd)


def pd_media(base: str) -> tuple[str, list[str]]:
    """``'nixl-push+placeholders'`` -> ``('nixl-push', [proxy args])``: with ``+placeholders`` the
    proxy sends the PD ``image_embeds`` placeholders instead of the images (``--pd-media
    placeholders``, as vllm-router does), so the PD skips fetching and preprocessing them."""
    if base.endswith(PLACEHOLDERS):
        if base == "colocated" + PLACEHOLDERS:
            raise ValueError("colocated has no proxy to send placeholders: +placeholders is for E + PD deployments")
        return base.removesuffix(PLACEHOLDERS), ["--pd-media", "placeholders"]
    return base, []


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ec-nixl bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench-serve-out"), help="logs, per-run results, tiny model")
    p.add_argument("--model", default=None, help="model path (default: build the tiny Qwen2-VL under --out)")
    p.add_argument("--deployments", default=None,
                   help=f"comma list of {', '.join(DEPLOYMENTS)}; nixl@key=value adds an ec_connector_extra_config "
                        f"setting (e.g. nixl,nixl@gil_switch_interval_s=null)")
    p.add_argument("--reference", default="example", help="deployment the ratios divide by")
    p.add_argument("--concurrency", default="1,4,8", help="comma list (default 1,4,8)")
    p.add_argument("--images", default="1,2", help="images per request, comma list (default 1,2)")
    p.add_argument("--prompts", type=int, default=40, help="requests per point (default 40)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--image-sizes", default="224x224,336x336", help="random-mm image buckets, equally likely")
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--vllm-args", default=None, help="extra vLLM server args (default: small CPU settings)")
    p.add_argument("--colocated-vllm-args", default="", help="flags for the colocated instance only, after the others")
    p.add_argument("--encoder-vllm-args", default="", help="flags for E instances only (e.g. their GPU share)")
    p.add_argument("--pd-vllm-args", default="", help="flags for PD instances only")
    p.add_argument("--model-shape", choices=("qwen2.5-vl-7b",), default=None,
                   help="build that model's configuration and tokenizer under --out (no weights) and serve it "
                        "with --load-format dummy")
    p.add_argument("--pool-mb", type=int, default=POOL_BYTES >> 20,
                   help="ec_buffer_size of NixlEC and ECMooncake instances, MiB (a 1024x1024 image on Qwen2.5-VL-7B "
                        "takes 9.8 MB: concurrency 8 x 2 images in flight at E and PD need ~160 MB)")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="run nothing: summarize these runs' --json files as one run (rounds renumbered)")
    p.add_argument("--port", type=int, default=18000, help="first port (each deployment uses a block of 100)")
    p.add_argument("--json", default=None, metavar="PATH", help=f"write every row and the summary ({SCHEMA})")
    p.add_argument("--plot", default=None, metavar="PATH", help="TTFT p50 vs concurrency PNG (needs matplotlib)")
    p.add_argument("--workload", default="random-mm", choices=("random-mm", "multi-turn", "shared-image", "reuse"),
                   help="random-mm (vLLM's serving benchmark, default) or workloads that send images again "
                        "(bench/reuse.py: cache-aware routing against round-robin, default deployments "
                        "colocated,nixl-rr:1x2,nixl-cache:1x2,nixl-rr:2x2,nixl-cache:2x2)")
    p.add_argument("--conversations", type=int, default=16, help="multi-turn: conversations (1 or 2 images each)")
    p.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    p.add_argument("--shared-images", type=int, default=8, help="shared-image: distinct images")
    p.add_argument("--shared-requests", type=int, default=48, help="shared-image: requests (one image each)")
    p.add_argument("--zipf", type=float, default=1.1, help="shared-image: Zipf exponent of the images' popularity")
    p.add_argument("--reuse-concurrency", type=int, default=4,
                   help="multi-turn: conversations at a time; shared-image: requests at a time")
    return p


def _env(root: Path, cpu: bool = True) -> dict[str, str]:
    shim = root / "tests" / "e2e" / "shim"  # one NUMA node: the e2e tests' start-up fix (CPU only)
    env = {"HF_HUB_OFFLINE": "1"}
    if cpu:
        env.update(VLLM_CPU_KVCACHE_SPACE="1", EC_NIXL_E2E_NO_NUMA_MIGRATE="1")
    paths = [str(shim)] if cpu and shim.is_dir() else []
    env["PYTHONPATH"] = os.pathsep.join(paths + [str(root), os.environ.get("PYTHONPATH", "")]).strip(os.pathsep)
    return env


def _root() -> Path:
    return Path(__file__).resolve().parents[2]


@contextmanager
def deployment(name: str, model: str, port: int, log_dir: Path, vllm_args: list[str],
               role_args: Optional[dict[str, list[str]]] = None, pool_bytes: int = POOL_BYTES) -> Iterator[dict]:
    """Start ``name``, wait until it serves, yield its URLs; stop everything on the way out
    (``name`` may carry a shape, ``nixl-cache:2x2``: ``split_shape``). ``role_args``: flags per role
    ("colocated", "encoder", "pd"), after ``vllm_args``."""
    role_args = role_args or {}
    from ec_nixl.disagg.launcher import Cluster, Instance, LaunchConfig, Supervisor, instance_env, vllm_argv

    env = _env(_root(), cpu=not _cuda())
    env[request_trace.ENV] = str(log_dir / "trace")  # every engine's per-request scheduling trace
    if name == "colocated":
        cores = ",".join(map(str, sorted(os.sched_getaffinity(0))))
        inst = Instance(name="colocated", role="baseline", port=port, log_path=log_dir / "colocated.log",
                        argv=vllm_argv(model, port, vllm_args + role_args.get("colocated", []), None),
                        env=instance_env(dict(os.environ), cores, None, env))
        log_dir.mkdir(parents=True, exist_ok=True)
        with Supervisor() as sup:
            sup.spawn(inst)
            sup.wait_healthy([inst], 900.0)
            yield {"url": inst.url, "pd": inst.url, "e_ec": None, "pd_ec": None, "procs": {"colocated": inst.proc.pid},
                   "trace": log_dir / "trace", "pd_role": "colocated", "encoders": [], "pds": [inst.url]}
        return
    # The launcher picks each connector's proxy flow (ECMooncake: push to the PD named in the E
    # request; others E then PD); nixl asks for the overlapped flow.
    name, (n_e, n_pd) = split_shape(name)
    name, extra = split_variant(name)
    name, proxy_args = pd_media(name)
    proxy_args += ["--flow", FLOW[name]] if name in FLOW else []
    proxy_args += ROUTES.get(name, [])
    cuda = _cuda()
    if name == "mooncake":
        extra = {"mooncake_protocol": "rdma" if cuda else "tcp"}
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent / "mooncake_shim"), env["PYTHONPATH"]])
        env["EC_NIXL_BENCH_MOONCAKE_NOFORWARD_FIX"] = "1"
        ibv = Path(sys.prefix) / "opt" / "ibverbs"  # scripts/setup_env.sh puts libibverbs there, not system-wide
        if ibv.is_dir():
            env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(ibv), os.environ.get("LD_LIBRARY_PATH", "")) if p)
    cfg = LaunchConfig(model=model, connector=CONNECTOR[name], port=port, base_port=port + 10,
                       connector_module="ec_nixl.vllm" if name.startswith("nixl") and not plugin_registered() else None,
                       ec_base_port=port + 50, vllm_args=vllm_args, log_dir=log_dir, env=env,
                       ec_buffer_device=None if cuda else "cpu", ec_buffer_size=pool_bytes,
                       proxy_args=proxy_args, extra_config=extra, startup_timeout_s=900.0,
                       role_vllm_args={r: role_args[r] for r in ("encoder", "pd") if role_args.get(r)},
                       num_encoders=n_e, num_pd=n_pd, events=name == "nixl-cache")
    with Cluster(cfg) as c:
        c.start()
        c.wait_ready()
        pd = next(i for i in c.instances if i.role == "pd")
        e = next(i for i in c.instances if i.role == "encoder")
        ec = e.ec_transfer_config or {}
        nixl = CONNECTOR[name] == "NixlECConnector"
        e_ec = f"{ec.get('ec_ip')}:{ec.get('ec_port')}" if nixl else None
        pec = pd.ec_transfer_config or {}
        pd_ec = f"{pec.get('ec_ip')}:{pec.get('ec_port')}" if nixl else None
        procs = {i.name: i.proc.pid for i in c.instances + [c.proxy] if i is not None and i.proc is not None}
        yield {"url": c.proxy_url, "pd": pd.url, "e_ec": e_ec, "pd_ec": pd_ec, "procs": procs,
               "trace": log_dir / "trace", "pd_role": "ec_consumer",
               "encoders": [i.url for i in c.instances if i.role == "encoder"],
               "pds": [i.url for i in c.instances if i.role == "pd"],
               "storage": (cfg.extra_config.get("shared_storage_path")
                           or str((log_dir / "ec_cache").resolve())) if name == "example" else None}


def plugin_registered() -> bool:
    """Whether NixlECConnector is installed as a vLLM plugin here (else: ``ec_connector_module_path``)."""
    from importlib.metadata import entry_points

    return any(ep.value.startswith("ec_nixl.vllm") for ep in entry_points(group="vllm.general_plugins"))


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def scrape(url: Optional[str]) -> dict[str, Any]:
    """An instance's NixlEC phases (mean ms) and counters from its Prometheus text ({} if none)."""
    if not url:
        return {}
    try:
        text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    except OSError:
        return {}
    return parse_metrics(text)


def parse_metrics(text: str) -> dict[str, Any]:
    """NixlEC's phases (mean ms) and counters in a Prometheus text, cumulative since start."""
    from ec_nixl.metrics import PHASES

    out: dict[str, Any] = {}
    for k in PHASES:
        tot = re.search(r'vllm:nixl_ec_phase_seconds_sum\{[^}]*phase="%s"[^}]*\} (\S+)' % k, text)
        n = re.search(r'vllm:nixl_ec_phase_seconds_count\{[^}]*phase="%s"[^}]*\} (\S+)' % k, text)
        if tot and n and float(n.group(1)):
            out[f"{k}_ms"] = round(float(tot.group(1)) / float(n.group(1)) * 1e3, 3)
            out[f"{k}_sum_n"] = [float(tot.group(1)), float(n.group(1))]
    for k in COUNTERS:
        m = re.search(r"vllm:nixl_ec_num_%s_total\{[^}]*\} (\S+)" % k, text)
        if m:
            out[k] = int(float(m.group(1)))
    for k, series in (("xfer_ms", "vllm:nixl_ec_xfer_time_seconds"), ("barrier_ms", "vllm:nixl_ec_barrier_wait_seconds")):
        tot = re.search(r"%s_sum\{[^}]*\} (\S+)" % series, text)
        n = re.search(r"%s_count\{[^}]*\} (\S+)" % series, text)
        if tot and n and float(n.group(1)):
            out[k] = round(float(tot.group(1)) / float(n.group(1)) * 1e3, 3)
            out[f"{k[:-3]}_sum_n"] = [float(tot.group(1)), float(n.group(1))]  # (per point: point_phases)
    return out


def point_phases(before: str, after: str) -> dict[str, Any]:
    """The PD's admission between two Prometheus texts (one point): requests admitted, engine steps
    they waited per request, the share admitted early, the mean of each phase (ms), and the PD's
    mean transfer (post to landed) and barrier wait (ms). Texts that start with ``json:`` are the
    PD's own counters instead (``status_phases``)."""
    if before.startswith("json:") and after.startswith("json:"):
        return status_phases(json.loads(before[5:]), json.loads(after[5:]))
    a, b = parse_metrics(before), parse_metrics(after)
    out = admission(a, b)
    for k, (tot, cnt) in ((k[:-6], v) for k, v in b.items() if k.endswith("_sum_n")):
        t0, c0 = a.get(f"{k}_sum_n", (0.0, 0.0))
        if cnt > c0:
            out[f"{k}_ms"] = round((tot - t0) / (cnt - c0) * 1e3, 3)
    return out


def admission(a: dict, b: dict) -> dict[str, Any]:
    """Requests admitted between two counter readings, engine steps they waited per request, and
    the share admitted early."""
    out: dict[str, Any] = {}
    n = b.get("admitted", 0) - a.get("admitted", 0)
    if n > 0:
        out["admitted"] = n
        out["steps_per_admitted"] = round((b.get("admission_steps", 0) - a.get("admission_steps", 0)) / n, 3)
        out["early_share"] = round((b.get("early_admissions", 0) - a.get("early_admissions", 0)) / n, 3)
    return out


def status_phases(a: dict, b: dict) -> dict[str, Any]:
    """``point_phases`` from two of the PD's own totals (``ec-nixl status``'s ``connector``): the
    counters' deltas, and the samples each series gained in between (the last of them, by the
    count each series ever had), as means in ms."""
    out = admission(a.get("counters") or {}, b.get("counters") or {})
    seen_a, seen_b = a.get("seen") or {}, b.get("seen") or {}

    def new(series: str, samples: list) -> list:
        k = seen_b.get(series, 0) - seen_a.get(series, 0)
        return samples[len(samples) - min(k, len(samples)):] if k > 0 else []

    for key, name in (("xfer_s", "xfer_ms"), ("wait_s", "barrier_ms")):
        got = new(key, b.get(key) or [])
        if got:
            out[name] = round(statistics.mean(got) * 1e3, 3)
            out[name.replace("_ms", "_p50_ms")] = round(statistics.median(got) * 1e3, 3)
    for phase, samples in (b.get("phases") or {}).items():
        got = new(f"phase:{phase}", samples)
        if got:
            out[f"{phase}_ms"] = round(statistics.mean(got) * 1e3, 3)
    return out


def instance_stats(address: str, timeout: float = 5.0) -> dict[str, Any]:
    """An instance's counters over its side channel, as ``ec-nixl status`` prints them: a
    producer's endpoint, or a consumer's scheduler (its own and its workers' under "connector")."""
    from ec_nixl.config import EndpointConfig
    from ec_nixl.endpoint import Endpoint

    ep = Endpoint(EndpointConfig(name=f"bench-status-{os.getpid()}-{time.monotonic_ns()}", pool_bytes=0,
                                 threaded=True, observer=True))
    try:
        return ep.query_stats(address, timeout=timeout)
    finally:
        ep.close()


def gpu_memory(procs: dict[str, int]) -> dict[str, float]:
    """GPU memory (MiB) of each named process tree, from ``nvidia-smi`` ({} without it)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    used = {}
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        try:
            used[int(pid)] = float(mib)
        except ValueError:
            continue
    res: dict[str, float] = {}
    for role, tree, _ in _trees(procs):
        mib = sum(used.get(p.pid, 0.0) for p in tree)
        if mib:
            res[role] = mib
    return res


def filesystem(path: Optional[str]) -> Optional[str]:
    """The file system type and mount point holding ``path`` (from /proc/mounts), e.g. 'ext4 on /'."""
    if not path:
        return None
    try:
        real = os.path.realpath(path)
        best = ("", "?")
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and (real == parts[1] or real.startswith(parts[1].rstrip("/") + "/")) \
                        and len(parts[1]) >= len(best[0]):
                    best = (parts[1], parts[2])
        return f"{best[1]} on {best[0]}"
    except OSError:
        return None


def _r(v: Optional[float]) -> Optional[float]:
    return None if v is None else round(v, 1)


def producer_stats(address: Optional[str]) -> dict[str, Any]:
    """E's own side over its side channel (what ``ec-nixl status`` prints): vLLM's V1 runner drops
    an encode-only worker's output, so E's publish time and parked Holds are not in its /metrics."""
    if not address:
        return {}
    try:
        st = instance_stats(address)
    except Exception as e:  # statistics are extra: never fail the run for them
        return {"error": str(e)[:200]}
    c = st.get("counters", {})
    out: dict[str, Any] = {k: int(c.get(k, 0)) for k in ("published", "staging_copies", "holds_parked",
                                                            "pushes_parked", "native_answers", "native_pushes",
                                                            "publish_wakes")}
    phases = st.get("phases") or {}
    pub = phases.get("publish") or []
    if pub:
        out["publish_ms"] = round(statistics.mean(pub) * 1e3, 3)
    push = phases.get("push_post") or []  # E's own share of the PD's WRITE loads (Python-posted)
    if push:
        out["push_post_p50_ms"] = round(statistics.median(push) * 1e3, 3)
    out["pool_used"] = (st.get("pool") or {}).get("used")
    return out


def _trees(procs: dict[str, int]) -> Iterator[tuple[str, list, Any]]:
    """(role, the process and all its descendants, psutil) for each named process still there
    (vLLM's engine core and workers are children of its API server); nothing without psutil."""
    from ec_nixl.bench import optional

    psutil, _ = optional.load("psutil")
    if psutil is None:
        return
    for role, pid in procs.items():
        try:
            root = psutil.Process(pid)
            yield role, [root] + root.children(recursive=True), psutil
        except psutil.Error:
            continue


def cpu_seconds(procs: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of each named process tree; a process that is gone is left out."""
    out = {}
    for role, tree, psutil in _trees(procs):
        total = 0.0
        for p in tree:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        out[role] = total
    return out


def thread_seconds(procs: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of every thread in each named process tree, summed by
    ``role:process:thread`` name (Linux ``/proc``; {} elsewhere or without psutil): which thread
    of which instance a deployment's CPU per request goes to (vLLM's engine and worker, the
    connector's I/O threads, ZMQ's)."""
    if not Path("/proc/self/task").is_dir():
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for role, tree, psutil in _trees(procs):
        for p in tree:
            try:
                name = p.name()
                tasks = list(Path(f"/proc/{p.pid}/task").iterdir())
            except (psutil.Error, OSError):
                continue
            for task in tasks:
                try:
                    stat = (task / "stat").read_text()
                except OSError:
                    continue  # the thread ended
                comm, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
                key = f"{role}:{name}:{comm}"
                out[key] = out.get(key, 0.0) + (int(rest[11]) + int(rest[12])) / tick  # utime + stime
    return out


def cpu_table(phases: list[dict], deps: list[str], top: int = 8) -> str:
    """CPU ms per completed request of each deployment's processes while the benchmark ran (median
    over rounds): on a host with fewer cores than processes, CPU spent is TTFT lost."""
    lines = ["\nCPU per completed request while the benchmark ran (ms, median of rounds; each role's "
             "process tree; the benchmark client not counted):"]
    for d in deps:
        runs = [ph for ph in phases if ph["deployment"] == d and ph.get("cpu_s") and ph.get("requests")]
        if not runs:
            continue
        roles = sorted({k for ph in runs for k in ph["cpu_s"]})
        per = {k: statistics.median(ph["cpu_s"].get(k, 0.0) / ph["requests"] * 1e3 for ph in runs) for k in roles}
        total = statistics.median(sum(ph["cpu_s"].values()) / ph["requests"] * 1e3 for ph in runs)
        lines.append(f"  {d}: total {total:.1f} (" + ", ".join(f"{k} {v:.1f}" for k, v in per.items()) + ")")
        threads = [ph for ph in runs if ph.get("threads_s")]
        if threads:
            names = {k for ph in threads for k in ph["threads_s"]}
            per = {k: statistics.median(ph["threads_s"].get(k, 0.0) / ph["requests"] * 1e3 for ph in threads)
                   for k in names}
            lines.append("    busiest threads: " + ", ".join(
                f"{k} {v:.1f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:top]))
    return "\n".join(lines)


def points(args) -> list[tuple[int, int]]:
    imgs = [int(x) for x in args.images.split(",") if x.strip()]
    conc = [int(x) for x in args.concurrency.split(",") if x.strip()]
    return [(i, c) for i in imgs for c in conc]


def drive(args, model: str, urls: dict, tag: str, rnd: int, out: Path) -> list[dict]:
    """Every (images, concurrency) point against ``urls["url"]`` in one benchmark process; each
    row carries the PD's (and E's) queue time and steps waited from the engines' traces."""
    url = urls["url"]
    buckets = "{" + ",".join(f"({w},{h},1):{1 / len(args.sizes):.4f}" for w, h in args.sizes) + "}"
    common = ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", url,
              "--model", model, "--tokenizer", model, "--dataset-name", "random-mm",
              "--num-prompts", str(args.prompts), "--random-input-len", str(args.input_len),
              "--random-output-len", str(args.output_len), "--ignore-eos", "--random-mm-bucket-config", buckets,
              "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99", "--save-result",
              "--result-dir", str(out), "--disable-tqdm"]
    pts = []
    for i, (images, conc) in enumerate(points(args)):
        name = f"{tag}-i{images}-c{conc}.json"
        # A seed per round and point: every deployment of a round gets the same requests, and no
        # point repeats an earlier point's images (the encoder caches of E and PD would serve them).
        pts.append({"tag": name, "images": images, "concurrency": conc, "argv": [
            "--seed", str(1000 * rnd + i),
            "--max-concurrency", str(conc), "--random-mm-base-items-per-request", str(images),
            "--random-mm-limit-mm-per-prompt", json.dumps({"image": images, "video": 0}),
            "--result-filename", name]})
    env = {**os.environ, **_env(_root(), cpu=not _cuda())}
    windows = out / f"{tag}.windows.json"
    pd = urls["pd"] if urls.get("pd_role") == "ec_consumer" else ""
    p = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(pts), str(windows), pd, urls.get("pd_ec") or "",
                        *common],
                       capture_output=True, text=True, env=env, timeout=3600)
    (out / f"{tag}.bench.log").write_text(p.stdout + p.stderr)
    spans = json.loads(windows.read_text()) if windows.exists() else {}
    pd_trace = request_trace.read(urls["trace"], urls["pd_role"]) if urls.get("trace") else []
    e_trace = request_trace.read(urls["trace"], "ec_producer") if urls.get("trace") else []
    rows = []
    prev = (spans.get("") or [0, 0, ""])[2]
    for pt in pts:
        f = out / pt["tag"]
        res = json.loads(f.read_text()) if f.exists() else {}
        span = spans.get(pt["tag"])
        phases = point_phases(prev, span[2]) if span and prev and span[2] else {}
        prev = span[2] if span else ""
        span = span[:2] if span else None
        rows.append({"images": pt["images"], "concurrency": pt["concurrency"],
                     "completed": res.get("completed", 0), "failed": res.get("failed", args.prompts if not res else 0),
                     "req_s": res.get("request_throughput"), "ttft_p50_ms": res.get("p50_ttft_ms"),
                     "ttft_p99_ms": res.get("p99_ttft_ms"), "e2el_p50_ms": res.get("p50_e2el_ms"),
                     "pd_queue": request_trace.summarize(pd_trace, *span) if span else {}, "pd_phases": phases,
                     "e_queue": request_trace.summarize(e_trace, *span) if span else {}})
        q = rows[-1]["pd_queue"]
        rows[-1].update(pd_queue_p50_ms=q.get("queue_p50_ms"), pd_steps_mean=q.get("steps_mean"),
                        pd_step_ms=q.get("step_ms"), pd_admit_ms=phases.get("admit_ms"),
                        pd_early_share=phases.get("early_share"), e_step_ms=rows[-1]["e_queue"].get("step_ms"),
                        pd_xfer_ms=phases.get("xfer_ms"), pd_barrier_ms=phases.get("barrier_ms"))
    return rows


def summarize(rows: list[dict], deps: list[str], ref: str) -> list[dict]:
    """Per (images, concurrency, deployment): medians over rounds and per-round ratios to ``ref``."""
    out = []
    keys = sorted({(r["images"], r["concurrency"]) for r in rows})
    for images, conc in keys:
        at = [r for r in rows if r["images"] == images and r["concurrency"] == conc]
        for d in deps:
            mine = [r for r in at if r["deployment"] == d]
            if not mine:
                continue
            s: dict[str, Any] = {"images": images, "concurrency": conc, "deployment": d, "rounds": len(mine),
                                 "failed": sum(r["failed"] or 0 for r in mine),
                                 "completed": sum(r["completed"] or 0 for r in mine)}
            for k in ("pd_steps_mean", "pd_step_ms", "pd_admit_ms", "pd_early_share", "e_step_ms", "pd_xfer_ms",
                      "pd_barrier_ms"):
                vals = [r[k] for r in mine if r.get(k) is not None]
                s[k] = round(statistics.median(vals), 3) if vals else None
            for k in ("ttft_p50_ms", "ttft_p99_ms", "req_s", "pd_queue_p50_ms"):
                vals = [r[k] for r in mine if r.get(k) is not None]
                s[k] = round(statistics.median(vals), 3 if k == "pd_queue_p50_ms" else 2) if vals else None
                ratios = sorted(a[k] / b[k] for a in mine for b in at
                                if b["deployment"] == ref and b["round"] == a["round"] and a.get(k) is not None
                                and b.get(k))
                s[f"{k}_ratio"] = ([round(statistics.median(ratios), 3), round(ratios[0], 3), round(ratios[-1], 3)]
                                   if ratios and d != ref else None)
            out.append(s)
    return out


def table(summary: list[dict], ref: str) -> str:
    lines = [f"| images | conc | deployment | TTFT p50 ms | TTFT p99 ms | req/s | failed | "
             f"p50 ÷ {ref} | p99 ÷ {ref} | req/s ÷ {ref} |", "|---|---|---|---|---|---|---|---|---|---|"]

    def ratio(v):
        return f"{v[0]:.2f} ({v[1]:.2f}-{v[2]:.2f})" if v else "—"

    for s in summary:
        lines.append(f"| {s['images']} | {s['concurrency']} | {s['deployment']} | {s['ttft_p50_ms']} | "
                     f"{s['ttft_p99_ms']} | {s['req_s']} | {s['failed']} of {s['failed'] + s['completed']} | "
                     f"{ratio(s['ttft_p50_ms_ratio'])} | {ratio(s['ttft_p99_ms_ratio'])} | {ratio(s['req_s_ratio'])} |")
    return "\n".join(lines)


def queue_table(summary: list[dict], ref: str) -> str:
    """Where the PD's requests waited: vLLM's queue time (added to the scheduler -> first scheduled)
    and the engine steps in between, from the engines' traces (the colocated instance for
    ``colocated``)."""
    lines = [f"| images | conc | deployment | PD queue p50 ms | ÷ {ref} | steps waited (mean) | one step ms | "
             "NixlEC admit ms (mean) | admitted early |", "|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        r = s.get("pd_queue_p50_ms_ratio")
        early = s.get("pd_early_share")
        lines.append(f"| {s['images']} | {s['concurrency']} | {s['deployment']} | {s.get('pd_queue_p50_ms')} | "
                     f"{f'{r[0]:.2f} ({r[1]:.2f}-{r[2]:.2f})' if r else '—'} | {s.get('pd_steps_mean')} | "
                     f"{s.get('pd_step_ms')} | {s.get('pd_admit_ms') if s.get('pd_admit_ms') is not None else '—'} | "
                     f"{f'{early:.0%}' if early is not None else '—'} |")
    return "\n".join(lines)


def load_table(summary: list[dict]) -> str:
    """E's engine step (its encode, from E's trace) and the PD's load (NixlEC: its READ or WRITE,
    post to landed, and the barrier's wait per step), medians of rounds."""
    lines = ["| images | conc | deployment | E step ms (encode) | PD transfer ms (post -> landed) | PD barrier ms |",
             "|---|---|---|---|---|---|"]
    for s in summary:
        if s["deployment"] == "colocated":
            continue
        lines.append(f"| {s['images']} | {s['concurrency']} | {s['deployment']} | {s.get('e_step_ms')} | "
                     f"{s.get('pd_xfer_ms') if s.get('pd_xfer_ms') is not None else '—'} | "
                     f"{s.get('pd_barrier_ms') if s.get('pd_barrier_ms') is not None else '—'} |")
    return "\n".join(lines)


def gpu_table(phases: list[dict], deps: list[str]) -> str:
    """GPU memory of each instance at the end of its run (nvidia-smi; the largest over rounds)."""
    lines = []
    for d in deps:
        runs = [ph.get("gpu_mib") or {} for ph in phases if ph["deployment"] == d]
        roles = sorted({k for r in runs for k in r})
        if roles:
            lines.append(f"  {d}: " + ", ".join(f"{k} {max(r.get(k, 0) for r in runs) / 1024:.1f} GiB" for k in roles))
    return ("\nGPU memory per process (nvidia-smi, end of each run; largest of rounds):\n" + "\n".join(lines)) \
        if lines else ""


def report(rows: list[dict], phases: list[dict], deps: list[str], ref: str) -> list[dict]:
    """Print every table of a run (or of merged runs); returns the summary."""
    summary = summarize(rows, deps, ref)
    print()
    print(table(summary, ref))
    print("\nPD queue (vLLM's queue time: added to the scheduler -> first scheduled; medians of rounds; "
          "steps: engine steps it waited, 0 = the first step after it arrived):")
    print(queue_table(summary, ref))
    print("\nE's encode and the PD's load (medians of rounds):")
    print(load_table(summary))
    print("\nconnector phases (means, ms; PD's /metrics or ec_port and E's side channel at the end of each run):")
    for ph in phases:
        if ph.get("pd") or ph.get("e"):
            pd = {k: v for k, v in (ph.get("pd") or {}).items() if not k.endswith("_sum_n")}
            print(f"  r{ph['round']} {ph['deployment']}: PD {pd} E {ph.get('e')}")
        if ph.get("storage"):
            print(f"  r{ph['round']} {ph['deployment']}: ECExample storage {ph['storage']}")
    print(cpu_table(phases, deps))
    print(gpu_table(phases, deps))
    return summary


def merge(paths: list[str]) -> tuple[list[dict], list[dict], list[str], str, dict]:
    """Rows and phases of several runs' JSON as one run: each run's rounds follow the previous
    run's (renumbered), deployments in first-seen order, the first run's reference and args."""
    rows, phases, deps, ref, args, base = [], [], [], None, {}, 0
    for path in paths:
        data = json.loads(Path(path).read_text())
        if data.get("schema") != SCHEMA:
            raise ValueError(f"{path}: not an ec-nixl bench serve result ({data.get('schema')!r})")
        rounds = sorted({r["round"] for r in data["rows"]})
        renumber = {r: base + i for i, r in enumerate(rounds)}
        rows += [dict(r, round=renumber[r["round"]]) for r in data["rows"]]
        phases += [dict(ph, round=renumber.get(ph["round"], ph["round"])) for ph in data.get("phases", [])]
        base += len(rounds)
        args = args or data.get("args", {})
        ref = ref or args.get("reference")
        deps += [d for d in dict.fromkeys(r["deployment"] for r in data["rows"]) if d not in deps]
    return rows, phases, deps, ref or "example", args


def plot(path: str, summary: list[dict]) -> None:
    from ec_nixl.bench import optional

    matplotlib, why = optional.load("matplotlib")
    if matplotlib is None:
        print(f"plot skipped: {why}")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    images = sorted({s["images"] for s in summary})
    fig, axes = plt.subplots(1, len(images), figsize=(6 * len(images), 4.5), squeeze=False)
    for ax, n in zip(axes[0], images):
        for d in dict.fromkeys(s["deployment"] for s in summary):
            pts = sorted((s["concurrency"], s["ttft_p50_ms"]) for s in summary
                         if s["images"] == n and s["deployment"] == d and s["ttft_p50_ms"])
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=d)
        ax.set_title(f"{n} image(s) per request")
        ax.set_xlabel("concurrency")
        ax.set_ylabel("TTFT p50, ms (median of rounds)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv: Optional[list] = None) -> int:
    args = parser().parse_args(argv)
    if args.merge:
        try:
            rows, phases, deps, ref, _ = merge(args.merge)
        except (OSError, ValueError, KeyError) as e:
            print(f"ec-nixl bench serve --merge: {e}", file=sys.stderr)
            return 2
        print(f"ec-nixl bench serve: {len(args.merge)} runs merged: {len({r['round'] for r in rows})} rounds of "
              f"{', '.join(deps)}")
        summary = report(rows, phases, deps, ref)
        _write(args, rows, summary, phases)
        return 0 if not sum(r["failed"] or 0 for r in rows) else 1
    reuse = args.workload != "random-mm"
    if args.deployments is None:
        from ec_nixl.bench.reuse import DEFAULT_DEPLOYMENTS as REUSE_DEPLOYMENTS

        args.deployments = REUSE_DEPLOYMENTS if reuse else DEFAULT_DEPLOYMENTS
    deps = [d.strip() for d in args.deployments.split(",") if d.strip()]
    try:
        bad = [d for d in deps if pd_media(split_variant(split_shape(d)[0])[0])[0] not in DEPLOYMENTS]
    except ValueError as e:
        print(f"ec-nixl bench serve: {e}", file=sys.stderr)
        return 2
    if bad or (args.reference not in deps and not reuse):
        print(f"ec-nixl bench serve: unknown deployment(s) {bad} or reference {args.reference!r} not among "
              f"{deps}; known: {', '.join(DEPLOYMENTS)}", file=sys.stderr)
        return 2
    try:
        args.sizes = [tuple(int(v) for v in s.lower().split("x")) for s in args.image_sizes.split(",") if s.strip()]
        points(args)
    except ValueError as e:
        print(f"ec-nixl bench serve: {e}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        shape = args.model_shape
        model = str((args.out / (shape or "tiny-vl")).resolve())
        if not Path(model, "config.json").exists():
            builder = _root() / "tests" / "e2e" / "build_tiny_vl.py"
            subprocess.run([sys.executable, str(builder), model, *(["--shape", shape] if shape else [])], check=True,
                           capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    vllm_args = args.vllm_args.split() if args.vllm_args else list(CPU_VLLM_ARGS)
    if args.model_shape and "--load-format" not in vllm_args:
        vllm_args += ["--load-format", "dummy"]  # the shapes only: no weights were written
    role_args = {"colocated": args.colocated_vllm_args.split(), "encoder": args.encoder_vllm_args.split(),
                 "pd": args.pd_vllm_args.split()}
    if reuse:
        from ec_nixl.bench.reuse import run as run_reuse

        return run_reuse(args, model, deps, vllm_args, deployment, thread_seconds)
    print(f"ec-nixl bench serve: {', '.join(deps)} x {args.rounds} rounds; points (images, concurrency) "
          f"{points(args)}; {args.prompts} prompts each; model {model}", flush=True)
    rows: list[dict] = []
    phases: list[dict] = []
    for rnd in range(args.rounds):
        for i, d in enumerate(deps):
            tag = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"r{rnd}-{d}")  # a folder name (d may carry @key=value)
            t0 = time.monotonic()
            try:
                with deployment(d, model, args.port + 100 * i, args.out / tag, vllm_args, role_args,
                                args.pool_mb << 20) as urls:
                    before, threads_before = cpu_seconds(urls["procs"]), thread_seconds(urls["procs"])
                    got = drive(args, model, urls, tag, rnd, args.out)
                    cpu = {k: round(v - before[k], 3) for k, v in cpu_seconds(urls["procs"]).items() if k in before}
                    threads = {k: round(v - threads_before.get(k, 0.0), 3)
                               for k, v in thread_seconds(urls["procs"]).items()}
                    phases.append({"round": rnd, "deployment": d, "pd": scrape(urls["pd"]) or pd_status(urls),
                                   "e": producer_stats(urls["e_ec"]), "cpu_s": cpu,
                                   "threads_s": {k: v for k, v in threads.items() if v > 0},
                                   "requests": sum(r["completed"] or 0 for r in got),
                                   "gpu_mib": gpu_memory(urls["procs"]), "storage": filesystem(urls.get("storage"))})
            except Exception as e:  # a deployment that cannot start is reported, the others still run
                print(f"  {tag}: failed to run: {e}", flush=True)
                got = [{"images": n, "concurrency": c, "completed": 0, "failed": args.prompts, "req_s": None,
                        "ttft_p50_ms": None, "ttft_p99_ms": None, "e2el_p50_ms": None, "error": str(e)[:500]}
                       for n, c in points(args)]
            for r in got:
                r.update(deployment=d, round=rnd)
                rows.append(r)
                print(f"  {tag} images={r['images']} conc={r['concurrency']}: TTFT p50 {_r(r['ttft_p50_ms'])} "
                      f"p99 {_r(r['ttft_p99_ms'])} ms, {_r(r['req_s'])} req/s, failed {r['failed']}", flush=True)
            print(f"  {tag}: {time.monotonic() - t0:.0f} s", flush=True)
            if args.json:  # what ran so far survives a run stopped by its time limit (--merge reads it)
                _write(args, rows, [], phases, quiet=True)
    summary = report(rows, phases, deps, args.reference)
    _write(args, rows, summary, phases)
    failed = sum(r["failed"] or 0 for r in rows)
    return 0 if not failed else 1


def pd_status(urls: dict) -> dict[str, Any]:
    """The PD's connector totals from its ec_port where its /metrics has none (vLLM 0.26)."""
    if not urls.get("pd_ec"):
        return {}
    try:
        c = instance_stats(urls["pd_ec"]).get("connector", {})
    except Exception as e:  # statistics are extra: never fail the run for them
        return {"error": str(e)[:200]}
    out = {k: int(c.get("counters", {}).get(k, 0)) for k in COUNTERS}
    out["link_modes"] = c.get("link_modes")
    out["pool"] = c.get("pool")
    return out


def _write(args, rows: list[dict], summary: list[dict], phases: list[dict], quiet: bool = False) -> None:
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"schema": SCHEMA, "args": {k: (str(v) if isinstance(v, Path) else v)
                                                                           for k, v in vars(args).items()},
                                               "rows": rows, "summary": summary, "phases": phases}, indent=1))
        if quiet:
            return
        print(f"wrote {args.json}")
    if args.plot:
        plot(args.plot, summary)
