"""scripts/bench_startup.py's table: one row per phase (the README's generate command; per
served model, /health 200, /ready 200 and the first completion), its cold and warm seconds
or why there are none (FAILED, timeout, n/a), and footnotes for /ready that never came and
servers that did not exit cleanly.
"""

from __future__ import annotations


def seconds(run: dict | None, key: str) -> str:
    """One table cell: the number, or why there is none."""
    if run is None:
        return "-"
    if key == "wall_s" and not run["ok"]:  # a generate run that ran but failed its checks
        return "timeout" if "timed out" in (run["error"] or "") else "FAILED"
    if run.get(key) is not None:
        return f"{run[key]:.2f}"
    if key == "ready_s" and run.get("ready_available") is False:
        return "n/a"
    if key == "ready_s" and run.get("ready_note"):
        return "timeout"
    if not run["ok"]:
        return "timeout" if "timed out" in (run["error"] or "") else "FAILED"
    return "-"


def table(report: dict) -> str:
    rows = []
    gen = report.get("generate")
    if gen:
        rows.append(("generate (README command)", seconds(gen["cold"], "wall_s"),
                     seconds(gen["warm"], "wall_s")))
    for name, runs in report.get("serve", {}).items():
        for key, what in (("health_s", "/health 200"), ("ready_s", "/ready 200"),
                          ("first_completion_s", "first completion")):
            rows.append((f"serve {name}: {what}", seconds(runs.get("cold"), key),
                         seconds(runs.get("warm"), key)))
    width = max([len("phase")] + [len(r[0]) for r in rows])
    lines = [f"{'phase':<{width}}  {'cold s':>9}  {'warm s':>9}",
             f"{'-' * width}  {'-' * 9}  {'-' * 9}"]
    lines += [f"{phase:<{width}}  {cold:>9}  {warm:>9}" for phase, cold, warm in rows]
    return "\n".join(lines + notes(report))


def notes(report: dict) -> list[str]:
    """Footnotes: /ready that never came, servers that did not exit cleanly."""
    out = []
    for name, runs in report.get("serve", {}).items():
        for label in ("cold", "warm"):
            run = runs.get(label) or {}
            if run.get("ready_note"):
                out.append(f"serve {name} ({label}): {run['ready_note']}")
            if run.get("returncode") not in (0, None):
                out.append(f"serve {name} ({label}): exit code {run['returncode']} after "
                           f"{run['signal']} (not a clean exit)")
    return ["", "notes:", *(f"  {line}" for line in out)] if out else []
