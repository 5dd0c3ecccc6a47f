"""octacloud.protocols."""
