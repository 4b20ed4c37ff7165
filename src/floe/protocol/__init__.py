"""The protocol shared by client and server: operation records (ops.py), the wire format
(wire.py, codecs.py) and the errors that cross it (errors.py). Neither client/ nor server/
imports the other; both import this package."""

from floe.protocol.errors import RemoteError, RemoteUnavailable, WireError
from floe.protocol.ops import OPS, Op, get_op

__all__ = ["OPS", "Op", "RemoteError", "RemoteUnavailable", "WireError", "get_op"]
