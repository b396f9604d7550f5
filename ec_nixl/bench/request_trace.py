"""Where a request waits inside a vLLM engine: a per-request scheduling trace for ``ec-nixl bench serve``.

TTFT alone cannot tell an admission that waited an engine step from a slow prefill, and vLLM's
own queue-time metric is a histogram whose first bucket is 0.3 s, with no step count at all. So
``bench serve`` sets ``EC_NIXL_BENCH_TRACE_DIR`` on the instances it starts, and the ec-nixl
plugin (loaded by every vLLM process of the venv, whatever its connector) then wraps that
process's scheduler with ``install``: each request's **first scheduling** writes one JSON line

    {"req": id, "arrival": wall s (vLLM's front-end arrival_time), "queued": wall s (add_request),
     "scheduled": wall s (the start of the schedule() that first gave it tokens, where vLLM takes
     its scheduled_ts), "steps": schedule() calls
     from queued to that one, 0 = the first step after its arrival, "step": that step's index}

to ``trace-{role}-{pid}.jsonl`` there (role: the EC role, or ``colocated``). ``queued`` to
``scheduled`` is what vLLM calls queue time (its ``queued_ts``/``scheduled_ts`` pair); ``steps``
counts engine steps, empty ones included, the request waited for. Nothing is written unless the
variable is set; ``summarize`` reads the lines of one time window back.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Optional

ENV = "EC_NIXL_BENCH_TRACE_DIR"
_installed = False


def install() -> None:
    """Wrap ``Scheduler.add_request`` and ``Scheduler.schedule`` of this process (idempotent)."""
    global _installed
    out = os.environ.get(ENV)
    if not out or _installed:
        return
    from vllm.v1.core.sched.scheduler import Scheduler

    _installed = True
    add_request, schedule = Scheduler.add_request, Scheduler.schedule

    def traced_add_request(self, request, *args, **kwargs):
        trace = _trace(self, out)
        if request.request_id not in self.requests:
            trace.queued[request.request_id] = (time.time(), trace.steps, getattr(request, "arrival_time", None))
        return add_request(self, request, *args, **kwargs)

    def traced_schedule(self, *args, **kwargs):
        trace = _trace(self, out)
        now, step = time.time(), trace.steps  # (vLLM's scheduled_ts is taken where schedule() starts)
        so = schedule(self, *args, **kwargs)
        trace.steps += 1
        for new in getattr(so, "scheduled_new_reqs", ()) or ():
            q = trace.queued.pop(new.req_id, None)
            if q is not None:
                trace.write({"req": new.req_id, "arrival": q[2], "queued": round(q[0], 6),
                             "scheduled": round(now, 6), "steps": step - q[1], "step": step})
        return so

    Scheduler.add_request, Scheduler.schedule = traced_add_request, traced_schedule


class _Trace:
    """One scheduler's counters and its line-buffered file."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a", buffering=1)
        self.steps = 0
        self.queued: dict[str, tuple[float, int, Optional[float]]] = {}

    def write(self, rec: dict) -> None:
        self.file.write(json.dumps(rec) + "\n")


def _trace(scheduler, out: str) -> _Trace:
    trace = getattr(scheduler, "_ec_nixl_trace", None)
    if trace is None:
        ec = getattr(getattr(scheduler, "vllm_config", None), "ec_transfer_config", None)
        role = getattr(ec, "ec_role", None) or "colocated"
        trace = _Trace(Path(out) / f"trace-{role}-{os.getpid()}.jsonl")
        scheduler._ec_nixl_trace = trace
    return trace


def read(trace_dir: Path, role: str) -> list[dict]:
    """Every line the ``role`` engines wrote under ``trace_dir`` (a torn last line is skipped)."""
    recs = []
    for f in sorted(Path(trace_dir).glob(f"trace-{role}-*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                recs.append(json.loads(line))
            except ValueError:
                continue
    return recs


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def summarize(recs: list[dict], t0: float, t1: float) -> dict[str, Any]:
    """Queue time (ms) and steps waited of the requests queued within [t0, t1] ({} if none)."""
    win = [r for r in recs if t0 <= r["queued"] <= t1]
    if not win:
        return {}
    queue = [(r["scheduled"] - r["queued"]) * 1e3 for r in win]
    steps = [r["steps"] for r in win]
    out = {"n": len(win), "queue_p50_ms": round(_pct(queue, 50), 3), "queue_p99_ms": round(_pct(queue, 99), 3),
           "queue_mean_ms": round(statistics.mean(queue), 3), "steps_mean": round(statistics.mean(steps), 3),
           "steps_p50": _pct(steps, 50), "steps_max": max(steps),
           "waited_a_step": sum(1 for s in steps if s > 0)}
    front = [(r["queued"] - r["arrival"]) * 1e3 for r in win if r.get("arrival")]
    if front:
        out["arrival_to_queued_p50_ms"] = round(_pct(front, 50), 3)
    span = [r["step"] for r in win]
    if max(span) > min(span):  # mean wall time of one engine step while this window ran
        times = [r["scheduled"] for r in win]
        out["step_ms"] = round((max(times) - min(times)) / (max(span) - min(span)) * 1e3, 3)
    return out
