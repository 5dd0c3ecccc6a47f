"""Errors a user can cause. Each message says what was wrong and, where possible, what to do."""

from __future__ import annotations


class OctacloudError(Exception):
    """Base class of every error octacloud raises on purpose."""


class InvalidSpecError(OctacloudError, ValueError):
    """A node, request, profile or file is malformed. The message names the field and the value."""


class NotFoundError(OctacloudError, LookupError):
    """A named thing (node, model, deployment, tenant, ...) does not exist."""


class UnschedulableError(OctacloudError):
    """A request fits nowhere in the fleet, even after preemption and defragmentation were considered."""


class ConflictError(OctacloudError):
    """A name is taken (by another tenant's deployment, say): choose another (409)."""
