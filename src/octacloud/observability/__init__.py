"""octacloud.observability."""
