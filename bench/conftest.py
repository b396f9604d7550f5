"""Micro-benchmark suite support: repo on sys.path, devices, and the ours-vs-reference ratio report.

Nothing here asserts speed: each benchmark checks only that what it timed was correct, and the
ratios to the reference measured in the same run are printed at the end of the session.
"""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

torch = pytest.importorskip("torch")
pytest.importorskip("pytest_benchmark")

_RATIOS: list[str] = []


def _cuda_ok() -> bool:
    return torch.cuda.is_available()


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    if request.param == "cuda" and not _cuda_ok():
        pytest.skip("no CUDA device here (GPU micro-benchmarks run on the H200 machine)")
    if request.param == "cuda":
        torch.cuda.set_device(0)
    return request.param


@pytest.fixture
def ratio(benchmark, request):
    """``ratio(ours_s, reference_s, what)``: record ours/reference (medians) for the session summary."""

    def record(ours_s, ref_s, what: str) -> None:
        """``ref_s``: seconds, or a callable timing the reference (skipped when benchmarks are off)."""
        if callable(ref_s):
            ref_s = ref_s() if ours_s is not None else None
        if ours_s is None or ref_s is None or ref_s <= 0:
            line = f"{request.node.name}: {what}: n/a (benchmarks disabled?)"
        else:
            line = (f"{request.node.name}: ours {ours_s * 1e6:.2f} us vs {what} {ref_s * 1e6:.2f} us "
                    f"= {ours_s / ref_s:.2f}x")
            benchmark.extra_info["reference"] = what
            benchmark.extra_info["reference_median_s"] = ref_s
            benchmark.extra_info["ratio_to_reference"] = ours_s / ref_s
        _RATIOS.append(line)
        print(line)

    return record


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _RATIOS:
        terminalreporter.section("ec-nixl micro: ours vs reference (medians, same run; never asserted)")
        for line in _RATIOS:
            terminalreporter.write_line(line)
