"""pack: the native extension vs the per-tensor Python fallback, on the device at hand.

    pytest bench/test_native_bench.py               # CPU here; CUDA where torch sees a GPU
    pytest bench/test_native_bench.py --benchmark-disable   # a smoke run (each case once)

Prints native/python median ratios at the end; asserts correctness only, never speed (the H200
numbers come from bench/probes/waitvalue.py).
"""

from __future__ import annotations

import pytest
import torch

from ec_nixl import native

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (items, bytes per item): a step of small items (launch-bound) and of 9.8 MB Qwen2.5-VL items
# (copy-bound; fewer on CPU to keep the run short).
ITEM_9_8MB = 1369 * 3584 * 2  # one 1024x1024 image's bf16 embeddings
N_BIG = 32 if DEVICE == "cuda" else 8
CASES = {"32x64KiB": (32, 64 << 10), f"{N_BIG}x9.8MB": (N_BIG, ITEM_9_8MB)}
IMPLS = {"python": native.pack_python, "native": native.pack_native}
_medians: dict[tuple[str, str], float] = {}


def _step(n: int, nbytes: int):
    srcs = [torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=DEVICE) for _ in range(n)]
    offsets = [i * (nbytes + 4096 - nbytes % 4096) for i in range(n)]  # page-aligned slots
    dst = torch.zeros(offsets[-1] + nbytes, dtype=torch.uint8, device=DEVICE)
    return srcs, dst, offsets


@pytest.fixture(scope="module", autouse=True)
def _report(request):
    yield
    tr = request.config.pluginmanager.get_plugin("terminalreporter")
    lines = []
    for case in CASES:
        py, nat = _medians.get((case, "python")), _medians.get((case, "native"))
        if py and nat:
            lines.append(f"pack {case} on {DEVICE}: native {nat * 1e6:.1f} us, python {py * 1e6:.1f} us, "
                         f"python/native = {py / nat:.2f}x")
    capman = request.config.pluginmanager.get_plugin("capturemanager")
    if tr is not None and capman is not None and lines:
        with capman.global_and_fixture_disabled():  # teardown output is captured otherwise
            tr.write_line("")
            for line in lines:
                tr.write_line(line)


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("case", list(CASES))
def test_pack_bench(benchmark, case, impl):
    fn = IMPLS[impl]
    if fn is None:
        pytest.skip("ec_nixl._C not built")
    srcs, dst, offsets = _step(*CASES[case])
    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)

    def run():
        fn(srcs, dst, offsets)
        sync()  # time the copies, not just their launch

    benchmark.extra_info.update(device=DEVICE, impl=native.IMPL if impl == "native" else "python")
    benchmark.pedantic(run, rounds=20, iterations=1, warmup_rounds=2)
    if benchmark.stats is not None:  # None under --benchmark-disable
        _medians[(case, impl)] = benchmark.stats.stats.median
    for s, off in zip(srcs[:2] + srcs[-1:], offsets[:2] + offsets[-1:]):
        assert torch.equal(dst[off : off + s.numel()], s)
