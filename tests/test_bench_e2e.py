"""``ec-nixl bench e2e --reference``: an earlier report's colocated answers stand in for a colocated
server (the GPU race rows' saving), so a report that cannot be that reference is refused before
anything starts, naming why; and the GPU race rows' vLLM args (bench/gpu_vllm.sh) survive their way
to vLLM's parser. (The run itself is tests/e2e/test_e2e_vllm_check.py.)"""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

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


def _script_value(name: str) -> str:
    """A variable of bench/gpu_vllm.sh as bash assigns it (only its own line runs)."""
    script = Path(__file__).resolve().parents[1] / "bench" / "gpu_vllm.sh"
    line = next(l for l in script.read_text().splitlines() if l.startswith(f"{name}="))
    return subprocess.run(["bash", "-c", f'{line}\nprintf %s "${name}"'], capture_output=True, text=True,
                          check=True).stdout


def test_gpu_race_rows_vllm_args_reach_vllm_intact():
    """The race rows' vLLM args are shlex-split twice on their way to the servers (the row's
    EC_NIXL_E2E_ARGS, then bench e2e's --vllm-args): a JSON value lost its quotes there and the
    H100's servers stopped at argparse. What vLLM's own parser makes of them must be the limit."""
    arg_utils = pytest.importorskip("vllm.engine.arg_utils")
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from ec_nixl.bench.vllm_e2e import parser

    eager = _script_value("EAGER_ARGS")
    row = parser().parse_args(shlex.split(f"--vllm-args='{eager}' --extra-config '{{\"announce_lease_s\": 5}}'"))
    vllm_parser = FlexibleArgumentParser()
    arg_utils.EngineArgs.add_cli_args(vllm_parser)
    got = vllm_parser.parse_args(shlex.split(row.vllm_args))
    assert got.limit_mm_per_prompt == {"image": 4, "video": 0}
    assert got.enforce_eager and got.max_model_len == 2048
