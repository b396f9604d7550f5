"""``ucx``: raw UCX tag send/recv of the same bytes through ucxx (asyncio API), when it imports.

The producer runs a ucxx listener in a thread (:func:`serve`); per operation the consumer sends
(nbytes, count) and the source offsets and receives ``count`` tag messages into its destination
buffer. A third-party path: its failure at run time never sinks the run (the consumer reports it
as skipped).
"""

from __future__ import annotations

import threading
import time

from ec_nixl.bench import optional
from ec_nixl.bench.memory import check, probe, sync
from ec_nixl.bench.paths.base import Path, Skip


class Ucx(Path):
    name = "ucx"

    def __init__(self, c, spec, per_op):
        ucxx, why = optional.load("ucxx")
        if ucxx is None:
            raise Skip(why)
        super().__init__(c, spec, per_op)
        self.chunk = 16
        if c.extras.get("ucx") is None:
            c.extras["ucx"] = _Client(c, ucxx)

    def op(self, payload) -> float:
        return self.c.extras["ucx"].fetch(self.spec.nbytes, self.per_op)


class _Client:
    def __init__(self, c, ucxx):
        import asyncio

        self.c = c
        self.loop = asyncio.new_event_loop()
        port = c.rpc("ucx_start")
        self.ep = self.loop.run_until_complete(ucxx.create_endpoint("127.0.0.1", port))

    def fetch(self, nbytes: int, count: int) -> float:
        import asyncio

        import numpy as np

        c = self.c
        pairs = [(c.src_off(nbytes), c.dst_region(nbytes)) for _ in range(count)]
        offs = np.array([so for so, _ in pairs], dtype=np.int64)

        async def go():
            await self.ep.send(np.array([nbytes, count], dtype=np.int64))
            await self.ep.send(offs)
            for _, do in pairs:
                buf = c.dst[do : do + nbytes]
                await self.ep.recv(buf if c.cuda else buf.numpy())

        t0 = time.perf_counter()
        self.loop.run_until_complete(asyncio.wait_for(go(), 60))
        sync(c.device)
        dt = time.perf_counter() - t0
        if c.src is not None:
            so, do = pairs[-1]
            check(c.dst[do : do + nbytes], probe(c.src[so : so + nbytes]), "ucx")
        return dt


def serve(src, cuda: bool) -> int:
    """Start a ucxx listener in a thread of the producer; each request (16 B: nbytes, count, then
    the offsets) is answered with ``count`` tag sends of ``nbytes`` from ``src``. Returns the port."""
    import asyncio

    import numpy as np

    ucxx, why = optional.load("ucxx")
    if ucxx is None:
        raise Skip(why)
    box: dict = {}
    ready = threading.Event()

    def run():
        async def handler(ep):
            head = np.empty(2, dtype=np.int64)
            while True:
                try:
                    await ep.recv(head)
                    n, count = int(head[0]), int(head[1])
                    if n <= 0 or count <= 0:
                        return
                    offs = np.empty(count, dtype=np.int64)
                    await ep.recv(offs)
                    for off in offs.tolist():
                        buf = src[off : off + n]
                        await ep.send(buf if cuda else buf.numpy())
                except Exception:
                    return

        async def main():
            lf = ucxx.create_listener(handler)
            box["port"] = lf.port
            ready.set()
            while True:
                await asyncio.sleep(3600)

        try:
            asyncio.run(main())
        except Exception as e:  # pragma: no cover
            box["error"] = repr(e)
            ready.set()

    threading.Thread(target=run, name="ucxx-server", daemon=True).start()
    ready.wait(60)
    if "port" not in box:
        raise RuntimeError(f"ucxx listener failed: {box.get('error', 'timeout')}")
    return box["port"]
