"""Sizes, percentiles and number formatting shared by every part of the bench.

Plain functions on plain values (no torch, no NIXL), so the command can parse its arguments and
the report can format rows without importing what the two peer processes need.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SCHEMA = "ec-nixl-bench/1"
QWEN_ROWS, QWEN_WIDTH = 1369, 3584  # Qwen2.5-VL-7B, one 1024x1024 image: 9.8 MB in bf16
BLOCK = 64 << 10  # pool block of every bench endpoint
PROBE_BYTES = 1 << 20  # the blocks an endpoint reserves for its link probes
DEFAULT_SIZES = "64K,1M,9.8M,64M"
QUICK_SIZES = "64K,1M,9.8M"
CPU_GOAL_SIZE = "16M"  # issue 12: 16 MiB across processes vs a single-threaded memcpy


@dataclass(frozen=True)
class ItemSpec:
    nbytes: int
    shape: tuple
    dtype: str  # torch dtype name; every item is bf16 (an encoder output)
    label: str


def parse_size(tok: str) -> ItemSpec:
    """'64K' / '1M' / '64M' (binary units), '9.8M' or 'qwen' (1369x3584 bf16), 'RxW' (bf16), '4096'."""
    t = tok.strip()
    low = t.lower().removesuffix("b")
    if low in ("9.8m", "qwen"):
        n = QWEN_ROWS * QWEN_WIDTH * 2
        return ItemSpec(n, (QWEN_ROWS, QWEN_WIDTH), "bfloat16", "9.8MB")
    if "x" in low:
        r, _, w = low.partition("x")
        rows, width = int(r), int(w)
        if rows <= 0 or width <= 0:
            raise ValueError(f"bad size {tok!r}")
        return ItemSpec(rows * width * 2, (rows, width), "bfloat16", f"{rows}x{width}")
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(low[-1:], 1)
    num = low[:-1] if mult != 1 else low
    try:
        n = int(round(float(num) * mult))
    except ValueError:
        raise ValueError(f"bad size {tok!r}: use e.g. 64K, 1M, 9.8M, 64M, 1369x3584 or a byte count") from None
    if n < 2 or n % 2:
        raise ValueError(f"bad size {tok!r}: need an even number of bytes >= 2 (bf16 items)")
    return ItemSpec(n, (n // 2,), "bfloat16", human(n))


def human(n: float) -> str:
    n = int(n)
    if n >= 1 << 30 and n % (1 << 30) == 0:
        return f"{n >> 30}GiB"
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}MiB"
    if n >= 1 << 10 and n % (1 << 10) == 0:
        return f"{n >> 10}KiB"
    if n >= 1e9:
        return f"{n / 1e9:.2f}GB"
    if n >= 1e6:
        return f"{n / 1e6:.1f}MB"
    return f"{n}B"


def blocks(n: int, block: int = BLOCK) -> int:
    return max(1, -(-n // block))


def page_round(n: int) -> int:
    """``n`` rounded up to 4 KiB: the stride of rotating regions in the source and destination."""
    return -(-n // 4096) * 4096


def pctl(xs: list, q: float) -> float:
    """Percentile with linear interpolation (numpy's default), without numpy."""
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q / 100.0
    f = math.floor(k)
    c = min(f + 1, len(s) - 1)
    return s[f] + (s[c] - s[f]) * (k - f)


def fmt_us(us: float) -> str:
    """Microseconds with 3-4 significant digits: '18.2 us', '2.39 ms', '12.3 ms', '154 ms'."""
    if us != us:
        return "-"
    for floor, fmt in ((100_000, "{:.0f} ms"), (10_000, "{:.1f} ms"), (1000, "{:.2f} ms")):
        if us >= floor:
            return fmt.format(us / 1000)
    return f"{us:.1f} us"
