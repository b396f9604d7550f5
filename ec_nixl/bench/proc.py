"""Process plumbing shared by the orchestrator and the two peer processes.

The producer is driven over a ``multiprocessing`` pipe by a tiny request/reply protocol
(``(cmd, args)`` -> ``("ok", value)`` or ``("error", text)``); the consumer (or a test harness)
calls it with :func:`call`, or splits a call in :func:`send` and :func:`reply` when the producer
must keep working (serving NIXL progress) while the caller transfers.
Every child watches its parent so that no orphan survives a killed orchestrator.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
import traceback
from typing import Optional


class BenchError(RuntimeError):
    """A failure the bench explains in its message (a pool too small, a peer that cannot keep
    up): reported as that one line, without a traceback."""


def send(conn, cmd: str, *args) -> None:
    conn.send((cmd, args))


def reply(conn, cmd: str, timeout: float = 120.0):
    """The producer's answer to the last unanswered ``cmd``; its failure becomes a RuntimeError."""
    if not conn.poll(timeout):
        raise TimeoutError(f"bench producer did not answer {cmd!r} within {timeout} s")
    status, value = conn.recv()
    if status == "failed":
        raise BenchError(f"bench producer: {value}")
    if status != "ok":
        raise RuntimeError(f"bench producer command {cmd!r} failed: {value}")
    return value


def call(conn, cmd: str, *args, timeout: float = 120.0):
    send(conn, cmd, *args)
    return reply(conn, cmd, timeout)


def serve(obj, conn, idle_timeout_s: float) -> bool:
    """Answer ``call``s with ``obj``'s methods until ``close`` (True) or the other end goes away
    (False: a remote producer says so; a spawned one's consumer reports its own end)."""
    while True:
        if not conn.poll(idle_timeout_s):
            raise TimeoutError(f"producer: no command from the consumer for {idle_timeout_s} s")
        try:
            cmd, args = conn.recv()
        except EOFError:
            return False
        if cmd == "close":
            try:
                conn.send(("ok", None))
            except OSError:
                pass
            return True
        try:
            conn.send(("ok", getattr(obj, cmd)(*args)))
        except BenchError as e:
            conn.send(("failed", str(e)))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_role(role: str, cfg: dict, ctl, make, body) -> None:
    """A spawned peer's life: watch the parent, ``body(make())``, report a failure, close.

    A failure goes to the orchestrator on ``ctl`` as ``("error", text)`` (best effort: the pipe
    may be gone too); the role object is closed whatever happened.
    """
    watch_parent(cfg["parent_pid"], cfg.get("tmpdir"))
    quiet_logs()
    obj = None
    try:
        obj = make()
        body(obj)
    except BaseException as e:
        text = str(e) if isinstance(e, BenchError) else f"{role}: {type(e).__name__}: {e}\n{traceback.format_exc()}"
        try:
            ctl.send(("error", text))
        except Exception:
            pass
    finally:
        if obj is not None:
            try:
                obj.close()
            except Exception:
                pass


def watch_parent(parent_pid: int, tmpdir: Optional[str] = None) -> None:
    """Exit this child if the orchestrator dies (no orphans even after a SIGKILL of the parent)."""

    def loop():
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                if tmpdir:
                    shutil.rmtree(tmpdir, ignore_errors=True)
                os._exit(3)

    threading.Thread(target=loop, name="ec-nixl-bench-watchdog", daemon=True).start()


def quiet_logs() -> None:
    """Warnings and errors only (a peer's INFO lines would tear the table); call before nixl loads:
    nixl configures its logger at first import, from NIXL_LOG_LEVEL (the user's value wins)."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    logging.getLogger("ec_nixl").setLevel(logging.WARNING)
    logging.getLogger("nixl").setLevel(logging.WARNING)


def shm_tmpdir() -> str:
    """A private folder in /dev/shm (tmpfs) where there is one: shared sources and the file path."""
    return tempfile.mkdtemp(prefix="ec-nixl-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)


def loadavg() -> str:
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"
