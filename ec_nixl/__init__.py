"""ec-nixl: move multimodal encoder outputs between vLLM instances with NIXL, zero-copy.

The core (this package) imports without vLLM. Follow one encoder output through it:

    Endpoint.publish     producer pins the tensor in the registered pool     (published, pool, arena)
    Endpoint.hold/load   consumer asks for it over the control plane          (links, loader, server)
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
    "HoldRequest",
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


_LAZY = {  # name -> the module that defines it
    "Endpoint": "ec_nixl.endpoint",
    "ItemRef": "ec_nixl.tickets",
    "LoadTicket": "ec_nixl.tickets",
    "HoldRequest": "ec_nixl.queries",
    "LoadBarrier": "ec_nixl.barrier",
}


def __getattr__(name):  # lazy: importing ec_nixl must not import torch/zmq/nixl
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(module), name)
