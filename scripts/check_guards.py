#!/usr/bin/env python3
"""Do the guards still bite? Break each core guarantee on purpose in a temporary copy of the
package, run the tests that guard it against that copy, and print which of them caught it.

    python scripts/check_guards.py               # every breakage (CPU tests; ~20 min on two cores)
    python scripts/check_guards.py -k fence      # the breakages whose name contains 'fence'
    python scripts/check_guards.py --baseline    # first run the same tests on an unbroken copy
    python scripts/check_guards.py --marker gpu  # the GPU tests instead (on a CUDA machine)
    python scripts/check_guards.py --list        # the table, nothing run
    python scripts/check_guards.py --check       # every breakage still applies to the source?

Run it with the test environment's Python (e.g. ``.venv/bin/python``); it sets ``PYTHONPATH``
to the copy itself. Not run by CI: it runs the guarding tests once per breakage. Anyone changing
the hot path runs it to see that every breakage is still caught, by the tests named in the
breakage's ``expect``. Exit status 1 if a breakage was caught by none of the tests run (or if
an ``old`` text is no longer in the source).

Each breakage is data in ``BREAKAGES``: the file, the exact text it replaces (it must occur
exactly once, so a stale entry stops the script instead of passing silently), the text put
there instead, the tests to run and the ones expected to catch it. When the source moves,
re-point ``file``/``old``/``new``; nothing else here knows about the source.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL_SOAK = {"EC_NIXL_SOAK_ITEMS": "1000"}  # the soak at a tenth of its size: fails fast or passes in ~1 min


@dataclass(frozen=True)
class Breakage:
    name: str
    guarantee: str  # what the breakage violates
    file: str  # relative to the repository root
    old: str  # exact text replaced; must occur exactly once in ``file``
    new: str
    tests: tuple[str, ...]  # pytest arguments (files or node ids) run against the broken copy
    expect: tuple[str, ...]  # test names (no parameters) that must be among those that catch it
    env: dict = field(default_factory=dict)  # extra environment for the test run


BREAKAGES: tuple[Breakage, ...] = (
    Breakage(
        name="scheduler-has-item-before-hold",
        guarantee="has_cache_item is True only for items whose producer confirmed the hold",
        file="ec_nixl/vllm/scheduler.py",
        old="""    def has_cache_item(self, identifier: str) -> bool:
        return identifier in self._ready
""",
        new="""    def has_cache_item(self, identifier: str) -> bool:
        return identifier in self._ready or identifier in self._users  # BROKEN: admitted, hold or not
""",
        tests=("tests/test_vllm_adapter.py",),
        expect=("test_no_admission_while_a_hold_is_outstanding",),
    ),
    Breakage(
        name="scheduler-admits-before-hold",
        guarantee="ensure_cache_available admits a request only once every remote item is held",
        file="ec_nixl/vllm/scheduler.py",
        old="""            pending |= it.status == "holding"
""",
        new="""            pending |= False  # BROKEN: an item still holding does not keep the request waiting
""",
        tests=("tests/test_vllm_adapter.py",),
        expect=("test_no_admission_while_a_hold_is_outstanding",),
    ),
    Breakage(
        name="read-lands-when-posted",
        guarantee="a READ's item lands when NIXL reports the READ complete, not when it is posted",
        file="ec_nixl/loader.py",
        old="""        for t in tickets:
            t.xfer, t.t_post = x, t_post
            t.enter(Phase.READ)
""",
        new="""        for t in tickets:
            t.xfer, t.t_post = x, t_post
            t.enter(Phase.READ)
            self._landed(t)  # BROKEN: landed at post time
""",
        tests=("tests/test_transfer.py", "tests/test_faults_peer_death.py", "tests/test_soak.py"),
        expect=("test_barrier_waits_for_a_read_still_in_flight",
                "test_producer_killed_mid_transfer_hands_over_only_whole_items"),
        env=SMALL_SOAK,
    ),
    Breakage(
        name="pool-release-ignores-fences",
        guarantee="a slot given back behind a fence (the gather's CUDA event) is not reused before it completes",
        file="ec_nixl/pool.py",
        old="""            slot.holds -= 1
            if slot.holds > 0:
                return
            slot.fences = [f for f in slot.fences if not f.query()]
""",
        new="""            slot.holds -= 1
            if slot.holds > 0:
                return
            slot.fences = []  # BROKEN: pending fences ignored
""",
        tests=("tests/test_pool.py", "tests/test_transfer.py"),
        expect=("test_no_reuse_while_held_or_fenced", "test_released_slot_is_not_reused_before_its_fence"),
    ),
    Breakage(
        name="producer-skips-compat-check",
        guarantee="a producer refuses a Hello whose compatibility hash differs from its own",
        file="ec_nixl/handshake.py",
        old="""    if msg.compat != me.compat and not is_observer(msg):
""",
        new="""    if False and msg.compat != me.compat and not is_observer(msg):  # BROKEN: no compat check
""",
        tests=("tests/test_security.py", "tests/test_faults_input.py"),
        expect=("test_producer_refuses_a_hello_with_a_wrong_compat_hash",),
    ),
    Breakage(
        name="barrier-returns-on-slots",
        guarantee="the barrier hands over an item only once its ticket says it landed",
        file="ec_nixl/barrier.py",
        old="""        if not all(t.state is TicketState.LANDED for t in tickets):
            self._wait_landed(tickets, timeout)
        out = {t.mm_hash: t.tensor() for t in tickets}
""",
        new="""        self.endpoint.wait_for(lambda: all(t.done or t.slot is not None for t in tickets),
                               60.0)  # BROKEN: a reserved slot is enough
        failures = {t.mm_hash: (t.error or t.reason or t.state) for t in tickets if t.state is TicketState.FAILED}
        if failures:
            raise LoadFailed(failures)
        out = {t.mm_hash: t.slot.view(t.ref.desc.shape, getattr(torch, t.ref.desc.dtype))
               for t in tickets}  # BROKEN: bypasses the ticket's own guard (tensor())
""",
        tests=("tests/test_transfer.py", "tests/test_faults_peer_death.py", "tests/test_soak.py"),
        expect=("test_barrier_returns_at_once_for_landed_items",
                "test_producer_killed_mid_transfer_hands_over_only_whole_items", "test_soak_2x2_read_and_write"),
        env=SMALL_SOAK,
    ),
)


def copy_tree(dst: str) -> None:
    """The package and its tests (with any built extension), not git, caches or the venv."""
    skip = shutil.ignore_patterns("__pycache__", ".hypothesis", ".pytest_cache", "*.pyc")
    for name in ("ec_nixl", "tests"):
        shutil.copytree(os.path.join(ROOT, name), os.path.join(dst, name), ignore=skip)
    shutil.copy(os.path.join(ROOT, "pytest.ini"), dst)


def apply(b: Breakage, root: str) -> None:
    path = os.path.join(root, b.file)
    with open(path) as f:
        src = f.read()
    n = src.count(b.old)
    if n != 1:
        raise SystemExit(f"check_guards: breakage {b.name}: its old text occurs {n} times in {b.file} "
                         f"(expected once): re-point the entry in BREAKAGES")
    with open(path, "w") as f:
        f.write(src.replace(b.old, b.new))


def _env(root: str, env_extra: dict) -> dict:
    """The copy first on the path (checked in ``run_tests``), then whatever the caller had there
    (e.g. wheels unpacked into a folder on a machine without the venv)."""
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, **env_extra, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}


def _end_session(sid: int) -> None:
    """Kill, one by one, what is left of the session pytest ran in: a pytest that crashed leaves
    its peer processes behind (a producer frozen with SIGSTOP would stay frozen for good)."""
    for _ in range(3):
        left = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":  # fields[3]: the session id
                left.append(int(entry))
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)


def _pytest(root: str, tests, marker: str, env: dict, timeout: float):
    """One pytest process: (failed test ids, tests run, crashed: a reason or '')."""
    xml = os.path.join(root, "junit.xml")
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-m", marker, "--junitxml", xml,
           "-o", "junit_family=xunit1", *tests]
    crashed = ""
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        if proc.returncode not in (0, 1, 5):
            crashed = f"pytest exit {proc.returncode}" + (f" (signal {-proc.returncode})" if proc.returncode < 0 else "")
            progress = out.lstrip().split("\n", 1)[0].split("[", 1)[0].strip()
            if len(tests) == 1 and set(progress) <= set(".FEsx") and ("F" in progress or "E" in progress):
                crashed = f"failed, then {crashed}"  # pytest prints a test's verdict before its teardown
    except subprocess.TimeoutExpired:
        crashed = f"hung: killed after {timeout:.0f}s"
    finally:
        _end_session(proc.pid)
        proc.wait(10)
    failed, ran = [], 0
    if os.path.exists(xml):
        for case in ET.parse(xml).getroot().iter("testcase"):
            if case.find("skipped") is not None:
                continue
            ran += 1
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(f"{case.get('file') or case.get('classname')}::{case.get('name')}")
        os.remove(xml)
    elif not crashed:
        crashed = "no test report"
    return failed, ran, crashed


def _collect(root: str, test: str, marker: str, env: dict) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--collect-only",
                          "-m", marker, test], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    return [line.strip() for line in out.stdout.splitlines() if "::" in line]


def run_tests(root: str, tests: tuple[str, ...], marker: str, env_extra: dict, timeout: float):
    """Run ``tests`` against the copy at ``root``: (failed test ids, ran, seconds, note).

    A breakage may crash pytest itself (e.g. a slot freed under a running DMA): then each file is
    run on its own, and the tests of a file that crashes one by one, so that every test gets a
    verdict; a test whose process crashed or hung counts as having caught the breakage.
    """
    env = _env(root, env_extra)
    which = subprocess.run([sys.executable, "-c", "import ec_nixl; print(ec_nixl.__file__)"], cwd=root, env=env,
                           capture_output=True, text=True, timeout=120)
    if not which.stdout.strip().startswith(root):
        raise SystemExit(f"check_guards: the copy does not import its own ec_nixl: {which.stdout}{which.stderr}")
    t0 = time.monotonic()
    failed, ran, crashed = _pytest(root, tests, marker, env, timeout)
    note = ""
    if crashed:
        note = f"({crashed}: ran again file by file, and test by test where a file crashed)"
        failed, ran = [], 0
        for test in tests:
            f, r, c = _pytest(root, (test,), marker, env, timeout)
            if c:
                f, r = [], 0
                for node in _collect(root, test, marker, env):
                    f1, r1, c1 = _pytest(root, (node,), marker, env, min(timeout, 900.0))
                    f += [f"{node} ({c1})"] if c1 else f1
                    r += 1 if c1 else r1
            failed += f
            ran += r
    return failed, ran, time.monotonic() - t0, note


def base_name(test_id: str) -> str:
    return test_id.rsplit("::", 1)[-1].split("[", 1)[0].split(" (", 1)[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-k", default="", help="only breakages whose name contains this")
    ap.add_argument("--marker", default="not gpu", help="pytest -m expression (default: 'not gpu')")
    ap.add_argument("--baseline", action="store_true", help="first run the tests on an unbroken copy")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per breakage's test run")
    ap.add_argument("--list", action="store_true", help="print the breakages and exit")
    ap.add_argument("--check", action="store_true",
                    help="only check that every breakage still applies (its old text is found once)")
    args = ap.parse_args()
    chosen = [b for b in BREAKAGES if args.k in b.name]
    if args.list:
        for b in chosen:
            print(f"{b.name}: {b.guarantee}\n    {b.file}; tests {' '.join(b.tests)}; expect {', '.join(b.expect)}")
        return 0
    if args.check:
        with tempfile.TemporaryDirectory(prefix="ec-nixl-guards-") as tmp:
            copy_tree(tmp)
            for b in chosen:
                apply(b, tmp)  # exits naming the breakage whose old text is gone
        print(f"all {len(chosen)} breakages apply")
        return 0
    failing_anyway: set[str] = set()
    if args.baseline:
        tests = tuple(dict.fromkeys(t for b in chosen for t in b.tests))
        env = {k: v for b in chosen for k, v in b.env.items()}
        with tempfile.TemporaryDirectory(prefix="ec-nixl-guards-") as tmp:
            copy_tree(tmp)
            failed, ran, seconds, note = run_tests(tmp, tests, args.marker, env, args.timeout)
        failing_anyway = set(failed)
        print(f"baseline (unbroken): {ran} tests, {len(failed)} failed, {seconds:.0f}s {note}".rstrip(), flush=True)
        for f in failed:
            print(f"    fails without any breakage: {f}")
    rows, bad = [], 0
    for b in chosen:
        with tempfile.TemporaryDirectory(prefix="ec-nixl-guards-") as tmp:
            copy_tree(tmp)
            apply(b, tmp)
            failed, ran, seconds, note = run_tests(tmp, b.tests, args.marker, b.env, args.timeout)
        caught = [f for f in failed if f not in failing_anyway]
        missing = [e for e in b.expect if e not in {base_name(f) for f in caught}]
        status = "CAUGHT" if caught else "NOT CAUGHT"
        if not caught or missing:
            bad += 1
        print(f"\n{b.name}: {status} by {len(caught)} of {ran} tests run ({seconds:.0f}s) {note}".rstrip(), flush=True)
        print(f"    guarantee: {b.guarantee}")
        for f in caught:
            print(f"    caught by {f}")
        for e in missing:
            print(f"    EXPECTED BUT DID NOT CATCH: {e}")
        rows.append((b.name, caught, ran, seconds, missing))
    print("\n| breakage | tests that caught it | run | s |\n|---|---|---|---|")
    for name, caught, ran, seconds, missing in rows:
        names = ", ".join(sorted(f.split("::", 1)[-1] for f in caught))
        miss = f" **missing: {', '.join(missing)}**" if missing else ""
        print(f"| {name} | {len(caught)}: {names or 'none'}{miss} | {ran} | {seconds:.0f} |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
