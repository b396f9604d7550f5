"""The launcher: how instances are placed on cores (pure), and how the supervisor starts a process
(real processes: it runs the command itself in its own group, and the command dies with the
launcher)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from unittest import mock

import pytest

from ec_nixl.disagg.launcher import (
    Instance,
    LaunchConfig,
    Supervisor,
    cpu_binds,
    parse_args,
    plan,
    proxy_instance,
    wedged,
)
from helpers import wait_until


def binds(ncores: int, roles: list[str]) -> list[str]:
    with mock.patch("os.sched_getaffinity", return_value=set(range(ncores))):
        return cpu_binds(roles)


@pytest.mark.parametrize("ncores,roles,want", [
    (8, ["encoder", "encoder", "pd"], ["0,1", "2,3", "4,5"]),  # enough cores: disjoint ranges
    (4, ["encoder", "pd"], ["0,1", "2,3"]),
    (2, ["encoder", "encoder", "pd"], ["0", "0", "1"]),  # scarce: the consumer gets a core alone
    (3, ["encoder", "encoder", "pd", "pd"], ["0", "0", "1", "2"]),
    (2, ["encoder", "encoder", "pd", "pd"], ["0", "0", "1", "1"]),
    (2, ["encoder", "encoder", "encoder"], ["0", "1", "0"]),  # no consumer: round-robin
    (2, ["pd", "pd", "pd"], ["0", "1", "0"]),
    (1, ["encoder", "pd"], ["0", "0"]),  # one core: nothing else is possible
])
def test_cpu_binds_keep_consumers_off_encoder_cores(ncores: int, roles: list[str], want: list[str]) -> None:
    got = binds(ncores, roles)
    assert got == want
    if 1 < ncores < len(roles) and "pd" in roles and "encoder" in roles:
        enc = {got[i] for i, r in enumerate(roles) if r == "encoder"}
        pd = {got[i] for i, r in enumerate(roles) if r == "pd"}
        assert not enc & pd, f"an encoder shares a core with a consumer: {got}"


def test_plan_uses_the_binds(tmp_path) -> None:
    cfg = LaunchConfig(model="m", num_encoders=2, num_pd=1, log_dir=tmp_path, ec_buffer_device="cpu")
    with mock.patch("os.sched_getaffinity", return_value={0, 1}):
        insts = plan(cfg)
    assert [(i.role, i.env["VLLM_CPU_OMP_THREADS_BIND"]) for i in insts] == [
        ("encoder", "0"), ("encoder", "0"), ("pd", "1")]


def test_each_role_gets_its_own_vllm_args_and_env(tmp_path) -> None:
    """One GPU shared by E and PD: each role its own --gpu-memory-utilization (after the common
    flags, so it wins), from the CLI as from the API; a role's env reaches only its instances."""
    cfg = parse_args(["--model", "m", "--num-encoders", "2", "--log-dir", str(tmp_path), "--ec-buffer-device", "cpu",
                      "--vllm-args", "--enforce-eager --gpu-memory-utilization 0.9",
                      "--encoder-vllm-args", "--gpu-memory-utilization 0.1 --mm-encoder-only",
                      "--pd-vllm-args=--gpu-memory-utilization 0.5"])
    cfg.role_env = {"pd": {"FAULT": "1"}}
    insts = plan(cfg)
    for inst in insts:
        argv = inst.argv
        want = {"encoder": "0.1", "pd": "0.5"}[inst.role]
        utils = [argv[i + 1] for i, a in enumerate(argv) if a == "--gpu-memory-utilization"]
        assert utils[-1] == want and "--enforce-eager" in argv, (inst.name, argv)
        assert ("--mm-encoder-only" in argv) == (inst.role == "encoder"), argv
        assert inst.env.get("FAULT") == ("1" if inst.role == "pd" else None), inst.name
    with pytest.raises(ValueError, match="unknown role"):
        LaunchConfig(model="m", role_vllm_args={"decoder": ["--x"]})


@pytest.mark.parametrize("connector,proxy_args,push", [
    ("ECMooncakeConnector", [], True),  # its encoder must be told the consumer
    ("NixlECConnector", [], False),  # E then PD
    ("NixlECConnector", ["--flow", "push", "--pd-media", "placeholders"], True),  # asked for
    ("NixlECConnector", ["--flow", "mooncake"], True),  # the old name
    ("NixlECConnector", ["--flow", "overlap"], False),
])
def test_proxy_gets_the_consumer_addresses_for_the_push_flow(tmp_path, connector, proxy_args, push) -> None:
    cfg = LaunchConfig(model="m", num_encoders=1, num_pd=2, log_dir=tmp_path, ec_buffer_device="cpu",
                       connector=connector, proxy_args=proxy_args)
    insts = plan(cfg)
    argv = proxy_instance(cfg, insts).argv
    addrs = ",".join(f"tcp://{i.ec_transfer_config['ec_ip']}:{i.ec_transfer_config['ec_port']}"
                     for i in insts if i.role == "pd")
    assert (argv[argv.index("--pd-ec-addresses") + 1] == addrs) if push else "--pd-ec-addresses" not in argv, argv
    if proxy_args:
        assert argv[-len(proxy_args):] == proxy_args, argv  # the user's args come last (they win)


def _cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode() for a in f.read().split(b"\0") if a]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/status") as f:  # a zombie waiting for its reaper is gone too
        return any(ln.startswith("State:") and "Z" in ln for ln in f)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_spawned_command_runs_as_the_instance_process_in_its_own_group(tmp_path: Path) -> None:
    inst = Instance(name="sleeper", role="pd", port=0, argv=["sleep", "30"], env=dict(os.environ),
                    log_path=tmp_path / "sleeper.log")
    with Supervisor() as sup:
        sup.spawn(inst)
        pid = inst.proc.pid
        # The die-with-parent step execs the command in the same process: the pid the supervisor
        # signals and waits for is the command's, and it leads its own process group.
        assert wait_until(lambda: _cmdline(pid) == ["sleep", "30"], 10), _cmdline(pid)
        assert os.getpgid(pid) == pid
        if sys.version_info >= (3, 11):  # Popen's process_group
            # ...but not its own session: a session is a scheduler autogroup, and an instance in
            # one of its own was starved on a shared core (the comment at launcher._OWN_GROUP).
            assert os.getsid(pid) == os.getsid(0)
        assert inst.log_path.read_text().startswith("$ sleep 30")
    assert inst.proc.poll() is not None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_spawned_command_dies_with_the_launcher(tmp_path: Path) -> None:
    """SIGKILL the launcher (no cleanup runs): its instance gets SIGTERM from the kernel."""
    launcher = textwrap.dedent(f"""
        import os, sys, threading, time
        from pathlib import Path
        from ec_nixl.disagg.launcher import Instance, Supervisor
        # threads busy in the launcher while it spawns, as in the e2e tests (the old preexec_fn
        # ran Python between fork and exec, unsafe with threads)
        for _ in range(2):
            threading.Thread(target=lambda: [bytes(4096) for _ in iter(int, 1)], daemon=True).start()
        inst = Instance(name="sleeper", role="pd", port=0, argv=["sleep", "60"], env=dict(os.environ),
                        log_path=Path({str(tmp_path / "sleeper.log")!r}))
        Supervisor().spawn(inst)
        print(inst.proc.pid, flush=True)
        time.sleep(120)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True, env=env)
    try:
        child = int(proc.stdout.readline())
        assert wait_until(lambda: _cmdline(child) == ["sleep", "60"], 20), _cmdline(child)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert wait_until(lambda: _gone(child), 10), f"the instance ({child}) outlived its launcher"
    finally:
        proc.kill()
        proc.wait()
        try:
            os.kill(child, signal.SIGKILL)
        except (ProcessLookupError, NameError):
            pass


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_sleeping_or_busy_young_group_is_not_wedged(tmp_path: Path) -> None:
    """``wedged`` names only what the OS holds (D, or runnable a minute with no CPU): a process
    waiting in sleep() or a freshly started busy one is the program's own doing."""
    for argv in (["sleep", "30"], [sys.executable, "-c", "while True: pass"]):
        inst = Instance(name="w", role="encoder", port=0, argv=argv, env=dict(os.environ), log_path=tmp_path / "w.log")
        with Supervisor() as sup:
            sup.spawn(inst)
            assert wait_until(lambda: _cmdline(inst.proc.pid) == argv, 10)
            assert wedged(inst.proc.pid) == []
            sup.stop(1)


@pytest.mark.parametrize("n_e,n_pd,connector,proxy_args,route,want", [
    (1, 2, "NixlECConnector", [], "auto", "cache-aware"),  # more than one PD
    (2, 1, "NixlECConnector", [], "auto", "cache-aware"),  # more than one E
    (1, 1, "NixlECConnector", [], "auto", "round-robin"),  # nothing to choose between
    (2, 2, "NixlECConnector", ["--flow", "overlap"], "auto", "round-robin"),  # cache-aware is flow pull's
    (2, 2, "ECExampleConnector", [], "auto", "round-robin"),  # no events
    (1, 2, "NixlECConnector", [], "round-robin", "round-robin"),
])
def test_serve_disagg_turns_events_on_and_picks_the_route(tmp_path, n_e, n_pd, connector, proxy_args, route,
                                                          want) -> None:
    cfg = LaunchConfig(model="m", num_encoders=n_e, num_pd=n_pd, log_dir=tmp_path, ec_buffer_device="cpu",
                       connector=connector, proxy_args=proxy_args, route=route)
    insts = plan(cfg)
    argv = proxy_instance(cfg, insts).argv
    assert argv[argv.index("--route") + 1] == want, argv
    if connector != "NixlECConnector":
        assert "--events" not in argv
        return
    for i in insts:  # each instance names itself by the URL the proxy knows it by
        extra = i.ec_transfer_config["ec_connector_extra_config"]
        assert extra["events"] is True and extra["events_instance"] == i.url
        assert extra["events_port"] == i.ec_transfer_config["ec_port"] + 1000
    sources = argv[argv.index("--events") + 1].split(",")
    want_sources = []
    for i in insts:
        base = i.ec_transfer_config["ec_port"] + 1000
        want_sources += [f"tcp://127.0.0.1:{base}"] + ([f"tcp://127.0.0.1:{base + 2}"] if i.role == "encoder" else [])
    assert sources == want_sources


def test_serve_disagg_without_events(tmp_path) -> None:
    cfg = LaunchConfig(model="m", num_encoders=2, num_pd=2, log_dir=tmp_path, ec_buffer_device="cpu", events=False)
    insts = plan(cfg)
    argv = proxy_instance(cfg, insts).argv
    assert "events" not in insts[0].ec_transfer_config["ec_connector_extra_config"]
    assert argv[argv.index("--route") + 1] == "round-robin" and "--events" not in argv
    # an instance's own extra_config wins over the launcher's
    cfg = LaunchConfig(model="m", num_encoders=1, num_pd=2, log_dir=tmp_path, ec_buffer_device="cpu",
                       extra_config={"events": False})
    assert "--events" not in proxy_instance(cfg, plan(cfg)).argv
