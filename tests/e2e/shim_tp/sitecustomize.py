"""On the PYTHONPATH of one vLLM instance of tests/e2e/test_e2e_tp.py only: a consumer (PD) whose
loads can be made to fail after admission on ONE tensor-parallel rank.

Why a shim: the late-fallback agreement (``WorkerSide._agree``: one all-reduce over vLLM's TP CPU
group, so that every rank encodes the same items) only matters when ranks disagree, and in a real
engine the ranks share every input but the network. So the fault is a network one, on one rank:
with ``EC_NIXL_E2E_FAIL_READER=r`` and ``EC_NIXL_E2E_FAIL_FLAG=PATH``, while PATH exists the worker
whose reader index is ``r`` asks for its items at the address written in PATH, where nobody
listens; the connection is refused, its load fails after admission, the other ranks load as usual.

It first runs ``../shim/sitecustomize.py`` (the e2e instances' NUMA work-around), which this file
shadows on the PYTHONPATH. Nothing is imported early: the worker module is patched when vLLM's
worker imports it.
"""

import os
import runpy

runpy.run_path(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "shim",
                            "sitecustomize.py"))

_TARGET = "ec_nixl.vllm.worker"


def _patch(worker_side: type) -> None:
    import logging

    import msgspec

    reader, flag = int(os.environ["EC_NIXL_E2E_FAIL_READER"]), os.environ["EC_NIXL_E2E_FAIL_FLAG"]
    log = logging.getLogger("ec_nixl.vllm")
    refs = worker_side._refs

    def _refs(self, specs):
        out = refs(self, specs)
        if self.place.reader != reader or not os.path.exists(flag):
            return out
        with open(flag) as f:
            dead = f.read().strip()
        log.warning("ec-nixl e2e fault: reader %d asks for %s at %s (nobody listens there)", reader,
                    [r.desc.mm_hash for r in out], dead)
        return [msgspec.structs.replace(r, producer=dead) for r in out]

    worker_side._refs = _refs


if os.environ.get("EC_NIXL_E2E_FAIL_READER") and os.environ.get("EC_NIXL_E2E_FAIL_FLAG"):
    import importlib.abc
    import importlib.util
    import sys

    class _PatchOnImport(importlib.abc.MetaPathFinder):
        """Patches ``WorkerSide`` right after its module is executed (once, then steps aside)."""

        def find_spec(self, name, path, target=None):
            if name != _TARGET:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _patch(module.WorkerSide)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _PatchOnImport())
