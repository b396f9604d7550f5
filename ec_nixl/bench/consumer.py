"""The Prefill/Decode side of the bench: one process that runs every case and reports rows.

It makes the consumer endpoints (a READ link, a WRITE link, a DRAM link for host-bounce) and pays
their handshakes and first transfers untimed; measures the pair's idle cost; then, case by case,
asks a path (``paths``) for samples until the case's budget is spent; and streams every result to
the orchestrator over its control pipe (``("row", {...})`` and friends, see ``orchestrator``).
The endpoints are caller-driven (``threaded=False``), as a vLLM consumer-only worker's are.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ec_nixl.bench import idle, memory, proc
from ec_nixl.bench.memory import as_u8, check, open_source, pin, unpin
from ec_nixl.bench.paths import FRAGILE, PATHS, ours, reference
from ec_nixl.bench.paths.base import Skip
from ec_nixl.bench.units import BLOCK, ItemSpec, pctl

LOADED = ("ours-read", "ours-write")  # the cases that make "under load" in the idle table
READS = ("ours-read", "publish-landed", "expect-landed")  # the consumer's READ link moves their bytes
SETTLE_FIRST = ("items", "stage_unpublished", "drain")  # producer commands that wait for our reads to be freed


class Consumer:
    def __init__(self, cfg: dict, prod, ctl):
        import torch

        from ec_nixl import Endpoint, EndpointConfig, LoadBarrier

        self.cfg, self.prod, self.ctl = cfg, prod, ctl
        memory.FULL_CHECK = cfg.get("check") == "full"
        self.device = cfg["device"]
        self.cuda = self.device.startswith("cuda")
        if self.cuda:
            torch.cuda.set_device(0)
        else:
            torch.set_num_threads(1)
        self.info = self.rpc("info", timeout=180)
        self.remote = cfg.get("producer")  # HOST:PORT of a producer on another host, else None
        if self.remote:
            from ec_nixl.bench.remote import reachable, split_hostport

            phost = split_hostport(self.remote, 0)[0]
            for k in ("address", "host_address"):
                if self.info[k]:
                    self.info[k] = reachable(self.info[k], phost)
        pid, paths = os.getpid(), cfg["paths"]
        common = dict(pool_bytes=cfg["pool_bytes"], block_bytes=BLOCK, threaded=False, load_timeout_s=60.0,
                      peer_timeout_s=30.0, backend_params=cfg.get("backend_params") or {},
                      nixl_progress_thread=cfg.get("nixl_progress_thread"))
        links = {"read": ("ours-read" in paths or "publish-landed" in paths or "expect-landed" in paths or cfg["barrier"], self.device, "read"),
                 "write": ("ours-write" in paths or "staged-write" in paths or "expect-write" in paths, self.device,
                           "write"),
                 "host": (self.cuda and "host-bounce" in paths, "cpu", "read")}
        self.eps: dict[str, Any] = {
            k: Endpoint(EndpointConfig(name=f"ecb-cons-{k[0]}-{pid}", device=dev, mode=mode, **common))
            for k, (wanted, dev, mode) in links.items() if wanted}
        self.pinned = "host" in self.eps and pin(self.eps["host"].pool.arena)
        # As vLLM's PD worker does: the hand-over pays for the bytes only; the after-completion
        # work (read-done to the producer, telemetry) is settled by the next progress() (untimed).
        self.barriers = {k: LoadBarrier(ep, settle=False) for k, ep in self.eps.items()}
        self._warm_up()
        # Destination of the reference copy, host-bounce's H2D and ucx (pre-touched); raw-nixl has its own.
        self.dst_bytes = cfg["pool_bytes"]
        if self.cuda:
            self.dst = torch.zeros(self.dst_bytes, dtype=torch.uint8, device="cuda")
        else:
            import numpy as np

            self.dst = torch.from_numpy(np.ones(self.dst_bytes, dtype=np.uint8))
            self.dst_np = self.dst.numpy()
        if self.remote:  # its /dev/shm path may even exist here (namespaces on one machine): not the same memory
            self.src, self.src_note = None, "the producer is on another host"
        else:
            self.src, self.src_note = open_source(self.info["ref"], self.info["src_bytes"])
        self._dcur = self._scur = 0
        self.skipped: dict[str, str] = {}
        self.extras: dict[str, Any] = {}  # per-run state of optional paths (ucx client, raw agent)
        read, self.cpu_source = idle.cpu_reader()
        pids = {"producer": self.info["pid"], "consumer": pid}
        if self.remote and read:
            # The producer's CPU is read by the producer (another host's /proc is not ours).
            pids["producer"], local = -1, read
            read = lambda p: self.rpc("cpu_seconds") if p == -1 else local(p)  # noqa: E731
            self.cpu_source += " here, os.times() at the remote producer"
        self.loaded = idle.CpuMeter(pids, read) if read else None

    def _warm_up(self) -> None:
        """Handshakes and the first, wire-up-paying transfer of each link: untimed."""
        tiny = (BLOCK, (BLOCK // 2,), "bfloat16")
        for k, ep in self.eps.items():
            addr = self.info["host_address"] if k == "host" else self.info["address"]
            (descs, probes, _), = self.rpc("items", "bounce" if k == "host" else "ours", f"warm-{k}", tiny, 1, 1)
            tickets = ep.load(ours.held_refs(ep, addr, descs, hold=(k != "write")))
            out = self.barriers[k].wait(tickets, timeout=60)
            check(as_u8(out[descs[0].mm_hash]), probes[0], f"warm-up over link {k}")
            for t in tickets:
                t.release()

    # --- plumbing for the paths ------------------------------------------------------------

    def rpc(self, cmd: str, *args, timeout: float = 120.0):
        if cmd in SETTLE_FIRST:
            self.settle()
        return proc.call(self.prod, cmd, *args, timeout=timeout)

    def settle(self) -> None:
        """Tell the producer now what we read: our endpoints are caller-driven and their barriers
        leave read-done messages to the next round (as vLLM's PD worker does), which may not come
        before the producer waits for those items to be freed (``Producer.settle``, ``drain``)."""
        for ep in self.eps.values():
            ep.progress()

    def send(self, *msg) -> None:
        self.ctl.send(msg)

    def dst_region(self, nbytes: int) -> int:
        span = self.dst_bytes - nbytes
        off = self._dcur if self._dcur <= span else 0
        self._dcur = off + -(-nbytes // 4096) * 4096
        return off

    def src_off(self, nbytes: int) -> int:
        span = self.info["src_bytes"] - nbytes
        off = self._scur if self._scur <= span else 0
        self._scur = off + -(-nbytes // 4096) * 4096
        return off

    # --- cases -----------------------------------------------------------------------------

    def run_case(self, path: str, spec: ItemSpec, per_op: int) -> None:
        """Warm-up, then repeats that adapt to ``budget_s`` between min and max; one row."""
        cfg = self.cfg
        impl = PATHS[path](self, spec, per_op)
        warm = max(1, cfg["warmup"])
        samples: list[float] = []
        done, target = 0, None
        meter = self.loaded if path in LOADED else None
        if meter:
            meter.start()
        reads = self.eps.get("read") if path in READS else None
        before = reads.metrics.snapshot()["counters"] if reads is not None else None
        t_case = time.perf_counter()
        try:
            while True:
                want = warm - done if target is None else warm + target - done
                if want <= 0:
                    break
                for dt in impl.samples(min(want, impl.chunk)):
                    if done >= warm:
                        samples.append(dt)
                    done += 1
                if target is None:
                    per = (time.perf_counter() - t_case) / max(1, done)
                    target = int(min(cfg["repeats"], max(cfg["min_repeats"], cfg["budget_s"] / max(per, 1e-9))))
        finally:
            if meter:
                meter.stop()
            impl.finish()
        extra = {}
        if reads is not None:
            self.settle()  # the last operation's telemetry is taken at its settle
            after = reads.metrics.snapshot()["counters"]
            n = after["transfers"] - before["transfers"]
            if n > 0:
                extra["descs_per_request"] = (after["descriptors"] - before["descriptors"]) / n
        self.row(path, spec.nbytes * per_op, per_op, samples, spec.label, **extra)

    def row(self, path: str, nbytes: int, items: int, samples: list[float], label: str, **extra) -> None:
        us = [s * 1e6 for s in samples]
        p50 = pctl(us, 50)
        self.send("row", {"path": path, "bytes": int(nbytes), "items": int(items), "p50_us": p50,
                          "p99_us": pctl(us, 99), "gbps": (nbytes / (p50 * 1e-6) / 1e9) if p50 > 0 else 0.0,
                          "n": len(us), "label": label, **extra})

    def run_all(self) -> None:
        cfg = self.cfg
        if self.remote:
            from ec_nixl.bench.remote import LOCAL_ONLY

            for path in cfg["paths"]:
                if path in LOCAL_ONLY:
                    self.skip(path, f"not across hosts: {LOCAL_ONLY[path]}")
        if cfg["idle_s"] > 0:
            self.send("case", f"idle window ({cfg['idle_s']:g} s)")
            self.measure_idle(cfg["idle_s"])
        for spec, per_op in cfg["cases"]:
            spec = ItemSpec(*spec)
            for path in cfg["paths"]:
                self.send("case", f"{path} {spec.label}" + (f" x{per_op}" if per_op > 1 else ""))
                if path in self.skipped:
                    continue
                try:
                    self.run_case(path, spec, per_op)
                except Skip as e:
                    self.skip(path, str(e))
                except Exception as e:
                    if path not in FRAGILE:
                        raise
                    first = (str(e).strip().splitlines() or [""])[0]  # not the peer's traceback
                    self.skip(path, f"failed: {type(e).__name__}: {first}")
        if cfg["barrier"]:
            self.send("case", "barrier-landed")
            spec = ItemSpec(*cfg["barrier"][0])
            for nbytes, n, ts in ours.barrier_landed(self, spec, cfg["barrier"][1]):
                self.row("barrier-landed", nbytes, n, ts, spec.label)
        self.send("case", "copy bandwidth")
        self.send("copybw", reference.copy_bandwidth(self.cuda, cfg["copy_bw_bytes"]))
        if self.loaded is not None and self.loaded.wall > 0:
            self.send("cpu", {"loaded": {"wall_s": self.loaded.wall, "cores": self.loaded.cores()},
                              "source": self.cpu_source})

    def skip(self, path: str, why: str) -> None:
        self.skipped[path] = why
        self.send("skip", path, why)

    def measure_idle(self, seconds: float) -> None:
        if self.loaded is None:  # no way to read CPU times here: cpu_source says why
            self.send("cpu", {"idle_skipped": self.cpu_source})
            return
        self.send("cpu", {"idle": idle.idle_window(self.loaded.pids, seconds, self.loaded.read),
                          "source": self.cpu_source})

    def env(self) -> dict:
        import torch

        env = {"device": self.device, "torch": torch.__version__, "pinned": self.pinned and self.info["pinned"]}
        if self.cuda:
            env["gpu"] = torch.cuda.get_device_name(0)
        if self.remote:
            env["producer"] = f"{self.remote} (host {self.info.get('hostname', '?')}, pid {self.info['pid']})"
        try:
            from importlib.metadata import version

            env["nixl"] = version("nixl")
        except Exception:
            env["nixl"] = "?"
        return env

    def close(self) -> None:
        raw = self.extras.get("raw")
        if raw is not None:
            raw.close()
        for k, ep in self.eps.items():
            if k == "host" and self.pinned:
                unpin(ep.pool.arena)
            try:
                ep.close()
            except Exception:
                pass


def consumer_main(cfg: dict, conn, ctl) -> None:
    """Entry point of the spawned consumer: every case, then the producer's counters, then done.
    ``conn`` is the pipe to the spawned producer, or None when it runs on another host
    (``cfg['producer']``)."""

    def body(cons: Consumer) -> None:
        cons.send("env", cons.env())
        cons.run_all()
        if "raw_params" in cons.extras:
            cons.send("env", {"raw_params": cons.extras["raw_params"], "raw_threads": cons.extras["raw_threads"]})
        st = cons.rpc("stats")
        left = cons.rpc("drain", 10.0)
        cons.send("prodstats", {"staging_copies": st["dev"]["counters"]["staging_copies"],
                                "published": st["dev"]["counters"]["published"], "left_bytes": left})
        cons.send("done", None)

    box = {"conn": conn}

    def make() -> Consumer:
        if box["conn"] is None:  # the producer runs on another host: reach it over TCP
            from ec_nixl.bench import remote

            box["conn"] = remote.connect(cfg)
        return Consumer(cfg, box["conn"], ctl)

    try:
        proc.run_role("consumer", cfg, ctl, make, body)
    finally:
        if box["conn"] is not None:
            try:
                box["conn"].send(("close", ()))  # the producer's serve loop ends
            except Exception:
                pass
            if conn is None:  # the producer's answer: it saw the end (else it reports a lost consumer)
                try:
                    if box["conn"].poll(10):
                        box["conn"].recv()
                except Exception:
                    pass
                box["conn"].close()
