"""The operator's web surfaces: the admin API, rollouts over HTTP and the dashboard."""
