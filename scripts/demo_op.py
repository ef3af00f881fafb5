"""A short tour of the propagation operator: shapes, directions, chunks and gradients.

    python scripts/demo_op.py
"""

import time

import torch

from gspn2.ops import gspn_propagate, gspn_propagate_ref


def main() -> None:
    torch.manual_seed(0)
    B, C, H, W, K = 1, 8, 64, 64, 1
    x = torch.randn(B, C, H, W, requires_grad=True)
    lam = torch.rand(B, 4, C, H, W, requires_grad=True)
    gates = torch.randn(B, 4, 3, K, H, W, requires_grad=True)

    start = time.perf_counter()
    h = gspn_propagate(x, lam, gates)  # global scan, channel-shared affinity (K = 1)
    h.square().mean().backward()
    elapsed = time.perf_counter() - start
    print(f"x {tuple(x.shape)}, lam {tuple(lam.shape)}, gates {tuple(gates.shape)} -> h {tuple(h.shape)}")
    print(f"forward + backward on {h.device}: {elapsed * 1e3:.1f} ms (first call includes op setup)")
    print(f"grad norms: x {x.grad.norm():.3f}, lam {lam.grad.norm():.3f}, gates {gates.grad.norm():.3f}")

    with torch.no_grad():
        local = gspn_propagate(x, lam, gates, chunk=16)
        ref = gspn_propagate_ref(x, lam, gates)
    print(f"max |op - reference| = {(h - ref).abs().max():.2e}")
    names = ["left->right", "right->left", "top->bottom", "bottom->top"]
    for d, name in enumerate(names):
        print(f"  direction {d} ({name}): global mean |h| {h[:, d].abs().mean():.3f}, "
              f"chunk=16 mean |h| {local[:, d].abs().mean():.3f}")


if __name__ == "__main__":
    main()
