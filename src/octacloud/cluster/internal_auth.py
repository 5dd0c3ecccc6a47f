"""The secret that proves a request to a replica comes from its cloud's gateway (or controller).

Replicas serve on ports any process of the host (and, across machines, anything on the network between
nodes) can reach. Each cloud has one internal secret, made on first start in its state directory (mode
0600). The launcher tells each replica where it is (``OCTACLOUD_INTERNAL_SECRET_FILE``); the gateway, the
readiness prober and the telemetry scrapers send it in ``x-octacloud-internal`` (an HTTP header, gRPC
metadata); replicas refuse requests without it. The gateway strips any copy a client sends, so a tenant's
key never becomes a replica's.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

from octacloud.core.errors import InvalidSpecError

ENV_VAR = "OCTACLOUD_INTERNAL_SECRET_FILE"
"""Environment variable naming the file that holds the secret (read by replicas at start)."""
HEADER = "x-octacloud-internal"
"""HTTP header and gRPC metadata key (lower case, as gRPC requires) carrying the secret."""
HEADER_BYTES = HEADER.encode()
FILE_NAME = "internal.secret"


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
    """The secret in ``path``; refuses a file others may read, or one too short to be a secret."""
    mode = path.stat().st_mode
    if mode & 0o077:
        raise InvalidSpecError(f"internal secret {path} is readable by others (mode {mode & 0o777:o}); chmod 600 it")
    secret = path.read_text().strip()
    if len(secret) < 32:
        raise InvalidSpecError(f"internal secret {path} is shorter than 32 characters")
    return secret


def secret_from_env() -> str | None:
    """The secret a launcher gave this process (None when it was started without one)."""
    name = os.environ.get(ENV_VAR)
    return read_secret(Path(name)) if name else None


def matches(secret: str, presented: str | bytes | None) -> bool:
    """Constant-time comparison of what a request presented with the secret."""
    if presented is None:
        return False
    value = presented.encode("latin-1") if isinstance(presented, str) else presented
    return hmac.compare_digest(value, secret.encode())
