"""``ec-nixl bench e2e`` as a test: real vLLM E -> PD on this host against a colocated server, the
PD's vision tower corrupted (``ec_nixl.bench.vllm_e2e`` says what each check proves).

Marked ``gpu``: it is the GPU's end-to-end test (VRAM pools, NIXL over CUDA IPC, vLLM's GPU model
runner), and what ``scripts/check_guards.py --marker gpu -k race`` runs against a copy whose load
barrier is broken. On a CPU host the other tests of this folder cover the same path (and more),
so it skips there by design; ``EC_NIXL_E2E_ON_CPU=1`` runs it on the CPU anyway (how the race rows
were checked before a GPU was lent). ``EC_NIXL_E2E_ARGS`` adds ``ec-nixl bench e2e`` options
(shell words), ``EC_NIXL_E2E_MODE`` forces the PD's link mode (``read``: the PD pulls; ``write``:
E pushes), as the race rows do. ``EC_NIXL_E2E_ASSERT`` names the checks that must pass (the start
of their names, comma-separated; default: all): the race rows assert token identity alone, so a
row counts as caught only by wrong answers, never by a counter the broken copy also upsets.
A run narrowed so that stops before making those checks (a server that never came up) fails
with NO VERDICT, which the guard script does not count as catching. ``EC_NIXL_E2E_REPORT`` keeps
the run's report there (JSON).
"""

from __future__ import annotations

import json
import os
import shlex

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.e2e, pytest.mark.timeout(1500)]


def test_real_vllm_e2e_matches_colocated(tmp_path) -> None:
    if not torch.cuda.is_available() and os.environ.get("EC_NIXL_E2E_ON_CPU") != "1":
        pytest.skip("the GPU's end-to-end test (EC_NIXL_E2E_ON_CPU=1 runs it on the CPU)")
    from ec_nixl.bench.vllm_e2e import Report, parser, run

    argv = ["--out", str(tmp_path), "--json", str(tmp_path / "report.json"),
            *shlex.split(os.environ.get("EC_NIXL_E2E_ARGS", ""))]
    mode = os.environ.get("EC_NIXL_E2E_MODE")
    if mode:
        argv += ["--extra-config", json.dumps({"mode": mode})]
    rep, error = Report(), None
    try:
        run(parser().parse_args(argv), rep)
    except Exception as e:  # judged below: a run that stopped may still have made its checks
        error = e
    finally:
        print(json.dumps([vars(c) for c in rep.checks], indent=1, default=str))
        if os.environ.get("EC_NIXL_E2E_REPORT"):
            with open(os.environ["EC_NIXL_E2E_REPORT"], "w") as f:
                json.dump(rep.as_dict(), f, indent=1, default=str)
    only = [w.strip() for w in os.environ.get("EC_NIXL_E2E_ASSERT", "").split(",") if w.strip()]
    failed = rep.verdict(only, error)  # raises NoVerdict where a narrowed run made none of its checks
    assert not failed, "failed checks:\n" + "\n".join(failed)
    if error is not None and not only:
        raise error
