"""The PD scheduler's record of vLLM encoder-cache entries that hold a failed load's placeholder
(``ec_nixl/vllm/poisoned.py``), on its own: what each later request of such an item may do, and
that the record lets go of what it no longer needs. (With vLLM's scheduler and MRv2's gather:
tests/test_vllm_mrv2.py, ``test_failed_loads_placeholder_never_reaches_a_later_request``.)"""

from __future__ import annotations

from types import SimpleNamespace as NS

from ec_nixl.vllm.metadata import NixlECWorkerMeta
from ec_nixl.vllm.poisoned import _WATCH_STEPS, PoisonedEntries


def feature(h: str, offset: int = 4, length: int = 6, media: bool = True):
    return NS(identifier=h, mm_position=NS(offset=offset, length=length), media=media)


def request(rid: str, *features, computed: int = 0):
    return NS(request_id=rid, mm_features=list(features), num_computed_tokens=computed)


def step_output(scheduled: dict[str, int], freed=()):
    return NS(num_scheduled_tokens=scheduled, scheduled_encoder_inputs={}, free_encoder_mm_hashes=list(freed))


def entries(may_encode: bool = True) -> PoisonedEntries:
    return PoisonedEntries(lambda f: f.media, may_encode)


def test_a_sharer_that_gathered_fails_one_that_did_not_is_left_to_its_turn():
    p, unavailable = entries(), set()
    loader, sharer, later = request("a", feature("h")), request("b", feature("h")), request("c", feature("h", offset=50))
    for r in (loader, sharer, later):
        assert p.admits(r, 0, unavailable)
    p.before_step(step_output({"a": 10, "b": 10, "c": 10}), ["h"], 1)
    loader.num_computed_tokens = sharer.num_computed_tokens = later.num_computed_tokens = 10
    doomed = p.reported(NixlECWorkerMeta(failed=[(0, "a", "h", "MISSING")]))
    assert doomed == {"b"}, "c has not reached the item's placeholder yet"
    assert p and p.admits(later, 10, unavailable), "c carries the pixels: queued to encode it again"
    out = step_output({"c": 40})
    assert p.before_step(out, [], 2) == ["h"] and out.scheduled_encoder_inputs == {"c": [0]}
    assert not p, "the entry is right again after that step"


def test_a_request_without_media_waits_for_a_queued_encode_else_fails():
    p, unavailable = entries(), set()
    p.admits(request("a", feature("h", media=False)), 0, unavailable)
    p.before_step(step_output({"a": 10}), ["h"], 1)
    p.reported(NixlECWorkerMeta(failed=[(0, "a", "h", "MISSING")]))
    bare = request("m", feature("h", media=False))
    assert not p.admits(bare, 0, unavailable) and unavailable == {"m"}, "nothing can make it right: fails"
    unavailable.clear()
    assert p.admits(request("w", feature("h")), 0, unavailable)
    assert not p.admits(request("m2", feature("h", media=False)), 0, unavailable) and not unavailable, "waits"
    p.before_step(step_output({"w": 10}), [], 2)
    assert p.admits(request("m2", feature("h", media=False)), 0, unavailable) and not unavailable


def test_without_local_encodes_every_later_request_of_it_fails_until_vllm_frees_it():
    p, unavailable = entries(may_encode=False), set()
    p.admits(request("a", feature("h")), 0, unavailable)
    p.before_step(step_output({"a": 10}), ["h"], 1)
    p.reported(NixlECWorkerMeta(failed=[(0, "a", "h", "MISSING")]))
    assert not p.admits(request("b", feature("h")), 0, unavailable) and unavailable == {"b"}
    p.before_step(step_output({}, freed=["h"]), [], 2)
    assert not p and p.admits(request("c", feature("h")), 0, set())


def test_the_record_lets_go_of_finished_requests_and_unreported_loads():
    p = entries()
    p.admits(request("a", feature("h"), feature("k")), 0, set())
    p.before_step(step_output({"a": 10}), ["h", "k"], 1)
    p.reported(NixlECWorkerMeta(loaded=[(0, "h")]))
    for step in range(2, _WATCH_STEPS + 3):
        p.before_step(step_output({}), [], step)
    p.finished("a")
    assert (p._live, p._users, p._watch, p._reencode) == ({}, {}, {}, {})
