"""Parameters and MACs (fvcore, one multiply-add = 1) of the registered GSPN-2 models.

    python scripts/count.py                              # every gspn2_* model at 224^2 vs the paper
    python scripts/count.py --check                      # same, exit code 1 if T/S/B miss the tolerance
    python scripts/count.py --model gspn2_tiny --breakdown            # per-component and per-stage tables
    python scripts/count.py --model gspn2_base --img-size 224x320     # any size, H x W
    python scripts/count.py --breakdown --markdown       # the tables of docs/models.md

Counts are of one forward pass at batch 1 on CPU (``gspn2.counting.count_model``); the propagation op is
counted as 4 MACs per output element and direction (docs/spec.md 1.6). Paper figures are at 224^2, 1000 classes.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Sequence, Tuple

import timm
import torch

import gspn2  # noqa: F401  (registers the gspn2_* models)
from gspn2.benchmark import parse_image_size as parse_img_size
from gspn2.counting import MAC_TOLERANCE, PAPER_COUNTS, PARAM_TOLERANCE, ModelCount, count_model

PAPER_SIZE = (224, 224)
# Small to large in the summary table; other registered gspn2_* names follow alphabetically.
MODEL_ORDER = ("gspn2_micro", "gspn2_tiny", "gspn2_small", "gspn2_base")
_BLOCK = r"stages\.\d+\.blocks\.\d+\.mixer\."
# Parts of the mixers, shown as "of which" rows under "mixers".
MIXER_PARTS = (
    ("  of which in/out 1x1 projections", _BLOCK + r"(in_proj|out_proj)"),
    ("  of which depthwise conv", _BLOCK + r"conv_dw"),
    ("  of which proxy/gate generator", _BLOCK + r"generate"),
    ("  of which projection back (4P -> E)", _BLOCK + r"proj_up"),
    ("  of which mixer norm", _BLOCK + r"norm"),
)


def _table(header: Sequence[str], rows: List[Sequence[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def summary_row(name: str, count: ModelCount, at_paper_size: bool) -> Tuple[List[str], Optional[bool]]:
    """One row of the summary table and whether the model is within tolerance (None: no paper figure)."""
    row = [name, f"{count.params / 1e6:.2f}", f"{count.macs / 1e9:.3f}"]
    paper = PAPER_COUNTS.get(name)
    if paper is None or not at_paper_size:
        return row + ["-", "-", "-", "-", "n/a"], None
    dp = count.params / paper.params - 1.0
    dm = count.macs / paper.macs - 1.0
    ok = abs(dp) <= PARAM_TOLERANCE and abs(dm) <= MAC_TOLERANCE
    row += [f"{paper.params / 1e6:.0f}", f"{paper.macs / 1e9:.1f}", f"{100 * dp:+.2f}", f"{100 * dm:+.2f}"]
    return row + ["yes" if ok else "NO"], ok


def breakdown_tables(count: ModelCount, markdown: bool) -> str:
    """Per-component table (stem, mixers, MLPs, ...) and per-stage table of one model."""
    def fmt(label: str, params: int, macs: int) -> List[str]:
        return [label, f"{params:,}", f"{100 * params / count.params:.1f}", f"{macs / 1e6:,.1f}",
                f"{100 * macs / count.macs:.1f}"]

    rows = []
    for label, params, macs in count.grouped():
        if params == 0 and macs == 0:
            continue  # e.g. layer scale when disabled, "other" when the rules cover everything
        rows.append(fmt(label, params, macs))
        if label == "mixers":
            rows += [fmt(*part) for part in count.grouped(MIXER_PARTS)[:-1]]
            rows.append(fmt("  of which gspn2::propagate", 0, count.propagate_macs))
    rows.append(["total", f"{count.params:,}", "100.0", f"{count.macs / 1e6:,.1f}", "100.0"])
    header = ["component", "params", "params %", "MACs (M)", "MACs %"]
    parts = [_table(header, rows, markdown)]

    stage_rows = []
    stages = [n for n in count.params_by_module if n.startswith("stages.") and n.count(".") == 1]
    for name in ["stem", *stages, "head"]:
        stage_rows.append([name, f"{count.params_by_module[name]:,}", f"{count.by_module.get(name, 0) / 1e6:,.1f}"])
    parts.append(_table(["module", "params", "MACs (M)"], stage_rows, markdown))
    if count.unsupported_ops:
        ops = ", ".join(f"`{k}` x{v}" if markdown else f"{k} x{v}" for k, v in sorted(count.unsupported_ops.items()))
        parts.append(f"Not counted by fvcore (elementwise ops and views, 0 MACs by its convention): {ops}")
    return "\n\n".join(parts)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", default=None,
                        help="registered model name (repeatable); default: every gspn2_* model")
    parser.add_argument("--img-size", type=parse_img_size, default=PAPER_SIZE, help="N or HxW (default 224)")
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--breakdown", action="store_true", help="per-component and per-stage tables")
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if a model with a paper figure is outside the tolerance")
    args = parser.parse_args(argv)

    names = args.model or sorted(
        timm.list_models("gspn2_*"),
        key=lambda n: (MODEL_ORDER.index(n) if n in MODEL_ORDER else len(MODEL_ORDER), n),
    )
    unknown = [n for n in names if n not in timm.list_models()]
    if unknown:
        parser.error(f"--model: unknown model(s) {unknown}; registered: {timm.list_models('gspn2_*')}")
    at_paper_size = tuple(args.img_size) == PAPER_SIZE and args.num_classes == 1000
    if args.check and not at_paper_size:
        parser.error("--check compares with the paper's figures at 224x224 and 1000 classes")

    torch.manual_seed(0)
    H, W = args.img_size
    rows, all_ok, details = [], True, []
    for name in names:
        model = timm.create_model(name, num_classes=args.num_classes)
        count = count_model(model, input_size=(3, H, W))
        row, ok = summary_row(name, count, at_paper_size)
        rows.append(row)
        all_ok = all_ok and ok is not False
        if args.breakdown:
            details.append((name, count))

    header = ["model", "params (M)", "MACs (G)", "paper params (M)", "paper MACs (G)",
              "params dev %", "MACs dev %", "within tol"]
    print(f"{'' if args.markdown else '# '}fvcore counts at {H}x{W}, batch 1, {args.num_classes} classes; tolerance params "
          f"+-{100 * PARAM_TOLERANCE:.0f}%, MACs +-{100 * MAC_TOLERANCE:.0f}%\n")
    print(_table(header, rows, args.markdown))
    for name, count in details:
        print(f"\n{'### ' if args.markdown else '== '}{name} at {H}x{W}\n")
        print(breakdown_tables(count, args.markdown))
    if args.check and not all_ok:
        print("count check FAILED: a model is outside the paper tolerance", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
