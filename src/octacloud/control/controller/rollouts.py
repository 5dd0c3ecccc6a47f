"""Where a deployment's rollout stands: its revisions, and which replicas run the current one (what
``octacloud rollout status`` shows)."""

from __future__ import annotations

from typing import Any

from octacloud.control.deployments import ReplicaState
from octacloud.control.store import Store


def rollout_status(store: Store, name: str) -> dict[str, Any]:
    d = store.get_deployment(name)
    history = store.revisions(name)
    current = history[-1][0] if history else 0
    rows = [
        {
            "id": r.id,
            "state": r.state.value,
            "revision": r.revision,
            "up_to_date": r.runs(d) == d.template(),
            "replaces": r.replaces,
            "ready_since": r.last_ready_at if r.state is ReplicaState.READY else None,
            "message": r.message,
        }
        for r in store.replicas(name)
    ]
    serving = [x for x in rows if not x["replaces"] and x["state"] != ReplicaState.STOPPING.value]
    updated = sum(1 for x in serving if x["up_to_date"] and x["state"] == ReplicaState.READY.value)
    return {
        "deployment": name,
        "revision": current,
        "model": d.spec.model,
        "version": d.spec.version,
        "octants": d.octants,
        "desired": d.replicas,
        "updated": updated,
        "complete": updated == d.replicas and len(serving) == d.replicas,
        "replicas": rows,
        "history": [
            {"revision": n, "model": s.model, "version": s.version, "octants": o, "at": at} for n, s, o, at in history
        ],
    }
