"""Wire adapters over the DataPlane: Open Inference Protocol (KServe V2) over REST and gRPC, as Triton
speaks it. :class:`ReplicaServer` runs both, plus the metrics endpoint, in one process."""

from octacloud.protocols.server import ReplicaServer, ServerSettings

__all__ = ["ReplicaServer", "ServerSettings"]
