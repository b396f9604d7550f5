"""ec_nixl.native: pack (native and Python, byte-exact, input errors), on CPU and on CUDA."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from ec_nixl import native

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

IMPLS = [pytest.param(native.pack_python, id="python"),
         pytest.param(native.pack_native, id="native",
                      marks=pytest.mark.skipif(native.pack_native is None, reason="ec_nixl._C not built"))]

DTYPES = [torch.uint8, torch.int8, torch.float16, torch.bfloat16, torch.float32, torch.int64, torch.bool,
          torch.complex64]


def _random_case(rng: random.Random, device: str, n: int, max_elems: int, align: int):
    """n random tensors (random dtypes, some empty or 0-d) and non-overlapping offsets in a dst."""
    srcs, offsets, pos = [], [], rng.randrange(0, 64)
    for _ in range(n):
        dtype = rng.choice(DTYPES)
        k = rng.choice([0, 1, rng.randrange(1, max_elems)])
        shape = () if k == 1 and rng.random() < 0.3 else (k,)
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        t = torch.randint(0, 256, (max(k, 1) * torch.empty((), dtype=dtype).element_size(),), generator=g,
                          dtype=torch.uint8).view(dtype)[:k].reshape(shape).to(device)
        pos += rng.randrange(0, 3) * align or rng.randrange(0, 40)
        pos = (pos + align - 1) // align * align
        offsets.append(pos)
        pos += t.numel() * t.element_size()
        srcs.append(t)
    order = list(range(n))
    rng.shuffle(order)  # offsets need not follow the list order
    srcs = [srcs[i] for i in order]
    offsets = [offsets[i] for i in order]
    return srcs, offsets, pos + rng.randrange(0, 64)


def _expected(srcs, offsets, size, fill=0xAB):
    out = bytearray([fill]) * size
    for s, off in zip(srcs, offsets):
        b = s.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        out[off : off + len(b)] = b
    return bytes(out)


def _check_random(impl, device: str, seeds, max_elems: int):
    for seed in seeds:
        rng = random.Random(seed)
        align = rng.choice([1, 2, 16, 4096])
        srcs, offsets, size = _random_case(rng, device, rng.randrange(0, 90), max_elems, align)
        dst = torch.full((size,), 0xAB, dtype=torch.uint8, device=device)
        impl(srcs, dst, offsets)
        assert dst.cpu().numpy().tobytes() == _expected(srcs, offsets, size), f"seed {seed}"


# --------------------------------------------------------------------------------------------
# CPU


@pytest.mark.parametrize("impl", IMPLS)
def test_pack_random_cpu(impl):
    _check_random(impl, "cpu", range(40), 3000)


@pytest.mark.parametrize("impl", IMPLS)
def test_pack_large_and_in_place(impl):
    src = torch.randn(1369, 3584).to(torch.bfloat16)  # one 9.8 MB Qwen2.5-VL item
    dst = torch.zeros(src.numel() * 2 + 4096 + 7, dtype=torch.uint8)
    adopted = dst[7 : 7 + 64].view(torch.uint8)  # already at its destination: skipped, not corrupted
    adopted.copy_(torch.arange(64, dtype=torch.uint8))
    impl([src, adopted], dst, [4096 + 7, 7])
    assert torch.equal(dst[4096 + 7 :].clone().view(torch.bfloat16).view(1369, 3584), src)  # odd offset
    assert torch.equal(dst[7:71], torch.arange(64, dtype=torch.uint8))


@pytest.mark.skipif(native.pack_native is None, reason="ec_nixl._C not built")
def test_native_is_default_when_built():
    assert native.IMPL == "native" and native.pack_native is not None


@pytest.mark.parametrize("impl", IMPLS)
def test_pack_errors(impl):
    dst = torch.zeros(100, dtype=torch.uint8)
    src = torch.ones(10, dtype=torch.float32)  # 40 bytes
    cases = [
        (([src], torch.zeros(100, dtype=torch.int8), [0]), "dst must be uint8"),
        (([src], torch.zeros(200, dtype=torch.uint8)[::2], [0]), "dst must be contiguous"),
        (([src], dst, [0, 1]), "1 tensors but 2 offsets"),
        (([torch.ones(10, 2)[:, 0]], dst, [0]), r"srcs\[0\] is not contiguous"),
        (([src], dst, [-1]), "does not fit"),
        (([src], dst, [61]), "does not fit"),
        (([src, src], dst, [0, 39]), "overlap"),
        (([src, torch.ones(1, device="meta")], dst, [0, 50]), r"srcs\[1\] is on meta"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            impl(*args)
    impl([src, src], dst, [0, 40])  # adjacent ranges are fine
    impl([], dst, [])


def _run_py(code: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("how", ["env", "missing"])
def test_import_without_extension(how):
    """With the extension disabled or absent, native imports and pack falls back to Python."""
    hide = "import sys; sys.modules['ec_nixl._C'] = None" if how == "missing" else ""
    r = _run_py(f"""
        {hide}
        import torch
        from ec_nixl import native
        assert native.IMPL == "python" and native.pack_native is None, native.IMPL
        dst = torch.zeros(8, dtype=torch.uint8)
        native.pack([torch.tensor([1, 2], dtype=torch.int16)], dst, [3])
        assert dst.tolist() == [0, 0, 0, 1, 0, 2, 0, 0], dst.tolist()
        print("ok")
    """, {"EC_NIXL_NATIVE": "0"} if how == "env" else {})
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


@pytest.mark.skipif(native.pack_native is None, reason=f"ec_nixl._C not used here: {native.WHY_PYTHON}")
def test_extension_built_for_another_torch_is_not_used():
    """Under another torch than the one it was built against (a venv with another torch importing
    this checkout), the extension is not used: the Python fallbacks are, and WHY_PYTHON says why."""
    r = _run_py("""
        import torch
        torch.__version__ = "0.0.1+other"
        from ec_nixl import native
        assert native.IMPL == "python" and native.pack_native is None, native.IMPL
        assert "was built for torch" in native.WHY_PYTHON and "0.0.1+other" in native.WHY_PYTHON, native.WHY_PYTHON
        print("ok")
    """, {})
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


# --------------------------------------------------------------------------------------------
# GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("impl", IMPLS)
def test_pack_random_cuda(impl):
    _check_random(impl, "cuda", range(30), 300_000)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("impl", IMPLS)
def test_pack_cuda_follows_current_stream(impl):
    """pack is queued on the current stream: ordered after earlier work on it, before later work."""
    s = torch.cuda.Stream()
    srcs = [torch.full((1 << 20,), float(i), device="cuda") for i in range(70)]  # > 64: two launches
    dst = torch.zeros(70 << 22, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(20_000_000)  # keep the stream busy for a while
        for t in srcs:
            t.add_(1)
        impl(srcs, dst, [i << 22 for i in range(70)])
        out = dst.view(torch.float32).view(70, -1).clone()
    s.synchronize()
    assert torch.equal(out, torch.arange(1, 71, dtype=torch.float32, device="cuda")[:, None].expand_as(out))


