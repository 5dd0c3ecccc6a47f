"""One header policy for both fronts (REST, gRPC) and both hops (client → gateway, gateway → replica).

Names are compared lower-cased: HTTP/1.1 names are case-insensitive (the REST server lower-cases them as it
reads them) and HTTP/2 names must be lower case (RFC 9113 8.2.1: octacloud's HTTP/2 server refuses a call that
names a field otherwise, on its stream). What a client sends is forwarded to a replica less
:data:`DROPPED_FROM_CLIENTS`: the credentials (the caller's key stays at the gateway) and the names only the
gateway sets (the internal secret, the verified tenant, the replica meant).

How large a header list each hop accepts comes from one table, so that whatever the gateway accepts from a
client, the replica accepts from the gateway (a replica that refused it would close the connection every
tenant's calls share):

| hop | header list accepted | checked by |
|---|---|---|
| client → gateway | ``GatewayLimits.max_header_bytes``: 64 KiB (at most :data:`CLIENT_MAX_HEADER_BYTES`) | fronts |
| gateway → replica | :data:`REPLICA_MAX_HEADER_BYTES`: 1 MiB | replica servers |

The gateway adds at most :data:`INTERNAL_HEADER_BYTES` of its own (the secret, the tenant, the replica's id);
so ``max_header_bytes`` + that stays within the replica's bound. Sizes are counted as HTTP/2 counts a header
list (RFC 9113 6.5.2: name + value + 32 per field) on gRPC, and as the bytes of the request line and header
lines on REST.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from octacloud.protocols.internal import HEADER, REPLICA_HEADER, TENANT_HEADER

INTERNAL_NAMES = frozenset({HEADER, TENANT_HEADER, REPLICA_HEADER})
"""Set by the gateway alone; a client's copy is never forwarded."""
CREDENTIALS = frozenset({"authorization", "proxy-authorization", "cookie"})
"""What authenticates a caller: checked at the gateway, never forwarded (a replica never holds a tenant's key)."""
DROPPED_FROM_CLIENTS = INTERNAL_NAMES | CREDENTIALS
_DROPPED_BYTES = frozenset(name.encode() for name in DROPPED_FROM_CLIENTS)

REPLICA_MAX_HEADER_BYTES = 2**20
"""The header list (gRPC) or request line and headers (REST) a replica accepts."""
INTERNAL_HEADER_BYTES = 4096
"""The most the gateway adds to a forwarded header list: the secret (43 bytes), a tenant (≤ 32), a replica id
(≤ 80), with HTTP/2's 32 bytes per field; the rest is room."""
CLIENT_MAX_HEADER_BYTES = REPLICA_MAX_HEADER_BYTES - INTERNAL_HEADER_BYTES
"""The largest ``max_header_bytes`` a gateway may be configured with."""
DEFAULT_CLIENT_HEADER_BYTES = 64 * 1024
HEADER_LIST_BOMB_FACTOR = 4
"""A header list that decodes past this many times its limit (HPACK references repeat a table entry for a byte
each) ends the connection: its decoding state can no longer be trusted. Up to that, an over-limit list is
refused on its stream and the connection goes on."""

Name = TypeVar("Name", str, bytes)
Value = TypeVar("Value")


def dropped(name: str | bytes) -> bool:
    """Whether a client's field of this name is kept from the replica (any case)."""
    if isinstance(name, bytes):
        return name.lower() in _DROPPED_BYTES
    return name.lower() in DROPPED_FROM_CLIENTS


def forwarded(pairs: Iterable[tuple[Name, Value]]) -> list[tuple[Name, Value]]:
    """A client's fields as a replica may see them: lower-cased names, credentials and internal names dropped."""
    return [(k.lower(), v) for k, v in pairs if not dropped(k)]


def list_size(pairs: Iterable[tuple[str | bytes, str | bytes]]) -> int:
    """A header list's size as HTTP/2 counts it (RFC 9113 6.5.2)."""
    return sum(len(k) + len(v) + 32 for k, v in pairs)


__all__ = [
    "CLIENT_MAX_HEADER_BYTES",
    "CREDENTIALS",
    "DEFAULT_CLIENT_HEADER_BYTES",
    "DROPPED_FROM_CLIENTS",
    "HEADER_LIST_BOMB_FACTOR",
    "INTERNAL_HEADER_BYTES",
    "INTERNAL_NAMES",
    "REPLICA_MAX_HEADER_BYTES",
    "dropped",
    "forwarded",
    "list_size",
]
