"""Transport security: TLS for the fronts, the internal CA between hops, the internal secret replicas check."""
