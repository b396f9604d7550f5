"""``ec-nixl bench e2e``: does NixlECConnector serve real vLLM E -> PD on this host, right?

One command for any host with vLLM (a GPU: VRAM pools, NIXL over CUDA IPC; or a CPU: DRAM pools):

* a **colocated** vLLM server (no EC connector) gives the reference answers;
* an **E** (``ec_producer``) and a **PD** (``ec_consumer``) instance with NixlECConnector, each
  its own process and (on one GPU) its own ``--gpu-memory-utilization``, behind
  ``ec-nixl serve-disagg``'s proxy in the standard flow (E, then PD with E's
  ``ec_transfer_params``);
* the PD's **vision tower is corrupted** (``faults/sitecustomize.py``: it returns its embeddings
  negated), so an image the PD encoded itself would change its answer.

At least 20 greedy requests (one image, two images, the same image twice, two-turn chats whose
second turn carries the first turn's image) go through the proxy, one at a time, and each must
equal the colocated server's token ids. Then, from each instance's own counters (``ec-nixl
status`` on its ``ec_port``: E's endpoint; the PD's scheduler, with its workers' reports):

* every item moved by NIXL: the PD loaded as many as the requests carried images, over links of
  a known mode (READ or WRITE), into a pool of the expected memory (VRAM on a GPU), from E's pool
  of the same memory;
* no local fallbacks and no failed loads on the PD;
* the pools drain: E's pool and the PD's are empty once the requests are done;
* the corruption is real: two requests sent to the PD alone (it encodes them itself) answer
  differently from the colocated server (else the checks above would prove nothing).

Exit status 0 when every check passed, 1 otherwise (each check is printed with what it saw), 2 on
bad options. ``--json`` keeps everything. ``scripts/check_guards.py --marker gpu -k race`` runs
it against a copy with the load barrier broken (``tests/e2e/test_e2e_vllm_check.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

FAULTS = Path(__file__).with_name("faults")
CPU_ARGS = ["--max-model-len", "1024", "--max-num-seqs", "4", "--enforce-eager", "--dtype", "bfloat16",
            "--limit-mm-per-prompt", '{"image":4,"video":0}']
GPU_ARGS = ["--max-model-len", "2048", "--max-num-seqs", "8", "--dtype", "bfloat16",
            "--limit-mm-per-prompt", '{"image":4,"video":0}']
MAX_TOKENS = 8
LEASE_S = 15.0
"""E's announce lease here (60 s by default): an encoder-cache hit E publishes again for a turn-2
request whose PD holds the image itself is never read, and leaves E's pool when its lease ends."""


NO_VERDICT = "NO VERDICT"  # how scripts/check_guards.py tells "could not judge" from "caught"


class NoVerdict(RuntimeError):
    """The run never reached the checks it is judged by."""


@dataclass
class Check:
    name: str
    ok: bool
    saw: Any


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)
    requests: list[dict] = field(default_factory=list)
    e_status: dict = field(default_factory=dict)
    pd_status: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)

    def check(self, name: str, ok: bool, saw: Any) -> bool:
        self.checks.append(Check(name, bool(ok), saw))
        print(f"  [{'ok' if ok else 'FAILED'}] {name}: {saw}", flush=True)
        return bool(ok)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    def verdict(self, only: list[str], error: BaseException | None = None) -> list[str]:
        """The failed checks among those ``only`` names (their names' starts; empty: all).

        Where ``only`` narrows the checks (a guard row judged by its answers alone) and the run
        stopped before any of them was made (``error``: a server that never came up, a port still
        held), there is no verdict: that raises ``NoVerdict``, which ``scripts/check_guards.py``
        never counts as catching a breakage. Without ``only`` such a run is a plain failure."""
        asserted = [c for c in self.checks if not only or any(c.name.startswith(w) for w in only)]
        if not asserted:
            if only:
                raise NoVerdict(f"{NO_VERDICT}: none of the checks {only} was made"
                                + (f" ({type(error).__name__}: {error})" if error else ""))
            return [f"no check was made{f' ({type(error).__name__}: {error})' if error else ''}"]
        return [f"{c.name}: {c.saw}" for c in asserted if not c.ok]

    def as_dict(self) -> dict:
        return {"passed": self.passed, "checks": [vars(c) for c in self.checks], "requests": self.requests,
                "e_status": self.e_status, "pd_status": self.pd_status, "info": self.info}


def requests_plan(model: str) -> list[tuple[str, dict]]:
    """(kind, chat body) of every request: >= 20, every shape the issue names."""
    from ec_nixl.disagg.ttft import SIZES, chat_body

    out: list[tuple[str, dict]] = []
    for i in range(8):
        out.append(("one image", chat_body(model, [SIZES[i % len(SIZES)]], f"e2e-one-{i}", MAX_TOKENS)))
    for i in range(5):
        out.append(("two images", chat_body(model, [SIZES[i % 6], SIZES[(i + 3) % 6]], f"e2e-two-{i}", MAX_TOKENS)))
    for i in range(3):
        body = chat_body(model, [SIZES[(i + 1) % 6]], f"e2e-twice-{i}", MAX_TOKENS)
        parts = body["messages"][0]["content"]
        parts.insert(1, dict(parts[0]))  # the same image_url part twice
        out.append(("same image twice", body))
    for i in range(3):
        turn1 = chat_body(model, [SIZES[(i + 2) % 6]], f"e2e-chat-{i}", MAX_TOKENS)
        turn2 = dict(turn1, messages=turn1["messages"] + [
            {"role": "assistant", "content": "a colour gradient"},
            {"role": "user", "content": [{"type": "text", "text": f"and now, chat {i}?"}]}])
        out += [("turn 1", turn1), ("turn 2 (turn 1's image in its history)", turn2)]
    return out


def images_of(body: dict) -> int:
    """Distinct images of a request (the same image twice is one item: one load)."""
    return len({p["image_url"]["url"] for m in body["messages"] if isinstance(m.get("content"), list)
                for p in m["content"] if p.get("type") == "image_url"})


def token_ids(url: str, body: dict, timeout: float = 300.0) -> list[int]:
    import requests

    r = requests.post(url + "/v1/chat/completions", json=dict(body, stream=False), timeout=timeout)
    if r.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
    return r.json()["choices"][0]["token_ids"]


def status(address: str) -> dict:
    """An instance's counters over its side channel (what ``ec-nixl status`` prints)."""
    from ec_nixl.bench.serve import instance_stats

    return instance_stats(address)


def wait_for(pred: Callable[[], Any], timeout_s: float, every_s: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(every_s)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ec-nixl bench e2e", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a Qwen2-VL / Qwen2.5-VL model (default: the tiny one, built under --out)")
    p.add_argument("--out", type=Path, default=Path("ec-nixl-e2e"), help="logs, the tiny model")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available")
    p.add_argument("--port", type=int, default=19000, help="first of a block of 100 ports")
    p.add_argument("--pool-mb", type=int, default=256, help="ec_buffer_size of E and PD, MiB")
    p.add_argument("--util", default="0.25,0.15,0.25",
                   help="one GPU: --gpu-memory-utilization of colocated, E, PD (default 0.25,0.15,0.25)")
    p.add_argument("--vllm-args", default=None, help="flags for every instance (default: small settings)")
    p.add_argument("--encoder-vllm-args", default="", help="flags for E only (e.g. --mm-encoder-only on vLLM 0.26)")
    p.add_argument("--extra-config", default=[], type=json.loads, action="append",
                   help="JSON merged into ec_connector_extra_config of E and PD (e.g. {\"mode\": \"read\"}; "
                        f"repeatable, later keys win); announce_lease_s defaults to {LEASE_S:.0f} here (what the "
                        "drain check waits for)")
    p.add_argument("--reference", type=Path, default=None,
                   help="an earlier run's --json report with the same --model: its colocated answers are the "
                        "reference and no colocated server starts (the corruption check is then not run); what "
                        "the race rows of scripts/check_guards.py use to save a start-up each")
    p.add_argument("--delay-push-ms", type=float, default=0.0,
                   help="fault injection: E posts each WRITE it is asked for this much later (slows the transfer "
                        "on purpose; faults/sitecustomize.py)")
    p.add_argument("--json", default=None, help="write the report here")
    return p


def run(args, rep: Report) -> Report:
    from ec_nixl.bench.serve import _env, _root, plugin_registered
    from ec_nixl.disagg.launcher import Cluster, Instance, LaunchConfig, Supervisor, instance_env, vllm_argv

    device = args.device or ("cuda" if _cuda() else "cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model or _tiny_model(args.out)
    common = shlex.split(args.vllm_args) if args.vllm_args is not None else list(GPU_ARGS if device == "cuda" else CPU_ARGS)
    util = [u for u in args.util.split(",")]
    per_role: dict[str, list[str]] = {"encoder": shlex.split(args.encoder_vllm_args), "pd": []}
    colocated_args = list(common)
    if device == "cuda":
        colocated_args += ["--gpu-memory-utilization", util[0]]
        per_role["encoder"] = ["--gpu-memory-utilization", util[1], *per_role["encoder"]]
        per_role["pd"] = ["--gpu-memory-utilization", util[2]]
    env = _env(_root(), cpu=device == "cpu")
    pd_env = {"EC_NIXL_FAULT_CORRUPT_VISION": "1",
              "PYTHONPATH": os.pathsep.join([str(FAULTS), env["PYTHONPATH"]])}
    role_env = {"pd": pd_env}
    if args.delay_push_ms > 0:
        role_env["encoder"] = {"EC_NIXL_FAULT_DELAY_PUSH_MS": str(args.delay_push_ms),
                               "PYTHONPATH": os.pathsep.join([str(FAULTS), env["PYTHONPATH"]])}
    extra = {"announce_lease_s": LEASE_S}
    for e in args.extra_config:
        extra.update(e)
    reference = _reference(args.reference, model) if args.reference else None
    logs = args.out / "logs"
    import ec_nixl

    rep.info = {"device": device, "model": model, "vllm_args": common, "per_role": per_role,
                "extra_config": extra, "colocated_args": colocated_args, "ec_nixl": ec_nixl.__file__,
                "vllm": _vllm_version(), "plugin": plugin_registered(),
                "reference": str(args.reference) if args.reference else "a colocated server",
                "delay_push_ms": args.delay_push_ms}
    print(f"ec-nixl bench e2e: {json.dumps(rep.info)}", flush=True)
    cfg = LaunchConfig(model=model, num_encoders=1, num_pd=1, port=args.port, base_port=args.port + 1,
                       connector="NixlECConnector", connector_module=None if rep.info["plugin"] else "ec_nixl.vllm",
                       ec_base_port=args.port + 20, ec_buffer_size=args.pool_mb << 20, ec_buffer_device=device,
                       vllm_args=common, role_vllm_args=per_role, role_env=role_env, log_dir=logs, env=env,
                       extra_config=extra, startup_timeout_s=900.0)
    colocated = None if reference is not None else \
        Instance(name="colocated", role="baseline", port=args.port + 10, log_path=logs / "colocated.log",
                 argv=vllm_argv(model, args.port + 10, colocated_args, None),
                 env=instance_env(dict(os.environ), None, None, env))
    t0 = time.monotonic()
    with Supervisor() as sup, Cluster(cfg) as cluster:
        if colocated is not None:
            sup.spawn(colocated)
            if device == "cuda":  # one GPU: one start-up at a time (Cluster.start says why)
                sup.wait_healthy([colocated], 900.0)
        cluster.start()
        if colocated is not None:
            sup.wait_healthy([colocated], 900.0)
        cluster.wait_ready()
        rep.info["startup_s"] = round(time.monotonic() - t0, 1)
        e, pd = cluster.instances
        e_addr = f"127.0.0.1:{e.ec_transfer_config['ec_port']}"
        pd_addr = f"127.0.0.1:{pd.ec_transfer_config['ec_port']}"
        print(f"  all healthy after {rep.info['startup_s']} s; E {e_addr}, PD {pd_addr}", flush=True)
        before = status(pd_addr).get("connector", {}).get("counters", {})
        want = reference or (lambda i, body: token_ids(colocated.url, body))
        _serve_and_compare(rep, model, want, cluster.proxy_url)
        _check_transfers(rep, e_addr, pd_addr, before, pd.url, device)
        if colocated is not None:
            _check_corruption(rep, model, colocated.url, pd.url)
        else:
            rep.info["corruption_check"] = "not run: no colocated server (--reference)"
    return rep


def _reference(path: Path, model: str) -> Callable[[int, dict], list[int]]:
    """The colocated answers of an earlier report of the same model, by request index (the plan
    is fixed); ValueError where the report cannot be that reference."""
    done = json.loads(Path(path).read_text())
    if done.get("info", {}).get("model") != model:
        raise ValueError(f"--reference {path} answered model {done.get('info', {}).get('model')!r}, "
                         f"this run serves {model!r}: give it --model of that run")
    answers = {r["i"]: r["colocated"] for r in done.get("requests", []) if r.get("colocated")}
    need = len(requests_plan(model))
    if len(answers) < need:
        raise ValueError(f"--reference {path} has colocated answers for {len(answers)} of the {need} "
                         f"requests: run it once without --reference first")
    return lambda i, body: answers[i]


def _serve_and_compare(rep: Report, model: str, want_of: Callable[[int, dict], list[int]], proxy: str) -> None:
    plan = requests_plan(model)
    same = 0
    for i, (kind, body) in enumerate(plan):
        t0 = time.perf_counter()
        try:
            got = token_ids(proxy, body)
            err = ""
        except Exception as e:  # a failed request is a failed check, not a crash of the run
            got, err = [], str(e)[:300]
        ms = (time.perf_counter() - t0) * 1e3
        want = want_of(i, body)
        equal = got == want and not err
        same += equal
        rep.requests.append({"i": i, "kind": kind, "images": images_of(body), "equal": equal, "ms": round(ms, 1),
                             "tokens": got, "colocated": want, "error": err})
    by_kind: dict[str, list[int]] = {}
    for r in rep.requests:
        by_kind.setdefault(r["kind"], [0, 0])
        by_kind[r["kind"]][0] += r["equal"]
        by_kind[r["kind"]][1] += 1
    rep.check("answers token-identical to the colocated server", same == len(plan) and len(plan) >= 20,
              f"{same} of {len(plan)} ({', '.join(f'{k}: {a}/{n}' for k, (a, n) in by_kind.items())})")


def _check_transfers(rep: Report, e_addr: str, pd_addr: str, before: dict, pd_url: str, device: str) -> None:
    images = sum(r["images"] for r in rep.requests)
    want_mem = "VRAM" if device == "cuda" else "DRAM"
    # The PD reports its pool's occupancy with a step that runs: one text-only request makes it step.
    try:
        token_ids(pd_url, {"model": rep.info["model"], "messages": [{"role": "user", "content": "text only"}],
                           "max_tokens": 2, "temperature": 0.0, "return_token_ids": True})
    except Exception as e:
        rep.info["text_only_error"] = str(e)[:300]

    def drained() -> bool:
        rep.e_status, rep.pd_status = status(e_addr), status(pd_addr)
        pools = rep.pd_status.get("connector", {}).get("pool", {})
        return rep.e_status["pool"]["used"] == 0 and rep.e_status.get("items") == 0 and \
            bool(pools) and all(p.get("used") == 0 for p in pools.values())

    lease = float(args_lease(rep))
    ok = wait_for(drained, lease + 10.0)
    unread = {h: it for h, it in (rep.e_status.get("holding") or {}).items() if not it.get("pins") and not it.get("interest")}
    conn = rep.pd_status.get("connector", {})
    counters = {k: int(v) - int(before.get(k, 0)) for k, v in conn.get("counters", {}).items()}
    pools = conn.get("pool", {})
    rep.info["pd_counters"] = {k: v for k, v in counters.items() if v}
    rep.info["e_counters"] = {k: v for k, v in rep.e_status.get("counters", {}).items() if v}
    modes = conn.get("link_modes", {})
    rep.check("items moved by NIXL: E's pool and the PD's in " + want_mem,
              rep.e_status.get("mem_type") == want_mem and pools and
              all(p.get("mem_type") == want_mem for p in pools.values()),
              f"E {rep.e_status.get('mem_type')}, PD {[p.get('mem_type') for p in pools.values()]}")
    rep.check("the PD's links have a mode (read: PD pulls, write: E pushes)",
              bool(modes) and all(m in ("read", "write") for m in modes.values()), modes)
    landed = counters.get("loads_landed", 0)
    rep.check("the PD loaded every image of every request (none encoded there)",
              landed >= images - _turn2_images(rep) and landed <= images,
              f"{landed} loads landed for {images} distinct images per request ({_turn2_images(rep)} of them "
              f"turn 2's, which the PD's encoder cache may still hold)")
    bad = {k: counters.get(k, 0) for k in ("local_fallbacks", "late_fallbacks", "loads_failed", "failed_transfers")}
    rep.check("0 local fallbacks, 0 failed loads", not any(bad.values()), bad)
    rep.check("pools drained at the end (E's and the PD's)", ok,
              f"E used {rep.e_status.get('pool', {}).get('used')} B, items {rep.e_status.get('items')} "
              f"({len(unread)} unclaimed, waiting out their {lease:.0f} s lease) after {lease + 10:.0f} s at most; "
              f"PD {({r: p.get('used') for r, p in pools.items()})}")


def args_lease(rep: Report) -> float:
    return float(rep.info.get("extra_config", {}).get("announce_lease_s", 60.0))


def _turn2_images(rep: Report) -> int:
    return sum(r["images"] for r in rep.requests if r["kind"].startswith("turn 2"))


def _check_corruption(rep: Report, model: str, colocated: str, pd_url: str) -> None:
    from ec_nixl.disagg.ttft import SIZES, chat_body

    differ = 0
    for i in range(2):
        body = chat_body(model, [SIZES[i]], f"e2e-pd-alone-{i}", MAX_TOKENS)
        try:
            differ += token_ids(pd_url, body) != token_ids(colocated, body)
        except Exception as e:
            rep.info.setdefault("pd_alone_errors", []).append(str(e)[:200])
    rep.check("the PD's own vision tower is corrupted (alone, it answers differently)", differ == 2,
              f"{differ} of 2 differ")


def _tiny_model(out: Path) -> str:
    from ec_nixl.bench.serve import _root

    model = str((out / "tiny-vl").resolve())
    if not Path(model, "config.json").exists():
        subprocess.run([sys.executable, str(_root() / "tests" / "e2e" / "build_tiny_vl.py"), model], check=True,
                       capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return model


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def _vllm_version() -> str:
    try:
        from importlib.metadata import version

        return version("vllm")
    except Exception:
        try:
            import vllm

            return str(vllm.__version__)
        except Exception as e:
            return f"unknown ({e})"


def main(argv: Optional[list] = None) -> int:
    args = parser().parse_args(argv)
    rep = Report()
    try:
        run(args, rep)
    except Exception as e:  # what was checked before stays in the report
        print(f"ec-nixl bench e2e: could not go on: {e!r}", file=sys.stderr, flush=True)
        rep.check("the run went through", False, repr(e)[-2000:])
    print(f"ec-nixl bench e2e: {'PASSED' if rep.passed else 'FAILED'} "
          f"({sum(c.ok for c in rep.checks)} of {len(rep.checks)} checks)", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rep.as_dict(), indent=1, default=str))
    return 0 if rep.passed else 1


if __name__ == "__main__":
    sys.exit(main())
