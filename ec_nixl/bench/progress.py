"""Progress of a bench run on stderr: a tqdm bar when tqdm is installed, else one line per case."""

from __future__ import annotations

import sys
import time

from ec_nixl.bench import optional


class Progress:
    def __init__(self, total: int):
        self.total, self.n = total, 0
        self.t0 = time.monotonic()
        tqdm, why = optional.load("tqdm")
        self.bar = None
        if tqdm is not None:
            self.bar = tqdm.tqdm(total=total, unit="case", dynamic_ncols=True, mininterval=0.5, file=sys.stderr)
        else:
            print(f"progress bar skipped: {why}; plain progress lines", file=sys.stderr)

    def step(self, label: str) -> None:
        if self.n >= self.total:
            self.total += 1
            if self.bar is not None:
                self.bar.total = self.total
        self.n += 1
        if self.bar is not None:
            self.bar.set_description_str(label[:40].ljust(40))
            self.bar.update(1)
        else:
            print(f"[{self.n}/{self.total} {time.monotonic() - self.t0:6.1f}s] {label}", file=sys.stderr, flush=True)

    def write(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
