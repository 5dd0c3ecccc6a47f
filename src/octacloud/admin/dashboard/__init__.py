"""The operator's web dashboard (static page + JSON API) and the cloud's ``/metrics`` endpoint."""

from octacloud.admin.dashboard.app import Authorize, allow_all, build_dashboard_app, build_metrics_app
from octacloud.admin.dashboard.state import dashboard_state

__all__ = ["Authorize", "allow_all", "build_dashboard_app", "build_metrics_app", "dashboard_state"]
