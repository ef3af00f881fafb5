"""Building blocks of the GSPN-2 models that run fast under bf16 autocast with channels_last memory.

Each keeps the parameters of the plain module it stands for (``nn.Conv2d``, timm's ``LayerNorm2d`` and
``Mlp``), so checkpoints and MAC counts are those of that module; ``tests/models/_reference.py`` swaps
them for the plain modules to build the oracle of the equivalence tests.
"""

from gspn2.layers.mlp import PointwiseMlp
from gspn2.layers.norm import LayerNorm2d, layer_norm_last_dim
from gspn2.layers.pointwise import (
    ChunkedConv1x1,
    Conv1x1,
    NormParams,
    cpp_ops_available,
    from_rows,
    gelu_linear,
    norm_linear,
    recomputed_silu,
    rows_linear,
    to_rows,
)

__all__ = [
    "ChunkedConv1x1",
    "Conv1x1",
    "LayerNorm2d",
    "NormParams",
    "PointwiseMlp",
    "cpp_ops_available",
    "from_rows",
    "gelu_linear",
    "layer_norm_last_dim",
    "norm_linear",
    "recomputed_silu",
    "rows_linear",
    "to_rows",
]
