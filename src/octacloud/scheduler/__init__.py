"""octacloud.scheduler."""
