"""``ec-nixl bench e2e --reference``: an earlier report's colocated answers stand in for a colocated
server (the GPU race rows' saving), so a report that cannot be that reference is refused before
anything starts, naming why. (The run itself is tests/e2e/test_e2e_vllm_check.py.)"""

from __future__ import annotations

import json

import pytest

from ec_nixl.bench.vllm_e2e import _reference, requests_plan


def _report(path, model: str, answered: int):
    requests = [{"i": i, "colocated": [100 + i, 7]} for i in range(answered)]
    path.write_text(json.dumps({"info": {"model": model}, "requests": requests}))
    return path


def test_reference_gives_each_request_its_colocated_answer(tmp_path):
    n = len(requests_plan("/m"))
    want = _reference(_report(tmp_path / "r.json", "/m", n), "/m")
    assert [want(i, body) for i, (_, body) in enumerate(requests_plan("/m"))] == [[100 + i, 7] for i in range(n)]


@pytest.mark.parametrize("model, answered, says", [
    ("/other", None, "answered model '/m', this run serves '/other'"),
    ("/m", 3, "colocated answers for 3 of the"),
])
def test_reference_that_cannot_stand_in_is_refused(tmp_path, model, answered, says):
    n = len(requests_plan("/m"))
    path = _report(tmp_path / "r.json", "/m", n if answered is None else answered)
    with pytest.raises(ValueError, match=says):
        _reference(path, model)
