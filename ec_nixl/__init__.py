"""ec-nixl: move multimodal encoder outputs between vLLM instances with NIXL, zero-copy.

The core (this package) imports without vLLM. Follow one encoder output through it:

    endpoint.publish()   producer pins the tensor in the registered pool     (pool, arena)
    Endpoint.hold/load   consumer asks for it over the control plane          (protocol, endpoint)
    Transport.post       one prepped NIXL READ or WRITE moves the bytes       (transport)
    LoadBarrier.wait     nothing reaches compute before its bytes landed      (barrier)

The vLLM connector lives in ``ec_nixl.vllm`` and is loaded only by vLLM.
"""

from ec_nixl._version import __version__
from ec_nixl.config import EndpointConfig
from ec_nixl.errors import (
    ConfigError,
    ECNixlError,
    IncompatiblePeer,
    ItemTooLarge,
    LoadFailed,
    PoolExhausted,
    ProtocolError,
    TransferFailed,
    Unauthorized,
    UnknownPeer,
)

__all__ = [
    "__version__",
    "EndpointConfig",
    "Endpoint",
    "ItemRef",
    "LoadBarrier",
    "LoadTicket",
    "ConfigError",
    "ECNixlError",
    "IncompatiblePeer",
    "ItemTooLarge",
    "LoadFailed",
    "PoolExhausted",
    "ProtocolError",
    "TransferFailed",
    "Unauthorized",
    "UnknownPeer",
]


def __getattr__(name):  # lazy: importing ec_nixl must not import torch/zmq/nixl
    if name in ("Endpoint", "ItemRef", "LoadTicket"):
        from ec_nixl import endpoint

        return getattr(endpoint, name)
    if name == "LoadBarrier":
        from ec_nixl.barrier import LoadBarrier

        return LoadBarrier
    raise AttributeError(name)
