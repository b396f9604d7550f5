"""Fault injection for ``ec-nixl bench e2e`` (``ec_nixl.bench.vllm_e2e``): on the PYTHONPATH of
the PD instance only, never in a deployment.

``EC_NIXL_FAULT_CORRUPT_VISION=1``: the Qwen2-VL / Qwen2.5-VL vision tower of this process
returns its embeddings negated (``embed_multimodal``, which both of vLLM's model runners call to
encode). A PD that encodes any image itself then answers differently from a colocated server, so
answers equal to the colocated server's prove that every image reached the PD's gather from its
encoder instance, through the connector. Patched when vLLM imports the model module (an import
hook: nothing of vLLM is imported here). Then the next ``sitecustomize`` on the path runs.
"""

import importlib.abc
import os
import sys

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


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _MODELS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                break
        else:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _corrupt(getattr(module, _MODELS[name]))

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("EC_NIXL_FAULT_CORRUPT_VISION") == "1":
    sys.meta_path.insert(0, _PatchOnImport())
