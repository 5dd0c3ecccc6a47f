"""The table ``fleet_scale.py`` prints: its figures side by side for each size, the ratios against the 8-card
cloud, and which goals each size of 1,000 cards or more met."""

from __future__ import annotations

import math
from typing import Any

GOALS = {"pass_s": 1.0, "deploy_1000_s": 120.0, "propagation_s": 1.0, "scale_out_passes": 1, "recovery_s": 60.0}


def _phase(r: dict[str, Any], phase: str, fmt: str) -> str:
    """A scale-out or failure figure, "–" where the size had no such phase, "timed out" where it did not end."""
    if phase not in r:
        return "–"
    if "error" in r[phase]:
        return "measured nothing" if r[phase]["error"].startswith("measured nothing") else "timed out"
    return fmt.format(**r[phase])


def table(results: list[dict[str, Any]]) -> str:
    base = results[0]
    rows = [
        ("cards / replicas", lambda r: f"{r['cards']} / {r['replicas']}"),
        ("deploy → all ready (s)", lambda r: f"{r['deploy_to_ready_s']:.1f}"),
        ("longest pass during the deploy (s)", lambda r: f"{r['ramp_pass_max_s']:.2f}"),
        ("  its longest scheduling part (s)", lambda r: f"{r.get('ramp_scheduling_max_s', float('nan')):.2f}"),
        ("controller pass, steady (s)", lambda r: f"{r['pass_s']:.3f}"),
        ("  health (s)", lambda r: f"{r['pass_parts_s'].get('health', 0):.3f}"),
        ("  scheduling (s)", lambda r: f"{r['pass_parts_s'].get('scheduling', 0):.3f}"),
        ("  execute (s)", lambda r: f"{r['pass_parts_s'].get('execute', 0):.3f}"),
        ("simulator pass, same fleet (s)", lambda r: f"{r['simulator_pass_s']:.3f}"),
        ("pass ÷ simulator", lambda r: f"{r['pass_s'] / max(1e-9, r['simulator_pass_s']):.1f}"),
        ("route snapshot encode / apply (ms)",
         lambda r: f"{1e3 * r['propagation']['snapshot_encode_s']:.2f} / {1e3 * r['propagation']['apply_s']:.2f}"),
        ("gateway CPU per request (µs)", lambda r: f"{r['gateway_cpu_us_per_request']:.0f}"),
        ("gateway requests/s, one client (failed)",
         lambda r: f"{r['gateway_requests_per_s']:.0f} ({r['gateway_failed']})"),
        ("meter interval close (s)", lambda r: f"{r['meter_close_s']:.3f}"),
        ("dashboard document (s / KiB)",
         lambda r: f"{r['dashboard_state_s']:.3f} / {r['dashboard_state_bytes'] / 1024:.0f}"),
        ("dashboard in Chromium: redraw / first map (ms)",
         lambda r: _phase(r, "dashboard_render", "{redraw_ms:.0f} / {first_map_ms:.0f}")),
        ("store rows/s during deploy", lambda r: f"{r['store_rows_per_s']:.0f}"),
        ("SQLite size (MiB)", lambda r: f"{r['sqlite_mib']:.1f}"),
        ("events stored", lambda r: f"{r['events']}"),
        ("RSS cloud / hosts (MiB)",
         lambda r: f"{r['rss_mib']['cloud']:.0f} / {sum(v for k, v in r['rss_mib'].items() if k != 'cloud'):.0f}"),
        ("scale-out: replicas waiting → on new nodes", lambda r: _phase(r, "scale_out", "{waiting} → {placed_on_new}")),
        ("  passes / s until placed", lambda r: _phase(r, "scale_out", "{passes_to_place} / {placed_s:.1f}")),
        ("  its scheduling part (s)", lambda r: _phase(r, "scale_out", "{scheduling_s:.2f}")),
        ("  s until ready", lambda r: _phase(r, "scale_out", "{ready_s:.1f}")),
        ("10 % nodes lost: recovery (s)", lambda r: _phase(r, "failure", "{recovery_s:.1f}")),
        ("  cards given twice", lambda r: _phase(r, "failure", "{cards_given_twice}")),
    ]  # fmt: skip
    width = max(len(name) for name, _ in rows)
    lines = [f"{'':<{width}}  " + "  ".join(f"{r['cards']:>5} cards" for r in results)]
    for name, fn in rows:
        lines.append(f"{name:<{width}}  " + "  ".join(f"{fn(r):>11}" for r in results))
    lines.append("")
    for r in results[1:]:
        lines.append(
            f"{r['cards']} cards ÷ {base['cards']} cards: pass ×{r['pass_s'] / max(1e-9, base['pass_s']):.1f}, "
            f"gateway CPU/request "
            f"×{r['gateway_cpu_us_per_request'] / max(1e-9, base['gateway_cpu_us_per_request']):.2f}, "
            f"deploy → ready ×{r['deploy_to_ready_s'] / max(1e-9, base['deploy_to_ready_s']):.1f} "
            f"for ×{r['replicas'] / base['replicas']:.0f} replicas"
        )  # fmt: skip
    big = [r for r in results if r["cards"] >= 1000]
    for r in big:
        figures = {"pass_s": r["pass_s"], "propagation_s": r["propagation"]["snapshot_encode_s"]
                   + r["propagation"]["apply_s"] + r["propagation"]["hub_poll_s"],
                   "scale_out_passes": r["scale_out"].get("passes_to_place", math.inf) if "scale_out" in r else None,
                   "recovery_s": r.get("failure", {}).get("recovery_s")}  # fmt: skip
        if r["replicas"] == 1000:
            figures["deploy_1000_s"] = r["deploy_to_ready_s"]
        said = [f"{k} {v:.2f} ≤ {GOALS[k]:g}: {'met' if v <= GOALS[k] else 'NOT met'}"
                for k, v in figures.items() if v is not None]  # fmt: skip
        lines.append(f"goals at {r['cards']} cards / {r['replicas']} replicas: " + "; ".join(said))
    return "\n".join(lines)
