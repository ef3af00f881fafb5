"""Test-session hooks shared by every test folder."""

from __future__ import annotations

from collections import defaultdict


def pytest_terminal_summary(terminalreporter) -> None:
    """One line per skip reason (pyproject's ``-r`` leaves skips out of the per-test short summary).

    A CPU machine skips every ``cuda`` test for the same reason; listing each of them drowned the
    failures. Skips are still counted as skips in the final line.
    """
    by_reason: dict[str, list[str]] = defaultdict(list)
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        by_reason[reason.removeprefix("Skipped: ")].append(report.nodeid.split("::")[0])
    for reason, files in sorted(by_reason.items()):
        terminalreporter.write_line(
            f"SKIPPED {len(files)} test(s) in {len(set(files))} file(s): {reason}", yellow=True
        )
