"""The usage ledger: append-only records, one per (tenant, deployment, replica, metric, interval).

Every record's idempotency key is ``(tenant, deployment, replica, metric, interval_start_ms)``, under a
unique constraint. An interval's records and the meter's progress mark are written in one transaction with
``INSERT ... ON CONFLICT DO NOTHING``: a retried or replayed interval adds nothing, and a crash leaves either
the whole interval or none of it. Rows are never updated or deleted.

Quantities are integers in the units of :class:`Metric` (no float drift when summing a month of intervals).
"""

from __future__ import annotations

import datetime as dt
import enum
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import cast

from sqlalchemy import BigInteger, Integer, String, UniqueConstraint, create_engine, event, func, literal, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker


class Metric(enum.Enum):
    """What a record counts, and its integer unit."""

    ALLOC = "alloc_milli_ms"
    """GPU slice held: milli-GPU × milliseconds (an octant is 125 milli-GPU; 1 octant-second = 125 000)."""
    EXEC = "exec_us"
    """Execution time the replica measured (``nv_inference_compute_infer_duration_us``), microseconds."""
    INFERENCES = "inferences"
    """Inferences (batch items) the replica executed (``nv_inference_count``)."""
    REQUESTS = "requests"
    """Requests the gateway received for the deployment from the tenant."""
    BYTES_IN = "bytes_in"
    BYTES_OUT = "bytes_out"
    STORAGE = "storage_byte_ms"
    """Model bytes in the repository × milliseconds, per deployment that serves the model."""
    PROMPT_TOKENS = "prompt_tokens"
    """Tokens of the prompts the tenant sent to a generative deployment (as its replicas counted them)."""
    COMPLETION_TOKENS = "completion_tokens"
    """Tokens generated for the tenant."""
    GPU_USED = "gpu_used_milli_ms"
    """GPU actually used: the SM share NVML measured for the replica's process (its process utilisation
    samples), milli-GPU × milliseconds like ``ALLOC``; recorded only on NVIDIA cards."""
    ENERGY = "energy_mj"
    """Energy of the cards the replica's slice holds, millijoules (watts × milliseconds; 1 Wh = 3 600 000): each
    card's measured power draw times the share of the card the slice holds (milli-GPU / 1000), integrated like
    ``ALLOC``; recorded only where the card's draw is measured (NVML)."""


@dataclass(frozen=True, slots=True)
class UsageRecord:
    tenant: str
    deployment: str
    replica: str
    """The replica for slice and replica-measured metrics; '' for the gateway's and storage metrics."""
    metric: Metric
    interval_start_ms: int
    interval_ms: int
    quantity: int
    gpu_model: str = ""

    @property
    def key(self) -> tuple[str, str, str, str, int]:
        return (self.tenant, self.deployment, self.replica, self.metric.value, self.interval_start_ms)


@dataclass(frozen=True, slots=True)
class Total:
    """The sum of one metric for one tenant in one report group (and GPU model, which prices need)."""

    tenant: str
    group: str
    metric: Metric
    gpu_model: str
    quantity: int


GROUPS: tuple[str, ...] = ("deployment", "day", "gpu-model", "tenant")
MS_PER_DAY = 86_400_000


def day_of(interval_start_ms: int) -> str:
    """The UTC date an interval starts on, ISO format."""
    return dt.datetime.fromtimestamp(interval_start_ms // MS_PER_DAY * 86_400, dt.UTC).date().isoformat()


class _Base(DeclarativeBase):
    pass


class _RecordRow(_Base):
    __tablename__ = "usage_records"
    __table_args__ = (
        UniqueConstraint("tenant", "deployment", "replica", "metric", "interval_start_ms", name="usage_idempotency"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant: Mapped[str] = mapped_column(String(32), index=True)
    deployment: Mapped[str] = mapped_column(String(64))
    replica: Mapped[str] = mapped_column(String(96))
    metric: Mapped[str] = mapped_column(String(24))
    gpu_model: Mapped[str] = mapped_column(String(96))
    interval_start_ms: Mapped[int] = mapped_column(BigInteger, index=True)
    interval_ms: Mapped[int] = mapped_column(BigInteger)
    quantity: Mapped[int] = mapped_column(BigInteger)


class _ProgressRow(_Base):
    __tablename__ = "usage_progress"
    meter: Mapped[str] = mapped_column(String(32), primary_key=True)
    closed_until_ms: Mapped[int] = mapped_column(BigInteger)


class Ledger:
    """Append-only usage records in a SQL database (the state store's, or its own URL)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        _Base.metadata.create_all(engine)
        self._sessions = sessionmaker(engine, expire_on_commit=False)

    @classmethod
    def at(cls, url: str) -> Ledger:
        engine = create_engine(url, future=True)
        if url.startswith("sqlite"):
            event.listen(engine, "connect", _sqlite_busy_timeout)
        return cls(engine)

    @contextmanager
    def _tx(self) -> Iterator[Session]:
        with self._sessions.begin() as session:
            yield session

    def append(self, records: Sequence[UsageRecord], meter: str = "meter", closed_until_ms: int | None = None) -> int:
        """Add ``records`` (those whose key exists already are skipped) and, in the same transaction, move
        ``meter``'s progress mark to ``closed_until_ms``. Returns how many records were new."""
        rows = [
            {
                "tenant": r.tenant,
                "deployment": r.deployment,
                "replica": r.replica,
                "metric": r.metric.value,
                "gpu_model": r.gpu_model,
                "interval_start_ms": r.interval_start_ms,
                "interval_ms": r.interval_ms,
                "quantity": r.quantity,
            }
            for r in records
        ]
        dialect = postgresql if self.engine.dialect.name == "postgresql" else sqlite
        added = 0
        with self._tx() as s:
            if rows:
                stmt = dialect.insert(_RecordRow).values(rows).on_conflict_do_nothing().returning(_RecordRow.id)
                added = len(s.execute(stmt).all())  # (counted from the rows: a driver's rowcount may be -1 here)
            if closed_until_ms is not None:
                progress = s.get(_ProgressRow, meter)
                if progress is None:
                    s.add(_ProgressRow(meter=meter, closed_until_ms=closed_until_ms))
                else:
                    progress.closed_until_ms = max(progress.closed_until_ms, closed_until_ms)
        return added

    def closed_until_ms(self, meter: str = "meter") -> int | None:
        """Where ``meter`` stopped: the end of its last closed interval (None if it never closed one)."""
        with self._tx() as s:
            row = s.get(_ProgressRow, meter)
            return None if row is None else row.closed_until_ms

    def records(
        self,
        tenant: str | None = None,
        since_ms: int | None = None,
        until_ms: int | None = None,
        deployments: Iterable[str] | None = None,
    ) -> list[UsageRecord]:
        """Records whose interval starts in ``[since_ms, until_ms)``, oldest first."""
        q = select(_RecordRow).order_by(_RecordRow.interval_start_ms, _RecordRow.id)
        if tenant is not None:
            q = q.where(_RecordRow.tenant == tenant)
        if since_ms is not None:
            q = q.where(_RecordRow.interval_start_ms >= since_ms)
        if until_ms is not None:
            q = q.where(_RecordRow.interval_start_ms < until_ms)
        if deployments is not None:
            q = q.where(_RecordRow.deployment.in_(list(deployments)))
        with self._tx() as s:
            return [
                UsageRecord(
                    r.tenant,
                    r.deployment,
                    r.replica,
                    Metric(r.metric),
                    r.interval_start_ms,
                    r.interval_ms,
                    r.quantity,
                    r.gpu_model,
                )
                for r in s.scalars(q)
            ]

    def totals(
        self,
        by: str = "deployment",
        tenant: str | None = None,
        since_ms: int | None = None,
        until_ms: int | None = None,
        deployments: Iterable[str] | None = None,
    ) -> list[Total]:
        """Sums per (tenant, group, metric, GPU model), computed by the database: a report reads a few rows
        however many intervals it covers. Filters as in :meth:`records`."""
        if by not in GROUPS:
            raise ValueError(f"cannot group usage by {by!r}; choose one of {', '.join(GROUPS)}")
        r = _RecordRow
        group = {
            "deployment": r.deployment,
            "day": r.interval_start_ms // MS_PER_DAY,
            "gpu-model": r.gpu_model,
            "tenant": literal(""),
        }[by]
        q = select(r.tenant, group, r.metric, r.gpu_model, func.sum(r.quantity)).group_by(
            r.tenant, group, r.metric, r.gpu_model
        )
        if tenant is not None:
            q = q.where(r.tenant == tenant)
        if since_ms is not None:
            q = q.where(r.interval_start_ms >= since_ms)
        if until_ms is not None:
            q = q.where(r.interval_start_ms < until_ms)
        if deployments is not None:
            q = q.where(r.deployment.in_(list(deployments)))
        with self._tx() as s:
            rows = s.execute(q).all()
        out = []
        for t, g, metric, model, quantity in rows:
            name = (
                day_of(int(cast(int, g)) * MS_PER_DAY)
                if by == "day"
                else ("-" if by == "gpu-model" and not g else str(g))
            )
            out.append(Total(t, name, Metric(metric), model, int(quantity)))
        return out

    def close(self) -> None:
        self.engine.dispose()


def _sqlite_busy_timeout(dbapi_connection: object, _record: object) -> None:
    cursor = dbapi_connection.cursor()  # type: ignore[attr-defined]
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.close()
