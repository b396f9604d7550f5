"""Shared pieces of the end-to-end tests: the tiny model, one colocated baseline server for the whole
session (every e2e module compares against it, so it starts once), free ports and the HTTP helpers.

Test modules import the helpers with ``from conftest import ...`` (pytest puts this directory first
on ``sys.path`` while it collects them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from ports import free_port_block  # noqa: F401  (the e2e modules import it from here)

COMMON_VLLM_ARGS = ["--max-model-len", "1024", "--max-num-seqs", "4", "--enforce-eager", "--dtype", "bfloat16",
                    "--limit-mm-per-prompt", '{"image":4,"video":0}']
# Every server gets one core and thus one OpenMP thread, so that reductions (and greedy tokens) match.
SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shim")
BASE_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
            # one NUMA node: vLLM's worker skips its migrate_pages (shim/sitecustomize.py says why)
            "EC_NIXL_E2E_NO_NUMA_MIGRATE": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (SHIM, os.environ.get("PYTHONPATH", "")) if p)}
STARTUP_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 120.0


def token_ids(url: str, body: dict[str, Any]) -> list[int]:
    """Generated token ids, from a plain answer or from the deltas of a streamed one."""
    import requests

    stream = bool(body.get("stream"))
    r = requests.post(url + "/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S, stream=stream)
    assert r.status_code == 200, f"{url}: HTTP {r.status_code}: {r.text[:500]}"
    if not stream:
        return r.json()["choices"][0]["token_ids"]
    ids: list[int] = []
    for line in r.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            chunk = json.loads(line[6:])
            assert "error" not in chunk, f"{url}: the stream failed after {len(ids)} tokens: {chunk['error']}"
            for choice in chunk["choices"]:
                ids += choice.get("token_ids") or []
    return ids


def nixl_metrics(url: str, per_engine: bool = False) -> dict[str, float]:
    """The ``vllm:nixl_ec_*`` series of the server at ``url``, each summed over its label sets
    (engines, ranks); with ``per_engine`` keyed ``name@engine`` instead (DP: one engine per rank)."""
    import requests

    r = requests.get(url + "/metrics", timeout=10)
    assert r.status_code == 200, r.text[:300]
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        if line.startswith("vllm:nixl_ec_"):
            series, value = line.rsplit(" ", 1)
            name = series.split("{", 1)[0]
            if per_engine:
                eng = series.split('engine="', 1)[1].split('"', 1)[0] if 'engine="' in series else "?"
                name = f"{name}@{eng}"
            out[name] = out.get(name, 0.0) + float(value)
    return out


def wait_until(pred: Callable[[], Any], timeout_s: float, interval_s: float = 0.2) -> Any:
    """Poll ``pred`` until it returns something truthy (returned) or ``timeout_s`` passes (the last
    falsy value is returned)."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(interval_s)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("model") / "tiny-vl"
    subprocess.run([sys.executable, str(Path(__file__).with_name("build_tiny_vl.py")), str(out)], check=True,
                   capture_output=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    return str(out)


class Baseline:
    """One colocated server (no EC config); started at once, waited for on first use. Answers are
    cached per request body (same body, same greedy tokens)."""

    def __init__(self, sup: Any, inst: Any):
        self.sup, self.inst, self.ready = sup, inst, False
        self.results: dict[str, list[int]] = {}

    @property
    def url(self) -> str:
        return self.inst.url

    def token_ids(self, body: dict[str, Any]) -> list[int]:
        if not self.ready:
            self.sup.wait_healthy([self.inst], STARTUP_TIMEOUT_S)
            self.ready = True
        key = json.dumps(dict(body, stream=False), sort_keys=True)
        if key not in self.results:
            self.results[key] = token_ids(self.inst.url, dict(body, stream=False))
        return self.results[key]


@pytest.fixture(scope="session")
def baseline(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Baseline]:
    from ec_nixl.disagg.launcher import Instance, Supervisor, instance_env, vllm_argv

    port = free_port_block(1)
    log = tmp_path_factory.mktemp("baseline") / "baseline.log"
    inst = Instance(name="baseline", role="baseline", port=port, log_path=log,
                    argv=vllm_argv(tiny_model, port, COMMON_VLLM_ARGS + ["--disable-log-stats"], None),
                    env=instance_env(dict(os.environ), str(max(os.sched_getaffinity(0))), None, BASE_ENV))
    with Supervisor() as sup:
        sup.spawn(inst)
        yield Baseline(sup, inst)
