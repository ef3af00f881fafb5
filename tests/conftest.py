"""Test-session hooks shared by every test folder."""

from __future__ import annotations

import os
from collections import defaultdict

# One intra-op thread for the test process and every process it starts (train.py, torchrun's ranks,
# the scripts): the suite runs many tiny ops on 2 cores, often shared with other jobs, where OpenMP's
# spinning second thread made a float64 gradcheck of a 6x5 image 100 times slower than one thread.
# The results do not depend on the thread count. Set before torch is imported so OpenMP reads it.
os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402  (after the environment variable above)

torch.set_num_threads(1)


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
