"""The native hand-off executor (ec_nixl/handoff.py over csrc/handoff.cpp) against a real peer.

Two processes with real NIXL agents over DRAM: this one owns a thread-safe agent
(``NIXL_THREAD_SYNC_STRICT``) and the executor over it; a spawned peer owns the buffer written
into and reports the notifications it saw. Every WRITE's bytes are checked there. A failed WRITE
is a real NIXL failure (a request naming blocks outside the peer's list), not a fake.
"""

from __future__ import annotations

import glob
import multiprocessing as mp
import select
import time

import pytest

from ec_nixl import handoff

pytestmark = pytest.mark.skipif(handoff.load_library()[0] is None,
                                reason=f"native hand-off not built: {handoff.load_library()[1]}")

BLOCK, NBLOCKS = 4096, 16


def _peer(conn) -> None:
    """The consumer: a buffer of NBLOCKS blocks; answers 'notifs' (those seen since) and 'block k'."""
    import numpy as np
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    buf = torch.zeros(NBLOCKS * BLOCK, dtype=torch.uint8)
    a = nixl_agent("hx-peer", nixl_agent_config(backends=[], enable_prog_thread=False))
    a.create_backend("UCX", {})
    a.register_memory([(buf.data_ptr(), buf.numel(), 0, "")], "DRAM")
    conn.send((a.get_agent_metadata(), buf.data_ptr()))
    seen = []
    while True:
        if conn.poll(0.0005):
            msg = conn.recv()
            if msg is None:
                return
            if msg == "notifs":
                for _ in range(20):  # drain what is in flight
                    for ms in a.get_new_notifs().values():
                        seen.extend(ms)
                conn.send(seen)
                seen = []
            else:
                k = msg
                conn.send(bytes(np.asarray(buf[k * BLOCK:(k + 1) * BLOCK])))
        for ms in a.get_new_notifs().values():
            seen.extend(ms)


@pytest.fixture(scope="module")
def rig():
    import numpy as np
    import torch
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_peer, args=(child,), daemon=True)
    proc.start()
    md, base = conn.recv()
    src = (torch.arange(NBLOCKS * BLOCK) % 251).to(torch.uint8)
    a = nixl_agent("hx-owner", nixl_agent_config(backends=[], enable_prog_thread=False,
                                                 sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))
    a.create_backend("UCX", {})
    a.register_memory([(src.data_ptr(), src.numel(), 0, "")], "DRAM")
    peer = a.add_remote_agent(md)
    peer = peer.decode() if isinstance(peer, bytes) else peer

    def strided(b):
        return np.array([[b, BLOCK, 0, BLOCK, NBLOCKS]], dtype=np.uint64)

    local = a.prep_xfer_dlist("NIXL_INIT_AGENT", strided(src.data_ptr()), "DRAM")
    remote = a.prep_xfer_dlist(peer, strided(base), "DRAM")
    hx, why = handoff.NativeHandoff.attach(a, cuda=False)
    assert hx is not None, why
    yield hx, local, remote, src, conn, a
    hx.close()
    conn.send(None)
    proc.join(10)


def _until_final(hx, key, timeout=10.0) -> handoff.Outcome:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = hx.take(key)
        if out.state in ("DONE", "FAILED", "CANCELLED"):
            return out
        time.sleep(0.001)
    raise AssertionError(f"entry {key} still {out.state} after {timeout} s")


def _block(conn, k: int) -> bytes:
    conn.send(k)
    return conn.recv()


def _notifs(conn) -> list:
    conn.send("notifs")
    return conn.recv()


def _notifs_until(conn, msg: bytes, timeout: float = 5.0) -> list:
    """The peer's notifications until ``msg`` is among them (or ``timeout``), all of them."""
    deadline, got = time.monotonic() + timeout, []
    while msg not in got and time.monotonic() < deadline:
        got += _notifs(conn)
    return got


def test_armed_write_fired_by_the_publish_lands_with_its_notification(rig):
    hx, local, remote, src, conn, _ = rig
    _notifs(conn)
    hx.drain_done()
    assert hx.arm(1, remote, remote_block=5, capacity=2, notif=b"item-1")
    assert not select.select([hx.done_fd], [], [], 0)[0], "done_fd readable before anything ended"
    assert hx.fire(1, local, local_block=3, nblocks=2)
    # The owner learns that the entry ended from done_fd (its poller sleeps on it), not by polling.
    assert select.select([hx.done_fd], [], [], 10)[0], "done_fd not readable after the WRITE ended"
    hx.drain_done()
    assert not select.select([hx.done_fd], [], [], 0)[0]
    out = _until_final(hx, 1)
    assert out.state == "DONE", out
    assert out.t_fired <= out.t_posted <= out.t_done
    assert _notifs_until(conn, b"item-1") == [b"item-1"]
    for k in (0, 1):  # the peer's blocks 5-6 hold our blocks 3-4
        assert _block(conn, 5 + k) == bytes(src[(3 + k) * BLOCK:(4 + k) * BLOCK].numpy())
    assert hx.take(1).state == "UNKNOWN"  # taken once final: the key is free again
    assert hx.count() == 0


def test_a_disarmed_entry_never_writes(rig):
    hx, local, remote, _, conn, _ = rig
    before = _block(conn, 9)
    assert hx.arm(2, remote, 9, 1, b"item-2")
    assert hx.take(2).state == "ARMED"  # taken back
    assert not hx.fire(2, local, 0, 1)  # the publish finds nothing armed
    assert hx.arm(3, remote, 9, 1, b"item-3")
    assert hx.cancel(3) == "ARMED"
    assert not hx.fire(3, local, 0, 1)
    time.sleep(0.05)
    assert _block(conn, 9) == before and b"item-2" not in _notifs(conn)
    assert hx.count() == 0


def test_fire_refuses_an_item_larger_than_the_armed_slot_and_keeps_it_armed(rig):
    hx, local, remote, _, _, _ = rig
    assert hx.arm(4, remote, 0, 1, b"item-4")
    assert not hx.fire(4, local, 0, 2)
    assert hx.take(4).state == "ARMED"


def test_keys_are_unique_and_unknown_keys_are_answered(rig):
    hx, local, remote, _, _, _ = rig
    assert hx.arm(5, remote, 0, 1, b"a")
    assert not hx.arm(5, remote, 1, 1, b"b")  # in use
    assert not hx.arm(6, remote, 0, 1, b"x" * 5000)  # notification too long
    assert not hx.fire(77, local, 0, 1)
    assert hx.take(77).state == "UNKNOWN" and hx.cancel(77) == "UNKNOWN"
    assert hx.take(5).state == "ARMED"


def test_a_write_nixl_refuses_ends_failed_with_its_status(rig):
    hx, local, remote, _, conn, _ = rig
    assert hx.arm(8, remote, NBLOCKS - 1, 4, b"item-8")  # blocks past the peer's list
    assert hx.fire(8, local, 0, 2)
    out = _until_final(hx, 8)
    assert out.state == "FAILED" and out.status < 0, out
    assert b"item-8" not in _notifs(conn)
    # the executor goes on: the next WRITE lands
    assert hx.arm(9, remote, 2, 1, b"item-9") and hx.fire(9, local, 7, 1)
    assert _until_final(hx, 9).state == "DONE"


def test_many_writes_in_flight_each_land_once(rig):
    hx, local, remote, src, conn, _ = rig
    _notifs(conn)
    keys = range(100, 100 + NBLOCKS)
    for k in keys:
        assert hx.arm(k, remote, k - 100, 1, f"n{k}".encode())
    for k in reversed(keys):
        assert hx.fire(k, local, NBLOCKS - 1 - (k - 100), 1)
    assert all(_until_final(hx, k).state == "DONE" for k in keys)
    got, deadline = [], time.monotonic() + 5
    while len(got) < NBLOCKS and time.monotonic() < deadline:
        got += _notifs(conn)
    assert sorted(got) == sorted(f"n{k}".encode() for k in keys)
    for k in (0, 7, NBLOCKS - 1):
        assert _block(conn, k) == bytes(src[(NBLOCKS - 1 - k) * BLOCK:(NBLOCKS - k) * BLOCK].numpy())


def _hx_threads() -> set[str]:
    """This process's hand-off threads (the library names them ``ec-nixl-hx``)."""
    out = set()
    for comm in glob.glob("/proc/self/task/*/comm"):
        with open(comm) as f:
            if f.read().strip() == "ec-nixl-hx":
                out.add(comm.split("/")[-2])
    return out


def _on_cpu_s(tid: str) -> float:
    """Seconds thread ``tid`` of this process has run (schedstat's first field, in ns)."""
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        return int(f.read().split()[0]) * 1e-9


def test_an_expected_publish_finds_the_thread_awake_for_a_bounded_while(rig):
    """With a spin (``handoff.SPIN_S``, 20 ms where 4 CPUs or more are the process's; 50 ms set
    here on any host): a noted Hold (``expect``) or an armed push wakes the sleeping thread, which
    spins for the publish and then sleeps again; a push fired during the spin lands as any other.
    Asleep, the thread runs for nothing (it waits on a futex)."""
    _, local, remote, src, conn, a = rig
    before = _hx_threads()
    hx, why = handoff.NativeHandoff.attach(a, cuda=False, spin_us=50_000)
    assert hx is not None, why
    try:
        (tid,) = _hx_threads() - before
        time.sleep(0.1)

        def ran_within(seconds: float) -> float:
            t0 = _on_cpu_s(tid)
            time.sleep(seconds)
            return _on_cpu_s(tid) - t0

        assert ran_within(0.1) < 0.005, "an idle hand-off thread ran"
        hx.expect()
        assert ran_within(0.04) > 0.005, "the thread did not spin for an expected publish"
        time.sleep(0.03)  # the 50 ms bound is over
        assert ran_within(0.1) < 0.005, "the spin outlived its bound"
        _notifs(conn)
        assert hx.arm(40, remote, remote_block=12, capacity=1, notif=b"item-40")
        time.sleep(0.01)  # fired while the thread spins for it
        assert hx.fire(40, local, local_block=7, nblocks=1)
        out = _until_final(hx, 40)
        assert out.state == "DONE", out
        assert _block(conn, 12) == bytes(src[7 * BLOCK:8 * BLOCK].numpy())
        assert _notifs_until(conn, b"item-40") == [b"item-40"]
    finally:
        hx.close()


def test_attach_says_why_not_when_the_library_is_off(monkeypatch):
    monkeypatch.setenv("EC_NIXL_NATIVE", "0")
    hx, why = handoff.NativeHandoff.attach(object(), cuda=False)
    assert hx is None and "EC_NIXL_NATIVE=0" in why
