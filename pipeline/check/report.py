"""The check's rows, the table they print as, the JSON report, and the exit code they end in."""

from __future__ import annotations

import json
import textwrap
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from pipeline.core.errors import EXIT_CODES, ClusterError, InputError

PASS, FAIL, SKIPPED = "pass", "fail", "skipped"
Status = Literal["pass", "fail", "skipped"]
# Whose a failed row is to fix: the cluster's (exit 3) or the input's (exit 1), as the jobs'
# own exit codes say (docs/errors.md).
Owner = Literal["cluster", "input"]


@dataclass(frozen=True)
class Row:
    name: str
    status: Status
    detail: str  # pass: what was measured; fail: what is wrong and what to fix; skipped: why
    owner: Owner = "cluster"
    facts: dict[str, Any] = field(default_factory=dict)  # the measurements, for the JSON


def passed(name: str, detail: str, **facts: Any) -> Row:
    return Row(name, PASS, detail, facts=facts)


def failed(name: str, detail: str, *, owner: Owner = "cluster", **facts: Any) -> Row:
    return Row(name, FAIL, detail, owner, facts)


def skipped(name: str, detail: str, **facts: Any) -> Row:
    return Row(name, SKIPPED, detail, facts=facts)


def exit_code(rows: list[Row]) -> int:
    """0 when no row failed; 3 when a row of the cluster's failed; else 1 (only rows of the
    input's: storage that refuses for good, a dataset that is there but unreadable)."""
    owners = {row.owner for row in rows if row.status == FAIL}
    if not owners:
        return 0
    return EXIT_CODES[ClusterError] if "cluster" in owners else EXIT_CODES[InputError]


def verdict(rows: list[Row]) -> str:
    """One line: how many rows passed, failed and were skipped, and which failed."""
    bad = [row.name for row in rows if row.status == FAIL]
    if bad:
        return f"cluster check: {len(bad)} of {len(rows)} rows failed: {', '.join(bad)}"
    counts = {s: sum(row.status == s for row in rows) for s in (PASS, SKIPPED)}
    return f"cluster check passed: {counts[PASS]} rows pass, {counts[SKIPPED]} skipped"


def table(rows: list[Row], width: int = 100) -> str:
    """The rows as a plain-text table: name, status, and the detail wrapped beside them."""
    name_w = max(len("row"), *(len(r.name) for r in rows))
    status_w = len("skipped")
    indent = " " * (name_w + status_w + 4)
    lines = [f"{'row':<{name_w}}  {'status':<{status_w}}  detail", "-" * width]
    for row in rows:
        wrapped = textwrap.wrap(row.detail, width=max(40, width - len(indent))) or [""]
        lines.append(f"{row.name:<{name_w}}  {row.status:<{status_w}}  {wrapped[0]}")
        lines += [indent + more for more in wrapped[1:]]
    return "\n".join(lines)


def report(rows: list[Row], **header: Any) -> dict[str, Any]:
    """The JSON report: `header` (the check's id, times, config, nodes), then the verdict and
    every row."""
    return {
        **header,
        "exit_code": exit_code(rows),
        "verdict": verdict(rows),
        "rows": [asdict(row) for row in rows],
    }


def one_line(data: dict[str, Any]) -> str:
    return json.dumps(data, separators=(",", ":"), sort_keys=False, default=str)
