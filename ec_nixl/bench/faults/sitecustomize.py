"""Fault injection for ``ec-nixl bench e2e`` (``ec_nixl.bench.vllm_e2e``): on the PYTHONPATH of
the PD instance only, never in a deployment.

``EC_NIXL_FAULT_CORRUPT_VISION=1``: the Qwen2-VL / Qwen2.5-VL vision tower of this process
returns its embeddings negated (``embed_multimodal``, which both of vLLM's model runners call to
encode). A PD that encodes any image itself then answers differently from a colocated server, so
answers equal to the colocated server's prove that every image reached the PD's gather from its
encoder instance, through the connector.

``EC_NIXL_FAULT_DELAY_PUSH_MS=N`` (on E's path): E posts each WRITE a consumer asks for (``Push``)
N ms after it was asked, not at once: a slow transfer on purpose, so that a consumer handing an
item over before its WRITE landed (a broken load barrier, ``scripts/check_guards.py``'s race rows)
gathers bytes that are not there yet. With the barrier in place it only costs time.

Both are patched when the module is imported (an import hook: nothing of vLLM or ec_nixl is
imported here). Then the next ``sitecustomize`` on the path runs.
"""

import importlib.abc
import os
import sys
import time

_here = os.path.dirname(os.path.abspath(__file__))
for _p in sys.path:
    _f = os.path.join(_p or ".", "sitecustomize.py")
    if os.path.abspath(_p or ".") != _here and os.path.isfile(_f):
        exec(compile(open(_f).read(), _f, "exec"))
        break

_MODELS = {"vllm.model_executor.models.qwen2_vl": "Qwen2VLForConditionalGeneration",
           "vllm.model_executor.models.qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}


def _corrupt(cls) -> None:
    inner = cls.embed_multimodal

    def embed_multimodal(self, **kwargs):
        out = inner(self, **kwargs)
        return type(out)(-t for t in out) if isinstance(out, (list, tuple)) else -out

    cls.embed_multimodal = embed_multimodal
    print(f"ec-nixl fault: {cls.__name__}.embed_multimodal returns negated embeddings (EC_NIXL_FAULT_CORRUPT_VISION)",
          file=sys.stderr, flush=True)


def _delay_pushes(module, delay_s: float) -> None:
    """``Pusher.poll`` leaves a queued push alone until ``delay_s`` after ``Pusher.add`` got it
    (the loop polls queued pushes every ms: ``Pusher._idle_hint``)."""
    cls = module.Pusher
    add, poll = cls.add, cls.poll
    asked: dict = {}

    def delayed_add(self, pushes):
        now = time.monotonic()
        for _, push in pushes:
            asked[id(push)] = (push, now)
        return add(self, pushes)

    def delayed_poll(self):
        now = time.monotonic()
        young = [(it, p) for it, p in self._active
                 if id(p) in asked and asked[id(p)][1] + delay_s > now and p.xfer is None]
        if young:
            keep = {id(p) for _, p in young}
            self._active = [(it, p) for it, p in self._active if id(p) not in keep]
        try:
            poll(self)
        finally:
            self._active.extend(young)
            for k in [k for k, (p, t) in asked.items() if t + delay_s <= now and p.xfer is not None]:
                del asked[k]

    cls.add, cls.poll = delayed_add, delayed_poll
    print(f"ec-nixl fault: E posts each pushed WRITE {delay_s * 1e3:.0f} ms after it was asked "
          f"(EC_NIXL_FAULT_DELAY_PUSH_MS)", file=sys.stderr, flush=True)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs ``patches[name](module)`` right after ``name`` is first imported."""

    def __init__(self, patches):
        self.patches = patches

    def find_spec(self, name, path, target=None):
        if name not in self.patches:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                break
        else:
            return None
        run, patch = spec.loader.exec_module, self.patches[name]

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


_patches = {}
if os.environ.get("EC_NIXL_FAULT_CORRUPT_VISION") == "1":
    _patches.update({name: (lambda m, c=cls: _corrupt(getattr(m, c))) for name, cls in _MODELS.items()})
if float(os.environ.get("EC_NIXL_FAULT_DELAY_PUSH_MS") or 0) > 0:
    _patches["ec_nixl.pusher"] = lambda m: _delay_pushes(m, float(os.environ["EC_NIXL_FAULT_DELAY_PUSH_MS"]) / 1e3)
if _patches:
    sys.meta_path.insert(0, _PatchOnImport(_patches))
