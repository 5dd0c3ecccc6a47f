"""octacloud.cluster."""
