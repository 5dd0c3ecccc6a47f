"""octacloud.scheduler.actions."""
