"""octacloud.scheduler.framework."""
