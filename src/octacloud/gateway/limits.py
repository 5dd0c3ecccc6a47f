"""What the gateway bounds, and the defaults (docs/security.md lists them; ``octacloud up`` can change them).

Every bound is checked as early as the information exists: the connection count when a connection arrives,
the header time before a request is routed, the key and the announced body size on the headers (before one
byte of the body is read), the body time while it is read, the gRPC message size by gRPC itself from the
message's length prefix, and the deployment's requests in flight before a replica is asked.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields, replace

from octacloud.core.errors import InvalidSpecError
from octacloud.protocols.asgi import DEFAULT_MAX_BODY_BYTES
from octacloud.protocols.headers import CLIENT_MAX_HEADER_BYTES, DEFAULT_CLIENT_HEADER_BYTES

MIB = 2**20
MIN_WORKER_RSS_MIB = 256
"""The smallest ``worker_max_rss_mib``: a worker that has just started uses about 100 MiB."""
__all__ = ["DEFAULT_MAX_BODY_BYTES", "MIB", "MIN_WORKER_RSS_MIB", "GatewayLimits"]
# DEFAULT_MAX_BODY_BYTES: the largest request body replicas accept (``octacloud serve --max-body-mb``'s
# default); more is refused at the gateway from its Content-Length, so it never buffers what no replica takes.


@dataclass(frozen=True, slots=True)
class GatewayLimits:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    """Largest REST request body; 413 when Content-Length says more (before reading) or the body grows past it."""
    max_message_bytes: int = DEFAULT_MAX_BODY_BYTES + MIB
    """Largest gRPC message received (the body limit plus room for the message's own fields)."""
    max_header_bytes: int = DEFAULT_CLIENT_HEADER_BYTES
    """A request's line and headers together (REST: 431 and the connection closed beyond it), or a call's header
    list as HTTP/2 counts it (gRPC: RESOURCE_EXHAUSTED on that call's stream). At most
    ``protocols.headers.CLIENT_MAX_HEADER_BYTES``, so that what the gateway forwards a replica accepts."""
    header_timeout_s: float = 10.0
    """From a connection's start (or the end of its previous answer) to the end of the request's headers."""
    body_timeout_s: float = 60.0
    """From the end of the headers to the end of the body; 408 after it."""
    keep_alive_s: float = 5.0
    """An idle keep-alive connection is closed after this long."""
    max_connections: int = 10_000
    """Open client connections (REST); one more is closed at once. Keep it below the process's file limit."""
    max_concurrent_rpcs: int = 4_096
    """gRPC calls in progress; more are refused with RESOURCE_EXHAUSTED by gRPC itself."""
    grpc_unfinished_bytes_per_connection: int = DEFAULT_MAX_BODY_BYTES + 2 * MIB
    """What one gRPC connection's calls may hold before their message completes (metadata and partial messages,
    ``protocols.grpc.h2_limits``); a call past it is RESOURCE_EXHAUSTED and its stream reset. At least one
    largest message and header list."""
    grpc_unfinished_bytes_per_tenant: int = 2 * (DEFAULT_MAX_BODY_BYTES + 2 * MIB)
    """The same over all of one tenant's connections (a caller without a key is held to its connection's budget
    alone, so that one anonymous client cannot use up what other callers without a key would share)."""
    grpc_unfinished_calls_per_tenant: int = 1_024
    """One tenant's gRPC calls whose message has not completed; more are RESOURCE_EXHAUSTED (a caller without a key:
    at most its connection's 256 streams)."""
    upstream_timeout_s: float = 60.0
    """How long the gateway waits for a replica's answer to one request (REST and gRPC); 504 / DEADLINE_EXCEEDED
    after it, and the replica counts one transport failure. Raise it for models that answer slowly."""
    max_inflight_per_replica: int = 8
    """Requests one deployment may have in flight per ready replica; more are refused at once with 503 and
    ``Retry-After`` (load shedding), so the queue at the replicas, and the latency of what is admitted, stay
    bounded. 0: no bound. 8 keeps admitted p99 within 2× of the unloaded p99 under overload where 16 did not
    (bench/overload.py, docs/security.md); raise it for models whose throughput needs larger batches."""
    worker_max_rss_mib: int = 4_096
    """Resident memory a gateway worker process may use (``octacloud up --gateway-workers N``, N ≥ 1); one that
    uses more is killed and restarted by the main process, whose controller keeps running. At least
    :data:`MIN_WORKER_RSS_MIB`."""

    def __post_init__(self) -> None:
        for name in (
            "max_body_bytes",
            "max_message_bytes",
            "max_header_bytes",
            "max_connections",
            "max_concurrent_rpcs",
            "grpc_unfinished_bytes_per_connection",
            "grpc_unfinished_bytes_per_tenant",
            "grpc_unfinished_calls_per_tenant",
        ):
            if getattr(self, name) <= 0:
                raise InvalidSpecError(f"gateway limit {name} must be positive, got {getattr(self, name)}")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s", "upstream_timeout_s"):
            if not getattr(self, name) > 0:
                raise InvalidSpecError(f"gateway limit {name} must be a positive number of seconds")
        if self.max_header_bytes > CLIENT_MAX_HEADER_BYTES:
            raise InvalidSpecError(
                f"gateway limit max_header_bytes is at most {CLIENT_MAX_HEADER_BYTES} (what replicas accept, less "
                f"what the gateway adds), got {self.max_header_bytes}"
            )
        one_call = self.max_message_bytes + 5 + self.max_header_bytes
        for name in ("grpc_unfinished_bytes_per_connection", "grpc_unfinished_bytes_per_tenant"):
            if getattr(self, name) < one_call:
                raise InvalidSpecError(
                    f"gateway limit {name} must hold one call of the largest message and header list "
                    f"({one_call} bytes), got {getattr(self, name)}"
                )
        if self.worker_max_rss_mib < MIN_WORKER_RSS_MIB:
            raise InvalidSpecError(
                f"gateway limit worker_max_rss_mib must be at least {MIN_WORKER_RSS_MIB}, got {self.worker_max_rss_mib}"
            )
        if self.max_inflight_per_replica < 0:
            raise InvalidSpecError("gateway limit max_inflight_per_replica must be 0 (no bound) or positive")

    @classmethod
    def parse(cls, items: Iterable[str]) -> GatewayLimits:
        """Defaults changed by ``NAME=VALUE`` items (``octacloud up --limit max_inflight_per_replica=32``)."""
        kinds = {f.name: f.type for f in fields(cls)}
        changes: dict[str, int | float] = {}
        for item in items:
            name, sep, text = item.partition("=")
            name = name.strip().replace("-", "_")
            if not sep or name not in kinds:
                raise InvalidSpecError(f"--limit takes NAME=VALUE with NAME one of {', '.join(kinds)}; got {item!r}")
            try:
                changes[name] = float(text) if kinds[name] in (float, "float") else int(text)
            except ValueError:
                raise InvalidSpecError(f"--limit {name} needs a number, got {text!r}") from None
        return replace(cls(), **changes)  # type: ignore[arg-type]
