"""The gateway: one OIP V2 endpoint (REST and gRPC) in front of every deployment's replicas.

It routes each request to a ready replica of the deployment named in it (power of two choices on
outstanding requests), retries on another replica when one dies before answering, and counts requests and
bytes per deployment for autoscaling and metering.
"""
