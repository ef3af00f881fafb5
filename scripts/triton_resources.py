"""Registers, spills and shared memory of ``gspn2::norm_gate_backward``'s Triton kernel per launch configuration,
compiled ahead of time for a GPU architecture (no GPU needed: Triton's bundled ``ptxas`` and ``cuobjdump``).

    python scripts/triton_resources.py                       # gspn2_tiny's E with the default configuration
    python scripts/triton_resources.py --e 480 --block-m 4 --warps 4 --stages 1 --arch 90

Each line: E, rows per step, warps, pipelining stages, then registers per thread, stack, shared and local
memory bytes as ``cuobjdump -res-usage`` reports them.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

#: gspn2_tiny's mixer widths (1.5 x 80, 160, 320, 640).
TINY_E = (120, 240, 480, 960)
_ARGS = ("G", "X", "Z", "Mean", "Rstd", "NW", "NB", "GX", "GZ", "M", "PartW", "PartB", "N", "rows_per_program")


def resources(E: int, block_m: int, warps: int, stages: int, arch: int, dtype: str = "bf16") -> dict:
    """Compile the kernel for ``sm_<arch>`` and return ``cuobjdump -res-usage``'s REG, STACK, SHARED, LOCAL."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gspn2.ops import _norm_triton

    act, f32 = f"*{dtype}", "*fp32"
    types = (act, act, act, f32, f32, f32, f32, act, act, act, f32, f32, "i32", "i32")
    consts = dict(E=E, BLOCK_M=block_m, BLOCK_E=max(16, triton.next_power_of_2(E)), NUM_STAGES=stages)
    signature = dict(zip(_ARGS, types), **{k: "constexpr" for k in consts})
    kernel = triton.compile(ASTSource(fn=_norm_triton._kernel, signature=signature, constexprs=consts),
                            target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps))
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if found is None:
        raise RuntimeError(f"no resource line in cuobjdump's output:\n{out}")
    return dict(zip(("registers", "stack", "shared", "local"), map(int, found.groups())))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--e", type=int, nargs="+", default=list(TINY_E), help="channels per row")
    parser.add_argument("--block-m", type=int, default=None, help="rows per step (default: config(E))")
    parser.add_argument("--warps", type=int, default=None, help="warps per program (default: config(E))")
    parser.add_argument("--stages", type=int, default=None, help="row-loop pipelining (default: config(E))")
    parser.add_argument("--arch", type=int, default=90, help="compute capability as one number (90: sm_90)")
    args = parser.parse_args(argv)
    for name in ("block_m", "warps", "stages"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if any(e < 1 for e in args.e):
        parser.error(f"--e must be >= 1, got {args.e}")
    from gspn2.ops import _norm_triton

    for E in args.e:
        cfg = _norm_triton.config(E)
        block_m = args.block_m or cfg["block_m"]
        warps = args.warps or cfg["num_warps"]
        stages = args.stages or cfg["num_stages"]
        r = resources(E, block_m, warps, stages, args.arch)
        print(f"E={E} block_m={block_m} warps={warps} stages={stages}: {r['registers']} registers, stack "
              f"{r['stack']}, shared {r['shared']}, local {r['local']} bytes", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
