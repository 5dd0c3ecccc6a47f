"""octacloud.metering."""
