"""vLLM adapter: ``NixlECConnector`` and its ``vllm.general_plugins`` entry point.

Select it with ``--ec-transfer-config '{"ec_connector":"NixlECConnector","ec_role":...}'`` (the
entry point registers the name in every vLLM process), or without the plugin through
``"ec_connector_module_path":"ec_nixl.vllm"``.
"""

from __future__ import annotations

NAME = "NixlECConnector"


def register() -> None:
    """Register NixlECConnector with vLLM's factory; idempotent, imports nothing heavy."""
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    if NAME not in ECConnectorFactory._registry:
        ECConnectorFactory.register_connector(NAME, "ec_nixl.vllm.connector", NAME)


def __getattr__(name):  # the ec_connector_module_path route: getattr(module, "NixlECConnector")
    if name == NAME:
        from ec_nixl.vllm.connector import NixlECConnector

        return NixlECConnector
    raise AttributeError(name)
