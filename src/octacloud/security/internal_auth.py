"""The secret that proves a request to a replica comes from its cloud's gateway (or controller).

Replicas serve on ports any process of the host (and, across machines, anything on the network between
nodes) can reach. Each cloud has one internal secret, made on first start in its state directory (mode
0600). The launcher tells each replica where it is (``OCTACLOUD_INTERNAL_SECRET_FILE``); the gateway, the
readiness prober and the telemetry scrapers send it in ``x-octacloud-internal`` (an HTTP header, gRPC
metadata); replicas refuse requests without it. The gateway strips any copy a client sends, so a tenant's
key never becomes a replica's.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from octacloud.protocols import internal
from octacloud.protocols.internal import ENV_VAR as ENV_VAR
from octacloud.protocols.internal import HEADER as HEADER
from octacloud.protocols.internal import REPLICA_HEADER as REPLICA_HEADER
from octacloud.protocols.internal import REPLICA_HEADER_BYTES as REPLICA_HEADER_BYTES
from octacloud.protocols.internal import REPLICA_ID_ENV as REPLICA_ID_ENV
from octacloud.protocols.internal import TENANT_HEADER as TENANT_HEADER

HEADER_BYTES = HEADER.encode()
TENANT_HEADER_BYTES = TENANT_HEADER.encode()
FILE_NAME = "internal.secret"
"""The secret's file in the cloud's state directory."""


def ensure_secret(path: Path) -> str:
    """The secret in ``path``, made (mode 0600, 256 random bits) on first use; an existing file is kept."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass  # another process made it first
        else:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(32) + "\n")
    return read_secret(path)


def read_secret(path: Path) -> str:
    """The secret in ``path`` (the replicas' own reader: refuses a file others may read, or a short one)."""
    return internal.read_secret(path).decode()


def secret_from_env() -> str | None:
    """The secret a launcher gave this process (None when it was started without one)."""
    path = internal.secret_file_from_env()
    return read_secret(path) if path is not None else None


def matches(secret: str, presented: str | bytes | None) -> bool:
    """Constant-time comparison of what a request presented with the secret."""
    return internal.matches(secret.encode(), presented)
