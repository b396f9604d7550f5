"""scripts/check_guards.py judges a breakage only by a test's verdict: a run that never reached its
checks (NO VERDICT) is not a catch, and a ``timeout`` around the script leaves no test session or
server behind. Real pytest processes; the tests they run are written here, nothing is faked."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ec_nixl.bench.vllm_e2e import NO_VERDICT, Check, NoVerdict, Report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "check_guards.py")


def _guards():
    spec = importlib.util.spec_from_file_location("check_guards", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("check_guards", mod)  # its dataclasses look their module up there
    spec.loader.exec_module(sys.modules["check_guards"])
    return sys.modules["check_guards"]


def _report(*checks: tuple[str, bool]) -> Report:
    return Report(checks=[Check(name, ok, "saw") for name, ok in checks])


def test_verdict_judges_a_narrowed_run_by_its_own_checks_alone() -> None:
    both = _report(("answers token-identical", True), ("pools drained", False))
    assert both.verdict(["answers"]) == []
    assert both.verdict([]) == ["pools drained: saw"]
    wrong = _report(("answers token-identical", False))
    assert wrong.verdict(["answers"], RuntimeError("later")) == ["answers token-identical: saw"]


def test_verdict_of_a_run_that_made_none_of_its_checks() -> None:
    stopped = _report(("servers healthy", False))
    with pytest.raises(NoVerdict, match=f"{NO_VERDICT}.*OSError: Address already in use"):
        stopped.verdict(["answers"], OSError("Address already in use"))
    # Not narrowed (CI's own run): a plain failure, never a silent pass.
    assert Report().verdict([], OSError("x")) == ["no check was made (OSError: x)"]


def test_a_no_verdict_failure_is_not_counted_as_catching(tmp_path) -> None:
    (tmp_path / "test_three.py").write_text(textwrap.dedent("""
        from ec_nixl.bench.vllm_e2e import Report

        def test_passes():
            pass

        def test_wrong_answers():
            assert 1 == 2, "answers differ"

        def test_never_came_up():
            Report().verdict(["answers"], OSError("Address already in use"))
    """))
    g = _guards()
    env = {**os.environ, "PYTHONPATH": ROOT}
    outcomes, crashed, _ = g._pytest(str(tmp_path), ("test_three.py",), "not gpu", env, 120)
    assert crashed == ""
    by_name = {g.base_name(n): o for n, o in outcomes.items()}
    assert by_name["test_passes"] == "passed"
    assert by_name["test_wrong_answers"] == "failed" and g.by_assertion(by_name["test_wrong_answers"])
    nv = by_name["test_never_came_up"]
    assert nv.startswith("no verdict: NO VERDICT") and "Address already in use" in nv, nv
    assert not g.by_assertion(nv)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_ends_the_test_session_and_its_servers(tmp_path) -> None:
    """What a ``timeout`` around a race row does: the row's pytest, in a session of its own, and the
    server it started must go with the script (before, they held their ports against the next row)."""
    pidfile = tmp_path / "server.pid"
    (tmp_path / "test_slow.py").write_text(textwrap.dedent(f"""
        import subprocess, time

        def test_serves_for_long():
            server = subprocess.Popen(["sleep", "300"])
            open({str(pidfile)!r}, "w").write(str(server.pid))
            time.sleep(300)
    """))
    driver = textwrap.dedent(f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("check_guards", {SCRIPT!r})
        g = sys.modules["check_guards"] = importlib.util.module_from_spec(spec); spec.loader.exec_module(g)
        g._end_sessions_on_term()  # as main() does
        g._pytest({str(tmp_path)!r}, ("test_slow.py",), "not gpu", {{"PATH": "/usr/bin:/bin", "PYTHONPATH": {ROOT!r}}}, 600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", driver])
    deadline = time.monotonic() + 60
    while not pidfile.exists() or not pidfile.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, "the slow test never started"
        time.sleep(0.1)
    server = int(pidfile.read_text())
    assert _alive(server)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 10
    while _alive(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(server), "the test's server outlived the guard script"
