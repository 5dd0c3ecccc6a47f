"""Deployments (what the operator wants) and replicas (what runs), as plain values.

A deployment asks for a model served by ``min_replicas``..``max_replicas`` replicas, each on ``octants``
octants of one card (or ``auto``: sized from the model's profile and the target load). The controller turns
deployments into replicas through the scheduler.
"""

from __future__ import annotations

import enum
import re
import uuid
from dataclasses import dataclass, field

from octacloud.core import fields
from octacloud.core.errors import InvalidSpecError
from octacloud.core.fields import CLASS_NAME, CLASS_RULE, PRIORITY_RANGE, TENANT_NAME, TENANT_RULE
from octacloud.core.model import SPREAD_MODES, SPREAD_SOFT, Placement
from octacloud.core.units import OCTANTS_PER_GPU

_NAME = re.compile(r"[a-z0-9]([a-z0-9_.-]{0,61}[a-z0-9])?")
NAME_RULE = "1-63 lowercase letters, digits, '-', '_' or '.', starting and ending with a letter or digit"
_MODEL = re.compile(r"[^./\\\x00-\x1f\x7f][^/\\\x00-\x1f\x7f]{0,254}")
MODEL_RULE = "the name of a model of the repository: its folder's name, without '/' or control characters"
_VERSION = re.compile(r"([0-9]{1,18})?")
VERSION_RULE = 'a version number as a string of digits (such as "2"), or "" for the latest'
MAX_OCTANTS = 64 * OCTANTS_PER_GPU
"""The most octants one replica may ask for (64 whole cards)."""
MAX_REPLICAS = 256
MAX_TARGET_QPS = 1e9
MAX_SLO_MS = 3_600_000.0


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
    spread: str = SPREAD_SOFT
    """How far apart its replicas are kept (``soft``, or hard: ``node``, ``rack``); see ``Request.spread``."""

    def __post_init__(self) -> None:
        """Every field by type and range (a record that fails never reaches the store or the loop)."""
        fields.name(self.name, "deployment name", _NAME, NAME_RULE)
        where = f"deployment {self.name!r}"
        if not isinstance(self.model, str) or not self.model:
            raise InvalidSpecError(f"{where}: model must not be empty")
        fields.name(self.model, f"{where}: model", _MODEL, MODEL_RULE)
        fields.name(self.version, f"{where}: version", _VERSION, VERSION_RULE)
        if self.octants is not None:
            if isinstance(self.octants, int) and not isinstance(self.octants, bool) and self.octants < 1:
                raise InvalidSpecError(f"{where}: octants must be >= 1 (or auto), got {self.octants}")
            fields.whole(self.octants, f"{where}: octants", 1, MAX_OCTANTS)
            if self.octants > OCTANTS_PER_GPU and self.octants % OCTANTS_PER_GPU:
                raise InvalidSpecError(
                    f"{where}: more than one card must be whole cards "
                    f"(a multiple of {OCTANTS_PER_GPU} octants), got {self.octants}"
                )
        fields.whole(self.min_replicas, f"{where}: min_replicas", 0, MAX_REPLICAS)
        fields.whole(self.max_replicas, f"{where}: max_replicas", 0, MAX_REPLICAS)
        if self.min_replicas > self.max_replicas:
            raise InvalidSpecError(
                f"{where}: need 0 <= min_replicas <= max_replicas, got {self.min_replicas}..{self.max_replicas}"
            )
        if self.target_qps is not None:
            fields.number(self.target_qps, f"{where}: target_qps", MAX_TARGET_QPS)
        if self.slo_ms is not None:
            fields.number(self.slo_ms, f"{where}: slo_ms", MAX_SLO_MS)
        fields.whole(self.priority, f"{where}: priority", *PRIORITY_RANGE)
        if self.priority_class != "":
            fields.name(self.priority_class, f"{where}: priority_class", CLASS_NAME, CLASS_RULE)
        fields.name(self.tenant, f"{where}: tenant", TENANT_NAME, TENANT_RULE)
        fields.flag(self.published, f"{where}: published")
        if self.spread not in SPREAD_MODES:
            raise InvalidSpecError(
                f"{where}: spread must be one of {list(SPREAD_MODES)}, got {fields.shown(self.spread)}"
            )


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

    def __post_init__(self) -> None:
        """The controller's fields by type and range (a stored record that fails is set aside, not run)."""
        where = f"deployment {self.spec.name!r}"
        fields.whole(self.replicas, f"{where}: replicas", 0, MAX_REPLICAS)
        fields.whole(self.octants, f"{where}: octants", 1, MAX_OCTANTS)
        fields.whole(self.generation, f"{where}: generation", 0, 2**62)
        fields.number(self.created_at, f"{where}: created_at", 1e12, above_low=False)

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

    def runs(self, d: Deployment) -> tuple[str, str, int]:
        """What it runs: its own template, or (a replica from before templates) its deployment's ``d``."""
        return self.template() if self.octants else d.template()

    def placement(self) -> Placement:
        return Placement(self.id, self.node, self.gpus, self.milli_per_gpu)

    def unplace(self, why: str, failover: bool = False) -> None:
        """Back to PENDING: no slice, no process, nothing to wait for (the caller stores it)."""
        self.node, self.gpus, self.milli_per_gpu, self.handle, self.pid = "", (), 0, "", None
        self.host, self.http_port, self.grpc_port, self.metrics_port = "", None, None, None
        self.state, self.message, self.failover, self.after = ReplicaState.PENDING, why, failover, []


def new_replica_id(deployment: str) -> str:
    return f"{deployment}-{uuid.uuid4().hex[:6]}"
