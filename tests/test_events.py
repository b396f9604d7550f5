"""Encoder-cache events between real processes: a subscriber converges whatever it missed.

Each publisher runs in its own process (``event_peers.PublisherProcess``, real ZMQ sockets); the
subscriber runs here, driven by ``poll`` until a condition holds. The faults of issue 49, each
decided by the test, never by a sleep: a subscriber that starts late; a batch lost in flight
(replayed), many lost (beyond the replay buffer: a snapshot), the last one lost (the heartbeat
shows it); a publisher restart (new epoch, sequence numbers from 0); an instance that dies (a fake
clock passes its heartbeat deadline); an event storm against a small high-water mark; malformed
messages and requests. "Converged" always means: the same index as a subscriber that saw every
event, and the same as what the publisher holds.
"""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from ec_nixl.events import schema as S
from ec_nixl.events.publisher import EventPublisher, PublisherConfig
from ec_nixl.events.subscriber import Source, Subscriber, parse_source
from event_peers import PublisherProcess
from ports import free_port_block

CACHE, POOL = S.MEDIUM_CACHE, S.MEDIUM_POOL


def start_pub(**kw) -> PublisherProcess:
    port = free_port_block(2)  # PUB and replay next to each other, as the engines lay them out
    cfg = dict(endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{port + 1}",
               instance="http://pd0", mediums=[CACHE], heartbeat_s=0.2)
    cfg.update(kw)
    return PublisherProcess(**cfg)


def source(p: PublisherProcess) -> Source:
    return Source(p.endpoint, p.replay)


def items(*names: str, medium: str = CACHE) -> list[tuple]:
    return [(n, "image", 1000 + i, medium) for i, n in enumerate(names)]


def poll_until(subs, pred, timeout_s: float = 10.0) -> None:
    subs = subs if isinstance(subs, (list, tuple)) else [subs]
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"not reached in {timeout_s}s: " + "; ".join(
            f"{s.status()} {dict(s.counters)}" for s in subs)
        for s in subs:
            s.poll(0.02)


def expected(p: PublisherProcess, instance: str = "http://pd0") -> dict:
    held = p.call("held")
    return {instance: held} if any(held.values()) else {}


@pytest.fixture
def pubs():
    started: list[PublisherProcess] = []

    def make(**kw) -> PublisherProcess:
        started.append(start_pub(**kw))
        return started[-1]

    yield make
    for p in started:
        p.close()


@pytest.fixture
def subs():
    made: list[Subscriber] = []

    def make(*sources: Source, **kw) -> Subscriber:
        made.append(Subscriber(list(sources), **kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


def churn(p: PublisherProcess, rounds: int = 5) -> None:
    """Stores and removals interleaved (each call one batch)."""
    for r in range(rounds):
        p.call("store", items(*(f"r{r}-{i}" for i in range(4))))
        p.call("remove", [(f"r{r}-1", CACHE)] + ([(f"r{r - 1}-2", CACHE)] if r else []))


def test_late_subscriber_gets_the_index_of_one_that_saw_everything(pubs, subs):
    p = pubs()
    early = subs(source(p))
    poll_until(early, early.synced)
    churn(p)
    late = subs(source(p))  # after every batch: it starts from a snapshot
    poll_until([early, late], lambda: early.index.dump() == late.index.dump() == expected(p))
    assert late.counters["snapshots"] == 1 and late.counters["batches"] == 0
    assert early.counters["batches"] == 10 and early.counters["gaps"] == 0
    # and both follow what comes next
    p.call("remove", [("r4-0", CACHE)])
    poll_until([early, late], lambda: early.index.dump() == late.index.dump() == expected(p))
    assert "r4-0" not in early.index.dump()["http://pd0"][CACHE]


def test_a_lost_batch_is_replayed(pubs, subs):
    p = pubs()
    s = subs(source(p))
    poll_until(s, s.synced)
    p.call("store", items("a", "b"))
    seq = p.call("stats")["seq"]
    p.call("lose", [seq + 1])
    p.call("store", items("c"))  # lost on the wire, kept for replay
    p.call("store", items("d"))  # the gap shows here
    poll_until(s, lambda: s.index.dump() == expected(p) and s.counters["replays"] == 1)
    assert s.counters["gaps"] == 1 and s.counters["snapshots"] == 1  # (the first one only)
    assert sorted(h.instance for h in s.index.holders("c")) == ["http://pd0"]


def test_a_gap_beyond_the_replay_buffer_takes_a_snapshot(pubs, subs):
    p = pubs(buffer_batches=2)
    s = subs(source(p))
    poll_until(s, s.synced)
    seq = p.call("stats")["seq"]
    p.call("lose", list(range(seq + 1, seq + 6)))
    for i in range(5):
        p.call("store", items(f"x{i}"))
    p.call("remove", [("x0", CACHE)])  # seen: a gap of 5, only 2 batches still buffered
    poll_until(s, lambda: s.index.dump() == expected(p) and s.counters["snapshots"] == 2)
    assert s.counters["replays_short"] == 1


def test_the_heartbeat_shows_a_lost_last_batch(pubs, subs):
    p = pubs()
    s = subs(source(p))
    poll_until(s, s.synced)
    seq = p.call("stats")["seq"]
    p.call("lose", [seq + 1])
    p.call("store", items("only"))  # nothing follows it but heartbeats
    poll_until(s, lambda: s.index.dump() == expected(p))
    assert s.counters["gaps"] >= 1 and s.counters["replays"] == 1


def test_a_restarted_publisher_replaces_its_entries(pubs, subs):
    p = pubs()
    s = subs(source(p))
    p.call("store", items("old1", "old2", "kept"))
    poll_until(s, lambda: s.index.dump() == expected(p))
    endpoint, replay = p.endpoint, p.replay
    p.kill()
    q = pubs(endpoint=endpoint, replay_endpoint=replay)  # same ports, new epoch, seq from 0
    q.call("store", items("kept", "new"))
    poll_until(s, lambda: s.index.dump() == expected(q))
    assert s.counters["resets"] == 1
    assert not s.index.holders("old1") and [h.instance for h in s.index.holders("new")] == ["http://pd0"]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_dead_instance_is_dropped_after_its_heartbeat_deadline(pubs, subs):
    a, b = pubs(instance="http://e0", mediums=[POOL]), pubs(instance="http://pd1")
    clock = FakeClock()
    s = subs(source(a), source(b), dead_after_s=3.0, clock=clock)
    a.call("store", items("img", medium=POOL))
    b.call("store", items("img", "other"))
    poll_until(s, lambda: s.synced() and len(s.index) == 3)
    heard = s.counters["messages"]
    a.kill()
    clock.now += 2.5  # not yet past the deadline: b's heartbeats refresh b, nothing refreshes a
    poll_until(s, lambda: s.counters["messages"] >= heard + 2)
    s.tick()
    assert {h.instance for h in s.index.holders("img")} == {"http://e0", "http://pd1"}
    clock.now += 1.0  # a: 3.5 s silent; b: heard 1 s ago at most once its next heartbeat is in
    heard = s.counters["messages"]
    poll_until(s, lambda: s.counters["messages"] >= heard + 2)
    s.tick()
    assert [h.instance for h in s.index.holders("img")] == ["http://pd1"]
    assert s.counters["sources_lost"] == 1 and s.index.dump() == expected(b, "http://pd1")
    # the instance comes back: heard again, it is asked for a snapshot
    a2 = pubs(instance="http://e0", mediums=[POOL], endpoint=a.endpoint, replay_endpoint=a.replay)
    a2.call("store", items("back", medium=POOL))
    poll_until(s, lambda: [h.instance for h in s.index.holders("back")] == ["http://e0"])
    assert not [h for h in s.index.holders("img") if h.instance == "http://e0"]


def test_an_event_storm_is_bounded_by_the_high_water_mark(pubs, subs):
    p = pubs(hwm=4, buffer_batches=8)
    s = subs(source(p), rcvhwm=4)
    poll_until(s, s.synced)
    # Recorded changes to the same items coalesce: memory for the items, not for the changes.
    for _ in range(3):
        assert p.call("record", items(*(f"k{i}" for i in range(200)))) <= 200
    p.call("flush")
    # Then a storm of distinct batches while the subscriber reads nothing: ZMQ drops at the
    # high-water marks (the publisher never waits), and the subscriber recovers by snapshot.
    for r in range(300):
        p.call("store" if r % 2 == 0 else "remove",
               [(f"s{r // 2}-{i}", "image", 4096, CACHE) for i in range(64)] if r % 2 == 0
               else [(f"s{r // 2}-{i}", CACHE) for i in range(0, 64, 2)])
    published = p.call("stats")["batches"]
    poll_until(s, lambda: s.index.dump() == expected(p) and s.synced(), timeout_s=30)
    assert s.counters["batches"] < published - 1, "nothing was dropped: the storm did not reach the high-water mark"
    assert s.counters["gaps"] >= 1 and s.counters["snapshots"] >= 2


def test_malformed_messages_and_requests_are_refused_and_nothing_else_changes(pubs, subs):
    p = pubs()
    ctx = zmq.Context.instance()
    rogue = ctx.socket(zmq.PUB)
    rogue.setsockopt(zmq.LINGER, 0)
    port = rogue.bind_to_random_port("tcp://127.0.0.1")
    rogue_src = Source(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port}")  # (no replay socket there)
    s = subs(source(p), rogue_src)
    p.call("store", items("good"))
    poll_until(s, lambda: s.index.dump() == expected(p))
    ok = S.encode(S.EncoderEventBatch(1.0, [S.EncoderItemStored("evil", "image", 1, CACHE)], None, "http://x", "e"))
    bad = [
        [b"ec-nixl", S.seq_bytes(0)],  # two frames
        [b"ec-nixl", b"\x00\x01", ok],  # short sequence number
        [b"ec-nixl", S.seq_bytes(0), b"\xc1not msgpack"],
        [b"ec-nixl", S.seq_bytes(0), msgspec.msgpack.encode({"ts": 1})],  # wrong shape
        [b"ec-nixl", S.seq_bytes(0), S.encode(S.EncoderEventBatch(1.0, [S.EncoderItemStored("h", "image", -5, CACHE)],
                                                                   None, "http://x", "e"))],
        [b"ec-nixl", S.seq_bytes(0), S.encode(S.EncoderEventBatch(1.0, [S.EncoderItemStored("h" * 300, "image", 1,
                                                                                            CACHE)], None, "x", "e"))],
    ]
    for _ in range(50):  # the SUB connection comes up at its own pace: send until they are seen
        for frames in bad:
            rogue.send_multipart(frames)
        s.poll(0.05)
        if s.counters["bad_messages"] >= len(bad):
            break
    assert s.counters["bad_messages"] >= len(bad)
    assert s.index.dump() == expected(p) and not s.index.holders("evil")
    # the publisher's replay socket answers a bad request with an error it names, and keeps serving
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(p.replay)
    dealer.send_multipart([b"", b"give me everything"])
    assert dealer.poll(5000)
    reply = dealer.recv_multipart()
    assert reply[:3] == [b"", b"", S.END_SEQ] and b"8-byte start sequence number" in reply[3]
    dealer.close()
    rogue.close()
    p.call("store", items("after"))
    poll_until(s, lambda: s.index.dump() == expected(p))
    assert p.call("stats")["bad_requests"] == 1


def test_vllm_replay_protocol_and_batch_type_read_the_stream(pubs):
    """What an existing vLLM KV-events subscriber does, unchanged: SUB + 8-byte replay request,
    decoding each payload with vLLM's own (generic) ``EventBatch``."""
    pytest.importorskip("vllm", reason="vLLM is the reference reader here")
    from vllm.distributed.kv_events import EventBatch

    p = pubs()
    p.call("store", items("a", "b"))
    p.call("remove", [("a", CACHE)])
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(p.replay)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    got = []
    while True:
        assert dealer.poll(5000)
        _, topic, seq, payload = dealer.recv_multipart()
        if seq == S.END_SEQ:
            break
        assert topic == b"ec-nixl"
        got.append((int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload, type=EventBatch)))
    dealer.close()
    assert [s for s, _ in got] == [0, 1, 2]
    assert [e["type"] for _, b in got for e in b.events] == ["EncoderItemsCleared", "EncoderItemStored",
                                                             "EncoderItemStored", "EncoderItemRemoved"]


def test_parse_source_and_config_errors():
    assert parse_source("host:7000") == Source("tcp://host:7000", "tcp://host:7001")
    with pytest.raises(Exception, match="not tcp://host:port"):
        parse_source("tcp://host")
    with pytest.raises(Exception, match="at least one medium"):
        EventPublisher(PublisherConfig("tcp://127.0.0.1:0", None, "i", ()))
    with pytest.raises(Exception, match="cannot bind"):
        EventPublisher(PublisherConfig("nonsense://x", None, "i", (CACHE,)))


def _ec_nixl(*args: str, timeout: float = 60.0):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "ec_nixl.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_ec_nixl_events_dumps_the_merged_index_and_follows_changes(pubs):
    import json
    import subprocess
    import sys

    a, b = pubs(instance="http://e0", mediums=[POOL]), pubs(instance="http://pd0")
    a.call("store", items("x", "y", medium=POOL))
    b.call("store", items("y"))
    out = _ec_nixl("events", "--dump", a.endpoint, b.endpoint.removeprefix("tcp://"))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"http://e0": {POOL: ["x", "y"]}, "http://pd0": {CACHE: ["y"]}}
    # follow: the snapshot, then each change as a line
    follow = subprocess.Popen([sys.executable, "-m", "ec_nixl.cli", "events", "--max-events", "2", b.endpoint],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = follow.stdout.readline()
        assert "snapshot at seq" in first and "1 item(s) of http://pd0" in first, first
        b.call("store", items("z"))
        b.call("remove", [("y", CACHE)])
        rest, err = follow.communicate(timeout=30)
    finally:
        follow.kill()
    assert follow.returncode == 0, err
    assert [ln.split(" ", 2)[2] for ln in rest.splitlines()] == ["encoder_cache + z (image, 1000 B)", "encoder_cache - y"]


def test_ec_nixl_events_names_publishers_it_cannot_reach():
    out = _ec_nixl("events", "--dump", "--timeout", "0.5", "tcp://127.0.0.1:9")
    assert out.returncode == 1 and "not in sync after 0.5s: tcp://127.0.0.1:9" in out.stderr
    out = _ec_nixl("events", "nonsense")
    assert out.returncode == 2 and "is not tcp://host:port" in out.stderr
