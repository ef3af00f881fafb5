"""Export a GSPN-2 model to ONNX (fixed input size) and check it with onnxruntime.

    pip install onnx onnxscript onnxruntime
    python scripts/export_onnx.py --model gspn2_micro --size 64 --out gspn2_micro.onnx [--checkpoint last.pt]

ONNX has no operator for gspn2's custom ops, so the exported program's ``gspn2::propagate`` and
``gspn2::depthwise_conv2d`` calls are decomposed into the pure-PyTorch reference before translation
(``ExportedProgram.run_decompositions``): the convolution becomes a grouped ``Conv``, and the four-direction
scan becomes its steps unrolled into elementwise ops. That unrolling needs a fixed height and width (the
number of scan steps is the image size), so the ONNX graph has a fixed input size and grows with it; the
exporter is torch's dynamo-based one (``torch.onnx.export(..., dynamo=True)``, which needs onnxscript).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import timm
import torch
import torch.nn.functional as F

import gspn2  # noqa: F401  (registers the models and the gspn2:: ops)
from gspn2.ops import gspn_propagate_ref


def _propagate(x, lam, gates, chunk=None):
    return gspn_propagate_ref(x, lam, gates, chunk)


def _depthwise_conv2d(x, weight, bias, add_input, silu):
    y = F.conv2d(x, weight, bias, padding=weight.shape[-1] // 2, groups=x.shape[1])
    if add_input:
        y = y + x
    return F.silu(y) if silu else y


#: The custom ops, written as the aten ops ONNX can express.
DECOMPOSITIONS = {
    torch.ops.gspn2.propagate.default: _propagate,
    torch.ops.gspn2.depthwise_conv2d.default: _depthwise_conv2d,
}


def export_onnx(model: torch.nn.Module, input_size: tuple, path: str):
    """Export ``model`` (eval mode) for inputs of ``input_size = (B, C, H, W)`` to ``path``; returns the
    ``torch.onnx.ONNXProgram``."""
    model.eval()
    with torch.no_grad():
        program = torch.export.export(model, (torch.randn(input_size),))
        program = program.run_decompositions(DECOMPOSITIONS)
    onnx_program = torch.onnx.export(program, dynamo=True)
    onnx_program.save(path)
    return onnx_program


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gspn2_micro")
    parser.add_argument("--size", type=int, default=64, help="input height and width (>= 29)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--checkpoint", default=None, help="weights: a train.py checkpoint or a state dict")
    parser.add_argument("--use-ema", action="store_true", help="take the checkpoint's EMA weights")
    parser.add_argument("--out", required=True, help="the .onnx file to write")
    args = parser.parse_args()
    if args.size < 29 or args.batch < 1:
        parser.error(f"--size must be >= 29 and --batch >= 1, got {args.size} and {args.batch}")

    model = timm.create_model(args.model)
    if args.checkpoint:
        timm.models.load_checkpoint(model, args.checkpoint, use_ema=args.use_ema)
    shape = (args.batch, 3, args.size, args.size)
    start = time.perf_counter()
    export_onnx(model, shape, args.out)
    print(f"wrote {args.out} in {time.perf_counter() - start:.0f} s")

    import onnxruntime

    session = onnxruntime.InferenceSession(args.out)
    x = torch.randn(shape)
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        want = model(x).numpy()
    print(f"onnxruntime vs eager: max abs difference {np.abs(got - want).max():.3g}")


if __name__ == "__main__":
    main()
