"""The bench's control channel between two hosts: framed msgpack over one TCP connection.

On one host the consumer drives the producer over a ``multiprocessing`` pipe; across hosts the same
``(cmd, args)`` -> ``("ok", value)`` exchange (``proc.call``, ``proc.serve``) goes over a
:class:`Channel`, which has the pipe's interface (``send``, ``recv``, ``poll``, ``fileno``,
``close``), so the commands, the paths and the raw-NIXL rendezvous are the same code in both
modes. Nothing is pickled (the producer listens on a network): a frame is a 4-byte length and a
msgpack document of plain data; tuples and ``ItemDesc`` travel as msgpack extensions so that
what arrives compares equal to what was sent (the probes are tuples, ``items`` returns
descriptors). Frames over ``MAX_FRAME`` are refused.
"""

from __future__ import annotations

import select
import socket
import struct
from typing import Any, Optional

import msgspec

from ec_nixl import protocol as P

MAX_FRAME = 64 << 20
_HEAD = struct.Struct("!I")
_TUPLE, _DESC = 1, 2


def _pack(v: Any) -> Any:
    if isinstance(v, tuple):
        return msgspec.msgpack.Ext(_TUPLE, _ENC.encode([_pack(x) for x in v]))
    if isinstance(v, list):
        return [_pack(x) for x in v]
    if isinstance(v, dict):
        return {k: _pack(x) for k, x in v.items()}
    if isinstance(v, P.ItemDesc):
        return msgspec.msgpack.Ext(_DESC, _ENC.encode(v))
    return v


def _enc_hook(v: Any) -> Any:
    if isinstance(v, str):  # a subclass (torch.__version__)
        return str(v)
    if hasattr(v, "item") and hasattr(v, "dtype"):  # a numpy scalar
        return v.item()
    raise TypeError(f"the bench's control channel does not carry {type(v).__name__}")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code == _TUPLE:
        return tuple(_DEC.decode(data))
    if code == _DESC:
        return msgspec.msgpack.decode(data, type=P.ItemDesc)
    raise ValueError(f"unknown extension {code} on the bench's control channel")


_ENC = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_DEC = msgspec.msgpack.Decoder(ext_hook=_ext_hook)


def encode(v: Any) -> bytes:
    return _ENC.encode(_pack(v))


def decode(data: bytes) -> Any:
    return _DEC.decode(data)


class Channel:
    """One TCP connection with a multiprocessing ``Connection``'s interface (blocking, one user)."""

    def __init__(self, sock: socket.socket):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(True)
        self.sock = sock
        self.peer = "%s:%s" % sock.getpeername()[:2]
        self._buf = bytearray()

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, obj: Any) -> None:
        data = encode(obj)
        if len(data) > MAX_FRAME:
            raise ValueError(f"bench control message of {len(data)} B is over {MAX_FRAME} B")
        self.sock.sendall(_HEAD.pack(len(data)) + data)

    def poll(self, timeout: Optional[float] = 0.0) -> bool:
        """True when something can be read now (a frame, or the end: ``recv`` then raises EOFError)."""
        if self._buf:
            return True
        r, _, _ = select.select([self.sock], [], [], timeout)
        return bool(r)

    def recv(self) -> Any:
        (n,) = _HEAD.unpack(self._read(_HEAD.size))
        if n > MAX_FRAME:
            raise EOFError(f"bench control peer {self.peer} sent a frame of {n} B (over {MAX_FRAME} B)")
        return decode(self._read(n))

    def _read(self, n: int) -> bytes:
        while len(self._buf) < n:
            try:
                chunk = self.sock.recv(max(n - len(self._buf), 1 << 16))
            except OSError as e:  # reset by a peer that died: the end, as a pipe would say
                raise EOFError(f"bench control peer {self.peer}: {e}") from None
            if not chunk:
                raise EOFError(f"bench control peer {self.peer} closed the connection")
            self._buf += chunk
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
