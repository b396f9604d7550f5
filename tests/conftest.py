"""Shared fixtures: the device under test, consumer endpoints, producer processes.

Every data-plane test runs on DRAM (always) and on VRAM (``gpu`` marker, only where CUDA and a
NIXL build with CUDA are present). GPU tests are skipped by design on CPU-only machines.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

torch = pytest.importorskip("torch")


def _cuda_ok() -> bool:
    return torch.cuda.is_available()


DEVICES = ["cpu"] + (["cuda"] if _cuda_ok() else [])


def pytest_collection_modifyitems(config, items):
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("device") == "cuda":
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    if request.param == "cuda" and not _cuda_ok():
        pytest.skip("no CUDA device here (GPU tests run on the H200 machine)")
    return request.param


def _closed_at_teardown(create):
    """A factory fixture's body: hand out ``create(n, *args, **kw)`` (n counts the objects made),
    then close every one of them at teardown."""
    made = []

    def make(*args, **kw):
        obj = create(len(made), *args, **kw)
        made.append(obj)
        return obj

    yield make
    for obj in made:
        obj.close()


@pytest.fixture
def make_consumer(device):
    """Factory for consumer endpoints in this process, their pools poisoned (closed at teardown)."""
    from ec_nixl.config import EndpointConfig
    from ec_nixl.endpoint import Endpoint

    def create(n, **kw):
        kw.setdefault("name", f"consumer-{n}-{os.getpid()}")
        kw.setdefault("device", device)
        kw.setdefault("pool_bytes", 256 << 20)
        kw.setdefault("threaded", False)
        ep = Endpoint(EndpointConfig(**kw))
        if ep.pool is not None:
            ep.pool.arena.bytes.fill_(0xAB)  # poison: an early hand-over would show
        return ep

    yield from _closed_at_teardown(create)


@pytest.fixture
def make_peer(device):
    """Factory for peer processes: ``make_peer(cls=ProducerProcess, **cfg)``; a ``ConsumerProcess``
    where a consumer must die or run beside others. Pools default to 16 MiB (the fault tests move
    a few small items). Closed, or killed, at teardown."""
    from peers import ProducerProcess

    def create(n, cls=ProducerProcess, **kw):
        kw.setdefault("device", device)
        kw.setdefault("pool_bytes", 16 << 20)
        return cls(**kw)

    yield from _closed_at_teardown(create)


@pytest.fixture
def make_producer(make_peer):
    """Factory for producer processes with 256 MiB pools (closed, or killed, at teardown)."""
    from peers import ProducerProcess

    def make(**kw):
        kw.setdefault("pool_bytes", 256 << 20)
        return make_peer(ProducerProcess, **kw)

    return make
