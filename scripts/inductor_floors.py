"""How far each Inductor kernel of a profiled step is from its memory floor.

Inputs: the table of ``scripts/profile_model.py`` (``self CUDA ms/step, share, calls/step, operator`` rows)
and the generated code of the same run, logged with Inductor's per-kernel byte counts::

    TORCHINDUCTOR_BENCHMARK_KERNEL=1 TORCH_LOGS=output_code TORCH_LOGS_OUT=code.log \\
        python scripts/profile_model.py --model gspn2_tiny --task train --compile --rows 400 > profile.txt
    python scripts/inductor_floors.py profile.txt code.log --tbps 4.2

For every ``triton_*`` row the floor is the bytes Inductor counts for one launch (``kernel_num_gb``: each
input read once, each output written once) times the launches per step, at ``--tbps`` TB/s. Kernels of
the forward and backward graphs that share a name (Inductor numbers each graph's kernels from 0) are
counted with the mean of their byte counts. Prints the totals and the kernels with the largest time above
their floor.
"""

from __future__ import annotations

import argparse
import re
from typing import Dict, List, Tuple

# A kernel's name, then its byte count before the next kernel's name.
_NUM_GB = re.compile(
    r"kernel_name': '(triton_[a-z0-9_]+)'(?:(?!kernel_name').)*?kernel_num_gb': ([0-9.eE+-]+)", re.S
)


def kernel_gb(code: str) -> Dict[str, float]:
    """Kernel name -> GB per launch (the mean where several kernels carry the name)."""
    seen: Dict[str, List[float]] = {}
    for m in _NUM_GB.finditer(code):
        seen.setdefault(m.group(1), []).append(float(m.group(2)))
    return {k: sum(v) / len(v) for k, v in seen.items()}


def profile_rows(table: str) -> List[Tuple[float, float, str]]:
    """``(ms per step, calls per step, name)`` of the table's Triton kernels."""
    rows = []
    for line in table.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[3].startswith("triton_"):
            try:
                rows.append((float(parts[0]), float(parts[2]), parts[3]))
            except ValueError:
                continue
    return rows


def floors(table: str, code: str, tbps: float) -> dict:
    """Totals and per-kernel rows: ms, floor ms, ratio, calls, name (rows without a byte count: ``missing``)."""
    if tbps <= 0:
        raise ValueError(f"`tbps` must be > 0, got {tbps}")
    gb = kernel_gb(code)
    out, missing = [], []
    for ms, calls, name in profile_rows(table):
        if name not in gb:
            missing.append(name)
            continue
        floor = gb[name] * calls / tbps  # GB / (TB/s) = ms
        out.append(dict(name=name, ms=ms, floor_ms=floor, calls=calls))
    out.sort(key=lambda r: r["ms"] - r["floor_ms"], reverse=True)
    return dict(
        kernels=out,
        missing=missing,
        ms=sum(r["ms"] for r in out),
        floor_ms=sum(r["floor_ms"] for r in out),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", help="scripts/profile_model.py's output")
    ap.add_argument("code_log", help="the TORCH_LOGS=output_code log of the same run")
    ap.add_argument("--tbps", type=float, default=4.2, help="copy rate of the floor, TB/s (default 4.2, an H200)")
    ap.add_argument("--rows", type=int, default=25)
    args = ap.parse_args()
    with open(args.profile) as f:
        table = f.read()
    with open(args.code_log) as f:
        code = f.read()
    r = floors(table, code, args.tbps)
    if not r["kernels"]:
        raise SystemExit("no Triton kernel of the profile has a byte count in the log "
                         "(was it written with TORCHINDUCTOR_BENCHMARK_KERNEL=1 and TORCH_LOGS=output_code?)")
    print(f"Triton kernels: {r['ms']:.3f} ms per step, floor {r['floor_ms']:.3f} ms at {args.tbps} TB/s "
          f"({r['ms'] / r['floor_ms']:.2f}x); {len(r['kernels'])} kernels, {len(r['missing'])} without a byte count")
    print(" ms/step  floor ms  x floor  calls  kernel")
    for k in r["kernels"][: args.rows]:
        ratio = k["ms"] / k["floor_ms"] if k["floor_ms"] > 0 else float("inf")
        print(f"{k['ms']:8.3f}  {k['floor_ms']:8.3f}  {ratio:7.1f}  {k['calls']:5.0f}  {k['name']}")


if __name__ == "__main__":
    main()
