"""Build of gspn2's CUDA extension (``gspn2._C``); the package metadata lives in pyproject.toml.

``pip install --no-build-isolation -e .`` (torch installed first, see scripts/setup_env.sh) compiles the
extension when nvcc is found: ``$CUDA_HOME/bin/nvcc``, else ``/usr/local/cuda/bin/nvcc``, else the
``nvcc`` on the PATH. No GPU is needed to build. Environment:

* ``GSPN2_BUILD_CUDA=0``: skip the extension (the pure-PyTorch reference still works everywhere).
* ``TORCH_CUDA_ARCH_LIST``: target architectures, default ``"8.0;9.0"`` (A100, H100/H200).
* ``MAX_JOBS``: parallel compile jobs (ninja).
* ``GSPN2_ABLATE``: profiling builds only, bits that skip parts of the propagation kernels (results are
  wrong; gspn2/csrc/propagate.h, ``PropagateParams::ablate``). Unset for every real build.
"""

from __future__ import annotations

import os
import shutil

from setuptools import setup

CSRC = os.path.join("gspn2", "csrc")


def _cuda_home() -> str | None:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
            return home
    if os.path.isfile("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda"
    nvcc = shutil.which("nvcc")
    if nvcc:
        return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    return None


def _extensions() -> tuple[list, dict]:
    if os.environ.get("GSPN2_BUILD_CUDA", "1") == "0":
        print("gspn2: GSPN2_BUILD_CUDA=0, not building the CUDA extension (reference backend only)")
        return [], {}
    home = _cuda_home()
    if home is None:
        print("gspn2: nvcc not found (set CUDA_HOME), not building the CUDA extension (reference backend only)")
        return [], {}
    try:
        import torch  # noqa: F401
    except ImportError:
        print(
            "gspn2: torch is not importable in the build environment, not building the CUDA extension; "
            "install torch first and use `pip install --no-build-isolation -e .`"
        )
        return [], {}
    # torch.utils.cpp_extension reads these when imported.
    os.environ["CUDA_HOME"] = home
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    ablate = os.environ.get("GSPN2_ABLATE", "").strip()
    if ablate and not ablate.isdigit():
        raise SystemExit(f"GSPN2_ABLATE must be a non-negative integer (profiling builds), got {ablate!r}")
    defines = [f"-DGSPN2_ABLATE={int(ablate)}"] if ablate else []
    print(f"gspn2: building the CUDA extension with {home}/bin/nvcc for {os.environ['TORCH_CUDA_ARCH_LIST']}")
    ext = CUDAExtension(
        name="gspn2._C",
        sources=[
            os.path.join(CSRC, "propagate.cpp"),
            os.path.join(CSRC, "propagate_general.cu"),
            os.path.join(CSRC, "propagate_streaming.cu"),
            os.path.join(CSRC, "propagate_cluster.cu"),
            os.path.join(CSRC, "propagate_short.cu"),
            os.path.join(CSRC, "dwconv.cpp"),
            os.path.join(CSRC, "dwconv_tile.cu"),
            os.path.join(CSRC, "dwconv_mma.cu"),
            os.path.join(CSRC, "rows.cpp"),
            os.path.join(CSRC, "layer_norm.cpp"),
            os.path.join(CSRC, "layer_norm_rows.cu"),
        ],
        include_dirs=[os.path.abspath(CSRC)],
        extra_compile_args={
            "cxx": ["-O3", *defines],
            "nvcc": ["-O3", "-lineinfo", "--threads=2"],
        },
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
