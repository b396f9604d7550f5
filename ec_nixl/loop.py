"""The owner loop: the one thread that may touch NIXL and the endpoint's ZMQ sockets.

NIXL agents and ZMQ sockets are not thread-safe, so one *owner* thread does all their work: the
loop's own I/O thread (``threaded=True``), or the thread that created the endpoint, which then
drives ``progress()`` itself (waits do it for it). Other threads hand work over with ``call``
(a command queue plus an eventfd that wakes the poller) and block in ``wait_for`` on a
Condition that the loop signals when a round changed something.

The loop knows nothing about items or peers: the parts of an endpoint register what they need —
sockets with their handlers, per-round pollers, timers, end-of-round flushes and idle hints —
and the loop runs them in that order every round. It never blocks longer than the shortest
idle hint asks for.
"""

from __future__ import annotations

import collections
import logging
import os
import sys
import threading
import time
from typing import Callable, Optional

import zmq

logger = logging.getLogger("ec_nixl")

IDLE_POLL_S = 0.5
"""Longest a round blocks in the poller when no part asks for sooner: an endpoint holding nothing
sleeps until a message or a command wakes it (timers then run at least this often)."""
WAIT_ROUND_S = 0.001
"""Longest an owner's ``wait_for`` blocks between two rounds."""
TICK_S = 0.002
"""Period of the timers (deadlines, heartbeats, lease expiry, pool reclaim)."""
SPARE_CPUS = 4
"""A process that may use this many CPUs or more may spin while work is expected (a posted WRITE,
a barrier waiting for its items); on a smaller host a spinning thread takes the core the peer or
ZMQ's I/O thread needs to deliver that work, and it sleeps instead."""


def has_spare_cpus() -> bool:
    return len(os.sched_getaffinity(0)) >= SPARE_CPUS


def lower_switch_interval(seconds: float) -> None:
    """Make the interpreter's GIL switch interval at most ``seconds`` (process-wide, never raised):
    an I/O thread woken by a message would otherwise wait up to 5 ms for a busy thread's GIL."""
    now = sys.getswitchinterval()
    if seconds < now:
        sys.setswitchinterval(seconds)
        logger.info("ec-nixl: GIL switch interval lowered from %.4g s to %.4g s (gil_switch_interval_s)", now,
                    sys.getswitchinterval())


def name_os_thread(name: str) -> None:
    """Give the calling thread an OS name (Linux, 15 bytes): per-thread CPU tables (``ec-nixl bench
    serve``, ``top -H``) then show the I/O thread apart from the vLLM process it runs in."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


class OwnerLoop:
    """Commands, wake-up, poller, timers and waits of one endpoint. See the module docstring."""

    def __init__(self, name: str):
        self.name = name
        self._owner = threading.get_ident()
        self._cv = threading.Condition()
        self._commands: collections.deque = collections.deque()
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._poller = zmq.Poller()
        self._poller.register(self._wake_fd, zmq.POLLIN)
        self._handlers: dict[object, Callable[[], None]] = {}
        self._rounds: list[Callable[[], None]] = []
        self._timers: list[Callable[[float], None]] = []
        self._flushes: list[Callable[[], None]] = []
        self._idle_hints: list[Callable[[], Optional[float]]] = []
        self._changed = False
        self._next_tick = 0.0
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        self.thread_error: Optional[BaseException] = None

    # --- registration (before start) -------------------------------------------------

    def add_socket(self, sock: zmq.Socket, handler: Callable[[], None]) -> None:
        """``handler()`` runs on the owner thread whenever ``sock`` is readable."""
        self._handlers[sock] = handler
        self._poller.register(sock, zmq.POLLIN)

    def remove_socket(self, sock: zmq.Socket) -> None:
        self._handlers.pop(sock, None)
        try:
            self._poller.unregister(sock)
        except KeyError:
            pass

    def close_socket(self, sock: zmq.Socket, monitor: Optional[zmq.Socket] = None) -> None:
        """Unregister ``sock`` (and its disconnect monitor) and close them, monitor first."""
        for s in (sock, monitor):
            if s is not None:
                self.remove_socket(s)
        if monitor is not None:
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
            monitor.close(0)
        sock.close(0)

    def every_round(self, fn: Callable[[], None]) -> None:
        """``fn()`` after the commands of every round (completion polls, notification drains)."""
        self._rounds.append(fn)

    def every_tick(self, fn: Callable[[float], None]) -> None:
        """``fn(now)`` every ``TICK_S`` at most (deadlines, heartbeats, expiry)."""
        self._timers.append(fn)

    def at_round_end(self, fn: Callable[[], None]) -> None:
        """``fn()`` last in every round (send what the round gathered, as one message per peer)."""
        self._flushes.append(fn)

    def idle_hint(self, fn: Callable[[], Optional[float]]) -> None:
        """``fn()`` says how soon this part needs the next round (None: no opinion)."""
        self._idle_hints.append(fn)

    def start(self, on_owner: Callable[[], None] = lambda: None, gil_switch_s: Optional[float] = None) -> None:
        """Start the I/O thread (it becomes the owner and runs ``on_owner`` first). ``gil_switch_s``:
        the most it may wait for the GIL while another thread runs Python (see
        ``EndpointConfig.gil_switch_interval_s``)."""
        if gil_switch_s is not None:
            lower_switch_interval(gil_switch_s)
        self._thread = threading.Thread(target=self._run, args=(on_owner,), name=f"ec-nixl-io-{self.name}",
                                        daemon=True)
        self._owner = -1
        self._thread.start()
        while self._owner == -1 and self._thread.is_alive():
            time.sleep(0.0005)

    # --- any thread ------------------------------------------------------------------

    @property
    def is_owner(self) -> bool:
        return threading.get_ident() == self._owner

    @property
    def threaded(self) -> bool:
        return self._thread is not None

    @property
    def closed(self) -> bool:
        return self._closed

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the owner thread (now, if we are it)."""
        self.check_alive()
        if self.is_owner:
            fn()
        else:
            self._commands.append(fn)
            os.eventfd_write(self._wake_fd, 1)

    def check_alive(self) -> None:
        if self.thread_error is not None:
            raise RuntimeError(f"ec-nixl I/O thread died: {self.thread_error!r}")

    def changed(self) -> None:
        """Something a waiter may be waiting for changed: wake waiters at the end of the round."""
        self._changed = True

    def wait_for(self, pred: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``pred()`` or ``timeout``; the owner pumps progress meanwhile."""
        deadline = time.monotonic() + timeout
        if self.is_owner:
            while not pred():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self.wait_round(min(WAIT_ROUND_S, remaining))
            return True
        with self._cv:
            while not pred():
                self.check_alive()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cv.wait(min(remaining, 0.1))
        return True

    # --- owner thread ----------------------------------------------------------------

    def progress(self, timeout: float = 0.0) -> None:
        """One round: readable sockets, commands, pollers, timers, flushes, waiter wake-up."""
        if self._closed:
            return
        try:
            events = self._poller.poll(timeout * 1000.0 if timeout >= 0.001 else 0)
        except zmq.ZMQError as e:  # pragma: no cover
            logger.warning("poll failed: %s", e)
            events = []
        if not events and 0 < timeout < 0.001:
            time.sleep(timeout)  # ZMQ polls in whole milliseconds
        for sock, _ in events:
            if sock == self._wake_fd:
                try:
                    os.eventfd_read(self._wake_fd)
                except BlockingIOError:
                    pass
            else:
                handler = self._handlers.get(sock)
                if handler is not None:
                    handler()
        while self._commands:
            fn = self._commands.popleft()
            try:
                fn()
            except Exception:
                logger.exception("ec-nixl command failed")
        for fn in self._rounds:
            fn()
        now = time.monotonic()
        if now >= self._next_tick:
            for tick in self._timers:
                tick(now)
            self._next_tick = now + TICK_S
        for fn in self._flushes:
            fn()
        if self._changed:
            self._changed = False
            with self._cv:
                self._cv.notify_all()

    def wait_round(self, limit: float) -> None:
        """One round that blocks in the poller until a message or a command arrives (a reply: at
        once), or until the parts' idle hints want a round (READs in flight: now), ``limit`` at
        most (what has no file descriptor, e.g. a NIXL notification, is seen at the next round).
        Spinning instead starved the process's own ZMQ thread on small hosts (a Hold's answer
        took 2 ms on two cores), and the peer that was to answer."""
        self.progress(min(self._idle_timeout(), limit))

    def _idle_timeout(self) -> float:
        if self._commands:
            return 0.0
        hints = [h for h in (fn() for fn in self._idle_hints) if h is not None]
        return min(hints, default=IDLE_POLL_S)

    def _run(self, on_owner: Callable[[], None]) -> None:
        self._owner = threading.get_ident()
        name_os_thread("ec-nixl-io")
        on_owner()
        try:
            while not self._closed:
                self.progress(self._idle_timeout())
        except BaseException as e:  # pragma: no cover - a bug; make it visible to waiters
            logger.exception("ec-nixl I/O thread died")
            self.thread_error = e
            with self._cv:
                self._cv.notify_all()

    def stop(self) -> None:
        """End the I/O thread (if any); the caller becomes the owner of what remains."""
        self._closed = True
        if self._thread is not None:
            os.eventfd_write(self._wake_fd, 1)
            self._thread.join(timeout=5)
        self._owner = threading.get_ident()

    def close(self) -> None:
        self._closed = True
        os.close(self._wake_fd)
