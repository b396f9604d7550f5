"""What every path is to the consumer's case loop: a source of timed samples, chunk by chunk.

A path is built per case (path x item size x items per step) on the consumer. The case loop asks
for ``samples(k)``: ``k`` operations, each timed on the consumer's clock (or, for a producer-side
stage or a producer-initiated transfer, on the producer's: see each path), each checked for the
right bytes. ``chunk`` bounds ``k`` so that a chunk's items fit in the pools at once; landed
steps are kept in a ring (distinct destination slots) and released one step per operation.
"""

from __future__ import annotations

from collections import deque

from ec_nixl.bench.units import BLOCK, PROBE_BYTES, ItemSpec, blocks


class Skip(Exception):
    """This path cannot run here; the message is the one-line reason printed instead of a row."""


class Path:
    name = "?"

    def __init__(self, c, spec: ItemSpec, per_op: int):
        self.c, self.spec, self.per_op = c, spec, per_op
        cap = c.cfg["pool_bytes"] - PROBE_BYTES - BLOCK
        fit = max(1, cap // (blocks(spec.nbytes) * BLOCK * per_op))
        self.chunk = max(1, min(16, fit))
        self.ring_depth = max(0, min(16, fit - 1))  # landed steps kept before release: distinct slots
        self.ring: deque = deque()
        self.tag = f"{self.name}-{spec.label}-{per_op}"

    def spec_tuple(self) -> tuple:
        return (self.spec.nbytes, self.spec.shape, self.spec.dtype)

    def samples(self, k: int) -> list[float]:
        """Seconds of ``k`` operations, in order (the first ones of a case are the warm-up)."""
        return [self.op(p) for p in self.prepare(k)]

    def prepare(self, k: int) -> list:
        """Untimed set-up of ``k`` operations (the producer publishes, the consumer holds)."""
        return [None] * k

    def op(self, payload) -> float:
        raise NotImplementedError

    def finish(self) -> None:
        while self.ring:
            for t in self.ring.popleft():
                t.release()

    def keep(self, tickets) -> None:
        self.ring.append(tickets)
        while len(self.ring) > self.ring_depth:
            for t in self.ring.popleft():
                t.release()
