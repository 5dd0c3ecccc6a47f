"""Deployments (what the operator wants) and replicas (what runs), as plain values.

A deployment asks for a model served by ``min_replicas``..``max_replicas`` replicas, each on ``octants``
octants of one card (or ``auto``: sized from the model's profile and the target load). The controller turns
deployments into replicas through the scheduler.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field

from octacloud.core.errors import InvalidSpecError
from octacloud.core.units import OCTANTS_PER_GPU

_NAME = re.compile(r"^[a-z0-9]([a-z0-9_.-]{0,61}[a-z0-9])?$")


class ReplicaState(enum.Enum):
    PENDING = "pending"  # wants a slice; none placed yet
    STARTING = "starting"  # process launched, not ready
    READY = "ready"
    FAILED = "failed"  # died; will be restarted with back-off
    STOPPING = "stopping"


@dataclass(frozen=True, slots=True)
class DeploymentSpec:
    """What the operator asked for. ``octants`` None means auto-sized."""

    name: str
    model: str
    version: str = ""
    """Model version to serve ('' = the repository's policy, normally the latest)."""
    octants: int | None = 1
    """Octants per replica; up to 8 (one card) or a multiple of 8 (whole cards); None = auto."""
    min_replicas: int = 1
    max_replicas: int = 1
    target_qps: float | None = None
    slo_ms: float | None = None
    priority: int = 0
    """Scheduling priority (who preempts whom); set from ``priority_class`` for tenants."""
    priority_class: str = ""
    """The priority class the priority came from ('' = none: priority 0, or an admin's raw priority)."""
    tenant: str = "default"
    published: bool = False

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise InvalidSpecError(
                f"deployment name {self.name!r} must be 1-63 lowercase letters, digits, '-', '_' or '.', "
                "starting and ending with a letter or digit"
            )
        if not self.model:
            raise InvalidSpecError(f"deployment {self.name!r}: model must not be empty")
        if self.octants is not None:
            if self.octants < 1:
                raise InvalidSpecError(f"deployment {self.name!r}: octants must be >= 1, got {self.octants}")
            if self.octants > OCTANTS_PER_GPU and self.octants % OCTANTS_PER_GPU:
                raise InvalidSpecError(
                    f"deployment {self.name!r}: more than one card must be whole cards "
                    f"(a multiple of {OCTANTS_PER_GPU} octants), got {self.octants}"
                )
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise InvalidSpecError(
                f"deployment {self.name!r}: need 0 <= min_replicas <= max_replicas, "
                f"got {self.min_replicas}..{self.max_replicas}"
            )
        if self.max_replicas > 256:
            raise InvalidSpecError(f"deployment {self.name!r}: max_replicas is at most 256, got {self.max_replicas}")
        for what in ("target_qps", "slo_ms"):
            value = getattr(self, what)
            if value is not None and value <= 0:
                raise InvalidSpecError(f"deployment {self.name!r}: {what} must be > 0, got {value}")


@dataclass(slots=True)
class Deployment:
    """A deployment as stored: the spec plus what the controller decided about it."""

    spec: DeploymentSpec
    replicas: int
    """Desired replica count now (between min and max; the autoscaler moves it)."""
    octants: int
    """Resolved octants per replica (auto-sizing done)."""
    created_at: float = 0.0
    generation: int = 1

    def template(self) -> tuple[str, str, int]:
        """What each replica runs: model, version, octants (a change is rolled out replica by replica)."""
        return (self.spec.model, self.spec.version, self.octants)


@dataclass(slots=True)
class Replica:
    """One running (or wanted) copy of a deployment, on a slice of the fleet."""

    id: str
    deployment: str
    node: str = ""
    gpus: tuple[int, ...] = ()
    milli_per_gpu: int = 0
    state: ReplicaState = ReplicaState.PENDING
    handle: str = ""
    """The launcher's name for the running replica ('' when none runs): a PID locally, an actor on Ray."""
    pid: int | None = None
    """The replica's process id on its node, once known (for operators; the handle is what counts)."""
    host: str = ""
    """The address its endpoints listen on, once known."""
    http_port: int | None = None
    grpc_port: int | None = None
    metrics_port: int | None = None
    restarts: int = 0
    started_at: float = 0.0
    last_ready_at: float = 0.0
    """Wall-clock time it last became READY (0: never): what ``rollout status`` shows as "ready since"."""
    message: str = ""
    env: dict[str, str] = field(default_factory=dict)
    model: str = ""
    """What it serves: the model, version and octants of the deployment's spec when it was created. A replica
    whose template differs from its deployment's is replaced by a rolling update ('' / 0: the deployment's)."""
    version: str = ""
    octants: int = 0
    revision: int = 0
    """The deployment revision its template comes from (0: from before revisions were recorded)."""
    failover: bool = False
    """It replaces work lost to a node or card failure: it may use the failover headroom."""
    replaces: str = ""
    """A surge replica: the replica it replaces (a move or a rolling update) once READY ('' for none)."""
    after: list[str] = field(default_factory=list)
    """Replicas that still occupy its slice: it is launched only once they have stopped (make-before-break)."""

    @property
    def placed(self) -> bool:
        return bool(self.node)

    def template(self) -> tuple[str, str, int]:
        return (self.model, self.version, self.octants)
