"""Client API and transports (in-process, HTTP)."""

from floe.client.client import AsyncClient, Client
from floe.client.connect import connect, connect_async

__all__ = ["AsyncClient", "Client", "connect", "connect_async"]
