"""octacloud.scheduler.plugins."""
