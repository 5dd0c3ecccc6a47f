"""gRPC front end: Triton's GRPCInferenceService over the DataPlane."""

from octacloud.protocols.grpc.servicer import InferenceServicer, add_to_server

__all__ = ["InferenceServicer", "add_to_server"]
