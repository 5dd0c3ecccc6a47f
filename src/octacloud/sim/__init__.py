"""octacloud.sim."""
