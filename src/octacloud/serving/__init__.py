"""octacloud.serving."""
