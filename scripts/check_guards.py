#!/usr/bin/env python3
"""Do the guards still bite? Break each core guarantee on purpose in a temporary copy of the
package, run the tests that guard it against that copy, and print which of them caught it.

    python scripts/check_guards.py               # every breakage (CPU tests; ~20 min on two cores)
    python scripts/check_guards.py -k fence      # the breakages whose name contains 'fence'
    python scripts/check_guards.py --no-baseline # skip the first run, on an unbroken copy
    python scripts/check_guards.py --marker gpu  # the GPU tests instead (on a CUDA machine)
    python scripts/check_guards.py --marker gpu -k race  # the load race inside a real vLLM (GPU host)
    python scripts/check_guards.py --list        # the table, nothing run
    python scripts/check_guards.py --check       # every breakage still applies to the source?

Run it with the test environment's Python (e.g. ``.venv/bin/python``); it sets ``PYTHONPATH``
to the copy itself. Not run by CI: it runs the guarding tests once per breakage. Anyone changing
the hot path runs it to see that every breakage is still caught, by the tests named in the
breakage's ``expect``, each by a failing assertion: a test whose process crashes or hangs, or
that fails saying it could not judge (NO VERDICT), is listed, never counted as catching. It
first runs the same tests on an unbroken copy and refuses to judge anything (exit status 2)
unless they all pass there. Exit status 1 if a breakage was not caught by every expected test
(or if an ``old`` text is no longer in the source).

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
# A test that could not judge (tests/e2e/test_e2e_vllm_check.py: its deployment never came up)
# fails with this in its message: listed with the crashes, never counted as catching.
NO_VERDICT = "NO VERDICT"
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


READ_TRACKED = """        for t in tickets:
            t.xfer, t.t_post = x, t_post
            t.enter(_READ)
        self.in_flight[x] = tickets
"""
READ_LANDS_AT_POST = """        for t in tickets:
            t.xfer, t.t_post = x, t_post
            t.enter(_READ)
            t.land()  # BROKEN: landed at post time (both posting paths)
            self.metrics.count("loads_landed")
            self.loop.changed()
        self.in_flight[x] = tickets
"""
"""The READ lane's ``_track``, where both posting paths end, and the same landing every ticket at
once (two rows: the CPU tests' and the race inside vLLM)."""

BREAKAGES: tuple[Breakage, ...] = (
    Breakage(
        name="scheduler-has-item-before-hold",
        guarantee="has_cache_item is True only for items whose producer confirmed the hold, or that were "
                  "admitted early (a gated request's items wait for their Holds)",
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
        guarantee="ensure_cache_available admits a gated request (e.g. metadata-only) only once every remote "
                  "item is held",
        file="ec_nixl/vllm/scheduler.py",
        old="""            pending |= it.status == "holding"
""",
        new="""            pending |= False  # BROKEN: an item still holding does not keep the request waiting
""",
        tests=("tests/test_vllm_adapter.py",),
        expect=("test_no_admission_while_a_hold_is_outstanding",),
    ),
    Breakage(
        name="scheduler-gates-every-request",
        guarantee="a request whose remote items carry their media, from a connected producer, is "
                  "scheduled in the step a local cache hit would be (it does not wait for a Hold)",
        file="ec_nixl/vllm/scheduler.py",
        old="""        if not self.opts.early_admission or self.opts.fallback != "auto" or adm.failed or adm.expected \\
                or not adm.items:
            return False
""",
        new="""        return False  # BROKEN: every request waits for its Holds again (a step or more under load)
""",
        tests=("tests/test_vllm_adapter.py", "tests/test_vllm_mrv2.py"),
        expect=("test_request_with_its_media_is_admitted_in_its_first_step",
                "test_request_with_its_media_is_scheduled_by_the_first_step_after_it_arrives"),
    ),
    Breakage(
        name="early-admission-ignores-silence",
        guarantee="a producer that leaves a Hold unanswered gets no early admissions (no step waits on it)",
        file="ec_nixl/vllm/producers.py",
        old="""        return not asked or now - asked[0].t_asked <= SILENT_S
""",
        new="""        return True  # BROKEN: a silent producer still gets early admissions
""",
        tests=("tests/test_vllm_adapter.py",),
        expect=("test_a_silent_producer_gets_no_early_admissions",),
    ),
    Breakage(
        name="read-lands-when-posted",
        guarantee="a READ's item lands when NIXL reports the READ complete, not when it is posted",
        file="ec_nixl/read_lane.py",
        old=READ_TRACKED,
        new=READ_LANDS_AT_POST,
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
        name="publish-fails-without-waiting",
        guarantee="a full pool's publish waits (bounded) for space consumers are about to free before it fails",
        file="ec_nixl/published.py",
        old="""        if self.cfg.reserve_wait_s > 0 and self._wait_for is not None and self.releasing():
""",
        new="""        if False:  # BROKEN: never waits for space on its way back
""",
        tests=("tests/test_pool_pressure.py",),
        expect=("test_publish_waits_for_space_a_consumer_is_about_to_free",
                "test_publish_waits_a_bounded_time_then_says_what_held_the_space"),
    ),
    Breakage(
        name="waiting-hold-answered-early",
        guarantee="a Hold that may wait is answered when its items are published, not before "
                  "(the overlapped flow's PD would re-encode every item)",
        file="ec_nixl/server.py",
        old="""            if (now < deadline and not _all_ready(items)) or (answers is not None and not answers.withdraw(sid, msg.req)):
""",
        new="""            if answers is not None and not answers.withdraw(sid, msg.req):  # BROKEN: answered at the next tick, whatever its items
""",
        tests=("tests/test_expected_items.py",),
        expect=("test_a_waiting_hold_is_answered_when_the_item_is_published",
                "test_a_waiting_hold_for_an_item_never_published_answers_missing_after_its_wait"),
    ),
    Breakage(
        name="barrier-returns-on-slots",
        guarantee="the barrier hands over an item only once its ticket says it landed",
        file="ec_nixl/barrier.py",
        old="""        for t in tickets:  # (plain loops: this is the hand-over, every step pays it)
            if t.state is not _LANDED:
                self._wait_landed(tickets, timeout)
                break
        out, events = hand_over(tickets)
""",
        new="""        self.endpoint.wait_for(lambda: all(t.done or t.slot is not None for t in tickets),
                               60.0)  # BROKEN: a reserved slot is enough
        failures = {t.mm_hash: (t.error or t.reason or t.state) for t in tickets if t.state is TicketState.FAILED}
        if failures:
            raise LoadFailed(failures)
        out, events = {}, []
        for t in tickets:
            out[t.mm_hash] = t.slot.view(t.ref.desc.shape, getattr(torch, t.ref.desc.dtype))  # BROKEN: no guard
""",
        tests=("tests/test_transfer.py", "tests/test_faults_peer_death.py", "tests/test_soak.py"),
        expect=("test_barrier_returns_at_once_for_landed_items",
                "test_producer_killed_mid_transfer_hands_over_only_whole_items", "test_soak_2x2_read_and_write"),
        env=SMALL_SOAK,
    ),
    # The race, inside a real vLLM (``ec-nixl bench e2e`` as tests/e2e/test_e2e_vllm_check.py, marked
    # gpu: ``--marker gpu -k race`` on a GPU host; EC_NIXL_E2E_ON_CPU=1 on a CPU one): the gather
    # gets a slot its bytes have not reached. Caught only as wrong tokens (the test asserts token
    # identity alone here): vLLM raises nothing.
    Breakage(
        name="race-write-lands-at-ask",
        guarantee="inside vLLM, a pushed item reaches the gather only once the producer's WRITE landed "
                  "(its notification), not when the push was asked for: E's WRITE comes a round trip later",
        file="ec_nixl/write_lane.py",
        old="""            for t in batch:
                work.pushed[t.mm_hash] = t
                t.t_post = time.perf_counter()
""",
        new="""            for t in batch:
                work.pushed[t.mm_hash] = t
                t.t_post = time.perf_counter()
                t.land()  # BROKEN: landed when the push is asked for, not at the WRITE's notification
                self.loop.changed()
""",
        tests=("tests/e2e/test_e2e_vllm_check.py",),
        expect=("test_real_vllm_e2e_matches_colocated",),
        env={"EC_NIXL_E2E_MODE": "write", "EC_NIXL_E2E_ASSERT": "answers"},
    ),
    Breakage(
        name="race-read-lands-at-post",
        guarantee="inside vLLM, a pulled item reaches the gather only once NIXL reports its READ complete",
        file="ec_nixl/read_lane.py",
        old=READ_TRACKED,
        new=READ_LANDS_AT_POST,
        tests=("tests/e2e/test_e2e_vllm_check.py",),
        expect=("test_real_vllm_e2e_matches_colocated",),
        env={"EC_NIXL_E2E_MODE": "read", "EC_NIXL_E2E_ASSERT": "answers"},
    ),
    Breakage(
        name="direct-read-ignores-disconnect",
        guarantee="a held step posted on a link with an unread disconnect is never handed over",
        file="ec_nixl/read_lane.py",
        old="""        lost = self.links.unread(link)
""",
        new="""        lost = False  # BROKEN: the link's pending disconnect is not looked at
""",
        tests=("tests/test_restarts.py",),
        expect=("test_a_held_step_whose_producer_died_fails_retryable_at_once",),
    ),
)


def copy_tree(dst: str) -> None:
    """The package and its tests (with any built extension), not git, caches or the venv."""
    skip = shutil.ignore_patterns("__pycache__", ".hypothesis", ".pytest_cache", "*.pyc")
    for name in ("ec_nixl", "tests"):
        shutil.copytree(os.path.join(ROOT, name), os.path.join(dst, name), ignore=skip)
    shutil.copy(os.path.join(ROOT, "pytest.ini"), dst)


def apply(b: Breakage, root: str, write: bool = True) -> None:
    """Break ``b`` in the copy at ``root`` (``write=False``: only check that it applies there)."""
    path = os.path.join(root, b.file)
    with open(path) as f:
        src = f.read()
    n = src.count(b.old)
    if n != 1:
        raise SystemExit(f"check_guards: breakage {b.name}: its old text occurs {n} times in {b.file} "
                         f"(expected once): re-point the entry in BREAKAGES")
    if write:
        with open(path, "w") as f:
            f.write(src.replace(b.old, b.new))


def _env(root: str, env_extra: dict, marker: str) -> dict:
    """The copy first on the path (checked in ``run_tests``), then whatever the caller had there
    (e.g. wheels unpacked into a folder on a machine without the venv). CPU runs select vLLM's
    CPU platform, as scripts/test.sh does for the official vLLM wheels (which otherwise find no
    device and fail every adapter test)."""
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    cpu = {} if marker == "gpu" or "VLLM_TARGET_DEVICE" in os.environ else {"VLLM_TARGET_DEVICE": "cpu"}
    return {**os.environ, **cpu, **env_extra, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
            "PYTHONFAULTHANDLER": "1"}


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
    """One pytest process: ({test id: "passed" | "failed" | "no verdict: why"}, crashed: a reason or
    '', progress).

    ``progress`` is pytest's first line of verdict letters (it is printed before a test's
    teardown, so it still tells a test that failed or passed before the process crashed)."""
    xml = os.path.join(root, "junit.xml")
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-m", marker, "--junitxml", xml,
           "-o", "junit_family=xunit1", *tests]
    crashed, out, err = "", "", ""
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        if proc.returncode not in (0, 1, 5):
            crashed = f"pytest exit {proc.returncode}" + (f" (signal {-proc.returncode})" if proc.returncode < 0 else "")
            where = _fatal_frame(err)
            if where:
                crashed += f" in {where}"
    except subprocess.TimeoutExpired:
        crashed = f"hung: killed after {timeout:.0f}s"
    finally:
        _end_session(proc.pid)
        proc.wait(10)
    outcomes: dict[str, str] = {}
    if os.path.exists(xml):
        for case in ET.parse(xml).getroot().iter("testcase"):
            if case.find("skipped") is not None:
                continue
            node = f"{case.get('file') or case.get('classname')}::{case.get('name')}"
            verdicts = [e for e in (case.find("failure"), case.find("error")) if e is not None]
            said = " ".join(f"{e.get('message', '')} {e.text or ''}" for e in verdicts)
            outcomes[node] = ("passed" if not verdicts else "failed" if NO_VERDICT not in said
                              else f"no verdict: {_no_verdict_line(said)}")
        os.remove(xml)
    elif not crashed:
        crashed = "no test report"
    progress = (out or "").lstrip().split("\n", 1)[0].split("[", 1)[0].strip()
    return outcomes, crashed, progress


def _no_verdict_line(said: str) -> str:
    """The NO VERDICT message's own line (what stopped the run), cut to one line's length."""
    line = next((ln for ln in said.splitlines() if NO_VERDICT in ln), said)
    return line[line.index(NO_VERDICT):][:200]


def _fatal_frame(stderr: str) -> str:
    """The innermost Python frame of the crashing thread in faulthandler's dump of a crashed
    process (PYTHONFAULTHANDLER is on in ``_env``), e.g. 'loop.py:174 progress'; '' if none."""
    lines = (stderr or "").splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Current thread") and "most recent call first" in line:
            for frame in lines[i + 1:]:
                frame = frame.strip()
                if not frame.startswith("File "):
                    break
                path, _, rest = frame[5:].partition(", line ")
                return f"{os.path.basename(path.strip(chr(34)))}:{rest.replace(' in ', ' ', 1)}"
    return ""


def _collect(root: str, test: str, marker: str, env: dict) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--collect-only",
                          "-m", marker, test], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    return [line.strip() for line in out.stdout.splitlines() if "::" in line]


def run_tests(root: str, tests: tuple[str, ...], marker: str, env_extra: dict, timeout: float):
    """Run ``tests`` against the copy at ``root``: ({test id: outcome}, seconds, note).

    Outcomes: "passed", "failed" (an assertion or error, as pytest reports it), "no verdict: why"
    (the test failed saying it could not judge), or a crash:
    "crashed: why", "passed, then crashed: why", "failed, then crashed: why" (the process died
    or hung; the verdict before it, when pytest printed one). A breakage may crash pytest itself
    (e.g. a slot freed under a running DMA): then each file is run on its own, and the tests of a
    file that crashes one by one, so that every test gets an outcome of its own.
    """
    env = _env(root, env_extra, marker)
    which = subprocess.run([sys.executable, "-c", "import ec_nixl; print(ec_nixl.__file__)"], cwd=root, env=env,
                           capture_output=True, text=True, timeout=120)
    if not which.stdout.strip().startswith(root):
        raise SystemExit(f"check_guards: the copy does not import its own ec_nixl: {which.stdout}{which.stderr}")
    t0 = time.monotonic()
    outcomes, crashed, _ = _pytest(root, tests, marker, env, timeout)
    note = ""
    if crashed:
        note = f"({crashed}: ran again file by file, and test by test where a file crashed)"
        outcomes = {}
        for test in tests:
            o, c, _ = _pytest(root, (test,), marker, env, timeout)
            if not c:
                outcomes.update(o)
                continue
            for node in _collect(root, test, marker, env):
                o1, c1, progress = _pytest(root, (node,), marker, env, min(timeout, 900.0))
                if not c1:
                    outcomes.update(o1)
                    continue
                before = {"F": "failed, then ", "E": "failed, then ", ".": "passed, then "}.get(progress[:1], "")
                outcomes[node] = f"{before}crashed: {c1}"
    return outcomes, time.monotonic() - t0, note


def _end_sessions_on_term() -> None:
    """SIGTERM exits through the finally blocks (``_pytest``'s ends the test session)."""
    def exit_(signum, frame) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, exit_)


def by_assertion(outcome: str) -> bool:
    """A verdict pytest gave (a failing assertion or error), crash or not after it."""
    return outcome.startswith("failed")


def base_name(test_id: str) -> str:
    return test_id.rsplit("::", 1)[-1].split("[", 1)[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-k", default="", help="only breakages whose name contains this")
    ap.add_argument("--marker", default="not gpu", help="pytest -m expression (default: 'not gpu')")
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip the run on an unbroken copy (rows are then marked unverified)")
    ap.add_argument("--baseline", action="store_true", help=argparse.SUPPRESS)  # the default now; kept for old commands
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per breakage's test run")
    ap.add_argument("--list", action="store_true", help="print the breakages and exit")
    ap.add_argument("--check", action="store_true",
                    help="only check that every breakage still applies (its old text is found once)")
    args = ap.parse_args()
    # A `timeout` around this script (bench/gpu_vllm.sh's race rows) sends SIGTERM: exit through the
    # finally blocks, which end pytest's own session and every server it started, instead of leaving
    # them to hold their ports against the next row.
    _end_sessions_on_term()
    chosen = [b for b in BREAKAGES if args.k in b.name]
    if args.list:
        for b in chosen:
            print(f"{b.name}: {b.guarantee}\n    {b.file}; tests {' '.join(b.tests)}; expect {', '.join(b.expect)}")
        return 0
    for b in chosen:  # each against the source itself (two may break the same lines)
        apply(b, ROOT, write=False)  # exits naming a breakage whose old text is gone, before anything runs
    if args.check:
        print(f"all {len(chosen)} breakages apply")
        return 0
    if not args.no_baseline:
        # A test that fails or crashes on the unbroken copy says nothing about a breakage: refuse.
        tests = tuple(dict.fromkeys(t for b in chosen for t in b.tests))
        env = {k: v for b in chosen for k, v in b.env.items()}
        with tempfile.TemporaryDirectory(prefix="ec-nixl-guards-") as tmp:
            copy_tree(tmp)
            outcomes, seconds, note = run_tests(tmp, tests, args.marker, env, args.timeout)
        bad = {n: o for n, o in outcomes.items() if o != "passed"}
        print(f"baseline (unbroken): {len(outcomes)} tests, {len(bad)} not passed, {seconds:.0f}s {note}".rstrip(),
              flush=True)
        if not outcomes or bad:
            for n, o in sorted(bad.items()):
                print(f"    {o}: {n}")
            print("check_guards: the unbroken copy does not pass its own tests"
                  + (" (none ran)" if not outcomes else "") + ": no breakage can be judged; fix that first",
                  file=sys.stderr)
            return 2
    rows, bad_rows = [], 0
    for b in chosen:
        with tempfile.TemporaryDirectory(prefix="ec-nixl-guards-") as tmp:
            copy_tree(tmp)
            apply(b, tmp)
            outcomes, seconds, note = run_tests(tmp, b.tests, args.marker, b.env, args.timeout)
        caught = sorted(n for n, o in outcomes.items() if by_assertion(o))
        crashes = sorted(n for n, o in outcomes.items() if o != "passed" and not by_assertion(o))
        missing = [e for e in b.expect if e not in {base_name(n) for n in caught}]
        status = "CAUGHT" if caught and not missing else "NOT CAUGHT" if not caught else "CAUGHT, NOT BY ALL EXPECTED"
        if status != "CAUGHT":
            bad_rows += 1
        print(f"\n{b.name}: {status}: {len(caught)} of {len(outcomes)} tests failed on it ({seconds:.0f}s) {note}".rstrip(),
              flush=True)
        print(f"    guarantee: {b.guarantee}")
        for n in caught:
            print(f"    caught by {n}" + (f" ({outcomes[n]})" if outcomes[n] != "failed" else ""))
        for n in crashes:
            print(f"    {outcomes[n]} (not counted as caught): {n}")
        for e in missing:
            print(f"    EXPECTED BUT DID NOT CATCH: {e}")
        rows.append((b.name, caught, crashes, len(outcomes), seconds, missing))
    verified = "" if not args.no_baseline else " (no baseline run: unverified)"
    print(f"\n| breakage | caught by (failing tests){verified} | crashed or no verdict, not counted | run | s |\n|---|---|---|---|---|")
    for name, caught, crashes, ran, seconds, missing in rows:
        names = ", ".join(n.split("::", 1)[-1] for n in caught)
        miss = f" **missing: {', '.join(missing)}**" if missing else ""
        print(f"| {name} | {len(caught)}: {names or 'none'}{miss} | {len(crashes)} | {ran} | {seconds:.0f} |")
    return 1 if bad_rows else 0


if __name__ == "__main__":
    sys.exit(main())
