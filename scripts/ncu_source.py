"""Where a kernel's instructions go, from Nsight Compute's source counters (no GPU needed).

    ncu --section SourceCounters --section WarpStateStats -k regex:dwconv_tile -o runs/dw \\
        python3 scripts/gpu_profile.py dwconv
    ncu -i runs/dw.ncu-rep --page source --csv --print-source sass > runs/dw_source.csv
    python3 scripts/ncu_source.py runs/dw_source.csv                  # one line per profiled kernel
    python3 scripts/ncu_source.py runs/dw_source.csv --kernel 4 --blocks 6

Per kernel: warp instructions executed, the opcode mix and the warp-stall reasons (shares of the stall
samples). With ``--kernel``, also its straight-line blocks (runs of SASS instructions that executed equally
often) with the largest shares of the executed instructions: how often each ran and what it is made of,
which separates, say, the inner loop from the staging and the tile bookkeeping.
"""

from __future__ import annotations

import argparse
import collections
import csv


def read_kernels(path: str) -> list[dict]:
    """The CSV's kernels: name, header and rows (one per SASS instruction)."""
    kernels, cur = [], None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                cur = {"name": row[1], "rows": []}
                kernels.append(cur)
            elif row[0] == "Address" and cur is not None:
                cur["col"] = {k: i for i, k in enumerate(row)}
            elif cur is not None and row[0].startswith("0x"):
                cur["rows"].append(row)
    if not kernels:
        raise SystemExit(f"ncu_source.py: no kernel in {path} (expected `ncu --page source --csv` output)")
    return kernels


def opcode(sass: str) -> str:
    text = sass.strip()
    if text.startswith("@"):  # predicate
        text = text.split(None, 1)[1] if " " in text else ""
    return text.split()[0].split(".")[0] if text else "?"


def count(row: list[str], col: dict, key: str) -> int:
    value = row[col[key]]
    return int(value) if value and value not in ("-", "") else 0


def summary(k: dict) -> str:
    col, rows = k["col"], k["rows"]
    executed = collections.Counter()
    stalls = collections.Counter()
    total = samples = 0
    for r in rows:
        n = count(r, col, "Instructions Executed")
        total += n
        executed[opcode(r[1])] += n
        samples += count(r, col, "Warp Stall Sampling (All Samples)")
        for key in col:
            if key.startswith("stall_") and "(Not" not in key:
                stalls[key[len("stall_"):]] += count(r, col, key)
    ops = ", ".join(f"{o} {n / max(total, 1) * 100:.1f}%" for o, n in executed.most_common(12))
    st = ", ".join(f"{s} {n / max(samples, 1) * 100:.1f}%" for s, n in stalls.most_common(8))
    return f"{total / 1e6:.2f} M warp instructions\n  ops: {ops}\n  stalls: {st}"


def blocks(k: dict, top: int) -> list[str]:
    col, rows = k["col"], k["rows"]
    stall_key = "Warp Stall Sampling (All Samples)"
    items = [(i, r[1], count(r, col, "Instructions Executed"), count(r, col, stall_key))
             for i, r in enumerate(rows)]
    total = sum(x[2] for x in items) or 1
    samples = sum(x[3] for x in items) or 1
    runs, cur = [], [items[0]]
    for x in items[1:]:
        if x[2] == cur[-1][2] and opcode(cur[-1][1]) != "BRA":
            cur.append(x)
        else:
            runs.append(cur)
            cur = [x]
    runs.append(cur)
    runs.sort(key=lambda b: -sum(x[2] for x in b))
    out = []
    for b in runs[:top]:
        n, s = sum(x[2] for x in b), sum(x[3] for x in b)
        mix = collections.Counter(opcode(x[1]) for x in b)
        shares = f"{n / total * 100:.1f}% of the instructions, {s / samples * 100:.1f}% of the stall samples"
        head = f"  SASS {b[0][0]}-{b[-1][0]} ({len(b)} instructions, each run {b[0][2]} times)"
        out.append(f"{head}: {shares}; " + ", ".join(f"{o} {c}" for o, c in mix.most_common(8)))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("csv", help="`ncu -i REPORT --page source --csv --print-source sass` output")
    parser.add_argument("--kernel", type=int, action="append", default=None,
                        help="the kernel's index in the CSV (repeatable); default: every kernel, no blocks")
    parser.add_argument("--blocks", type=int, default=6, help="blocks to list per kernel asked for")
    args = parser.parse_args()
    kernels = read_kernels(args.csv)
    for i in args.kernel or range(len(kernels)):
        if not 0 <= i < len(kernels):
            raise SystemExit(f"ncu_source.py: --kernel {i} is not in 0..{len(kernels) - 1}")
        k = kernels[i]
        print(f"[{i}] {k['name'][:110]}\n  {summary(k)}")
        if args.kernel:
            print("\n".join(blocks(k, args.blocks)))


if __name__ == "__main__":
    main()
