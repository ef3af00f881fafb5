"""What ``torch.compile`` builds for an NVIDIA H200, worked out on a machine without a GPU.

Dynamo, AOTAutograd's partitioner and Inductor run as they would for a CUDA device, on fake tensors (shapes,
no data): the model's parameters and the input batch are FakeTensors on ``cuda``; a small interposed library
(``scripts/offline_cuda/``, built on first use with ``c++`` and the CUDA runtime's headers) answers torch's
device queries as one H200 (sm_90, 132 SMs); Inductor writes its Triton kernels and wrapper code and compiles
none of them. Reported per model:

* **saved**: what the compiled forward keeps for the backward (the tensors the forward graph returns besides
  the model's outputs, once per storage, parameters excluded): the figure ``scripts/activation_memory.py
  --compile`` measures on the GPU;
* **Inductor's kernels**: launches per step in the forward and backward graphs, the bytes Inductor counts for
  them (each input read and each output written once per launch) and that traffic at ``--tbps`` TB/s, the
  memory floor of the step's Triton kernels (``scripts/inductor_floors.py`` sets it against measured times);
* the other calls of the generated code: GEMMs, convolutions and gspn2's ops.

    python scripts/inductor_offline.py --models gspn2_tiny swin_tiny_patch4_window7_224 convnext_tiny
    GSPN2_RECOMPUTE=all python scripts/inductor_offline.py --models gspn2_tiny --top 10 --code-dir runs/code

The step is ``gspn2.benchmark.model_step``'s model: bf16 autocast, channels_last, ``torch.compile`` in its
default mode (``reduce-overhead`` adds CUDA graphs around the same code); training compiles the forward and
backward graphs (the loss and the optimizer stay outside, as there). Unlike a GPU run, Inductor makes no
choice that times kernels on the device (``shape_padding`` and the joint graph's constant folding, which runs
small ops on the device, are off), and attention backends are chosen from the H200's properties alone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

_MARK = "GSPN2_OFFLINE_CUDA"  # set in the re-executed process that runs with the interposed library
_SOURCES = Path(__file__).resolve().parent / "offline_cuda"


# ------------------------------------------------------------------------------------------------------------
# The interposed library (built here, loaded by the re-executed process)
# ------------------------------------------------------------------------------------------------------------


def _runtime_headers(cuda_version: str) -> Path:
    """The directory of ``cuda_runtime_api.h`` of CUDA ``cuda_version``'s major release (with the ``crt/``
    headers it includes): ``$CUDA_HOME``'s, ``/usr/local/cuda``'s, else a CUDA runtime wheel's.
    ``cudaDeviceProp``'s layout must match the runtime torch uses, so the headers' major version is
    checked."""
    import importlib.util

    major = cuda_version.split(".")[0]
    cuda_home = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    candidates = [cuda_home / "include", Path("/usr/local/cuda/include")]
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidates.append(Path(root) / f"cu{major}" / "include")
        candidates.append(Path(root) / "cuda_runtime" / "include")
    for path in candidates:
        header = path / "cuda_runtime_api.h"
        if header.is_file() and (path / "crt" / "host_defines.h").is_file():
            found = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", header.read_text(errors="replace"))
            if found and int(found.group(1)) // 1000 == int(major):
                return path
    raise RuntimeError(
        f"no cuda_runtime_api.h of CUDA {major}.x found (looked in {', '.join(map(str, candidates))}): "
        "install torch's CUDA runtime wheel or set CUDA_HOME"
    )


def build_interposer(cache: Path | None = None) -> Path:
    """Builds (once per source, torch version and headers) ``libinterpose.so`` and the stub ``libcuda.so.1``
    into a cache directory and returns it."""
    import torch

    if torch.version.cuda is None:
        raise RuntimeError("inductor_offline.py needs a CUDA build of torch (torch.version.cuda is None)")
    headers = _runtime_headers(torch.version.cuda)
    cxx, cc = shutil.which("c++") or shutil.which("g++"), shutil.which("cc") or shutil.which("gcc")
    if cxx is None or cc is None:
        raise RuntimeError("inductor_offline.py needs a C and a C++ compiler (c++/g++ and cc/gcc) on PATH")
    key = hashlib.sha256()
    for name in ("interpose.cpp", "libcuda_stub.c"):
        key.update((_SOURCES / name).read_bytes())
    key.update(f"{torch.__version__}|{headers}".encode())
    base = cache or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gspn2" / "offline_cuda"
    out = base / key.hexdigest()[:16]
    lib, stub = out / "libinterpose.so", out / "driver" / "libcuda.so.1"
    if not (lib.is_file() and stub.is_file()):
        stub.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([cxx, "-shared", "-fPIC", "-O1", f"-I{headers}", "-o", str(lib),
                        str(_SOURCES / "interpose.cpp")], check=True)
        subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(stub), str(_SOURCES / "libcuda_stub.c")],
                       check=True)
    return out


# ------------------------------------------------------------------------------------------------------------
# In the re-executed process: torch as if one H200 were there
# ------------------------------------------------------------------------------------------------------------


def pretend_h200() -> None:
    """Python-side answers for an H200 (sm_90) and code generation without compiling kernels. Private torch
    and Triton APIs of the versions this repository pins; tests/scripts/test_inductor_offline.py runs it."""
    import types

    import torch
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    import torch.cuda.amp.common as amp_common
    from torch._dynamo import device_interface
    from torch._inductor import async_compile
    from torch._inductor.runtime import triton_helpers
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver
    from triton.runtime import driver

    props = types.SimpleNamespace(
        name="NVIDIA H200", major=9, minor=0, multi_processor_count=132, regs_per_multiprocessor=65536,
        max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32,
        total_memory=141 << 30,
        shared_memory_per_block_optin=227 * 1024, shared_memory_per_multiprocessor=228 * 1024,
        L2_cache_size=60 << 20, gcnArchName="",
    )
    cuda = device_interface.CudaInterface
    cuda.get_device_properties = staticmethod(lambda device=None: props)
    cuda.get_compute_capability = staticmethod(lambda device=None: 90)
    cuda.is_available = staticmethod(lambda: True)
    cuda.current_device = staticmethod(lambda: 0)
    cuda.device_count = staticmethod(lambda: 1)
    cuda.is_bf16_supported = staticmethod(lambda including_emulation=False: True)
    torch.cuda.get_device_properties = lambda device=None: props
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    torch.cuda.current_device = lambda: 0
    torch.cuda.device_count = lambda: 1
    torch.cuda.is_bf16_supported = lambda *args, **kwargs: True
    # Code that would make real CUDA tensors (Inductor's pattern set-up, Dynamo's stream tracking) asks
    # is_available(): no. Autocast asks whether AMP is impossible: also no.
    torch.cuda.is_available = lambda: False
    torch.accelerator.is_available = lambda *args, **kwargs: False
    torch.cuda._lazy_init = lambda: None
    amp_common.amp_definitely_not_available = lambda: False
    rng = torch.zeros(16, dtype=torch.uint8)
    torch.cuda.get_rng_state = torch.cuda.random.get_rng_state = lambda device="cuda": rng
    torch.cuda.set_rng_state = torch.cuda.random.set_rng_state = lambda state, device="cuda": None

    class Sm90Driver(CudaDriver):
        """Triton's CUDA driver, answering for an sm_90 GPU without loading the driver library."""

        def __init__(self) -> None:  # no driver to open
            pass

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_device_interface(self):
            return torch.cuda

        def get_active_torch_device(self):
            return torch.device("cuda", 0)

    driver.set_active(Sm90Driver())
    driver._default = driver._active

    class NotCompiled:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getattr__(self, attr):
            raise RuntimeError(f"{self.name} was generated but not compiled (inductor_offline.py)")

    async_compile.AsyncCompile.triton = lambda self, kernel_name, source_code, device_str="cuda": NotCompiled(
        kernel_name
    )
    triton_helpers.set_driver_to_gpu = lambda: None
    functorch_config.force_non_lazy_backward_lowering = True  # the backward graph at the first call
    inductor_config.compile_threads = 1
    inductor_config.force_disable_caches = True
    inductor_config.benchmark_kernel = True  # each kernel's byte count in its metadata
    inductor_config.shape_padding = False  # decided by timing GEMMs on the device
    inductor_config.joint_graph_constant_folding = False  # runs small ops on the device


def fake_cuda_model(model, mode):
    """``model``'s parameters and buffers replaced by FakeTensors on ``cuda`` of ``mode`` (4-D parameters in
    channels_last, as ``model.to(memory_format=torch.channels_last)`` leaves them)."""
    import torch

    with mode:
        for module in model.modules():
            for key, p in list(module._parameters.items()):
                if p is not None:
                    q = torch.empty_strided(p.shape, p.stride(), device="cuda", dtype=p.dtype)
                    if q.dim() == 4:
                        q = q.contiguous(memory_format=torch.channels_last)
                    module._parameters[key] = torch.nn.Parameter(q, p.requires_grad)
            for key, b in list(module._buffers.items()):
                if b is not None:
                    module._buffers[key] = torch.zeros(b.shape, device="cuda", dtype=b.dtype)
    return model


# The wrapper's kernel definitions: variable name, kernel source (with its metadata).
_KERNEL_DEF = re.compile(
    r"^(triton_\w+) = async_compile\.triton\('triton_\w+', '''(.*?)''', device_str='cuda'\)",
    re.DOTALL | re.MULTILINE,
)
_NUM_GB = re.compile(r"'kernel_num_gb': ([0-9.eE+-]+)")
_EXTERN = re.compile(r"\b(extern_kernels\.\w+|torch\.ops\.\w+\.\w+)(?:\.default)?\(")
#: A sum over a buffer's rows in the wrapper itself (ATen): how a mix-order reduction adds its partial rows.
_WRAPPER_SUM = re.compile(r"\.sum\(dim=")
_BUFFER = re.compile(r"\b(\w+) = empty_strided_cuda\(\(([\d, ]*)\), \([\d, ]*\), torch\.(\w+)\)")
_VIEW = re.compile(r"\b(\w+) = reinterpret_tensor\((\w+), \(([\d, ]*)\)")
_REUSE = re.compile(r"\b(\w+) = (\w+); del \w+  # reuse")
_ADDMM = re.compile(r"extern_kernels\.addmm\((\w+), .*out=(\w+)\)")
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


def matrix_addmm_bytes(call: str) -> tuple:
    """``(calls, bytes)`` of the wrapper's ``addmm`` calls whose input is a matrix (a buffer of two
    dimensions, not a bias vector): ATen runs each as a copy of that matrix into the output and a GEMM with
    beta 1, which reads and writes it three times more than the GEMM alone (copy read and write, beta read);
    none of it is in the Triton figures. An input whose shape the wrapper does not declare, or whose dtype
    neither it nor the call's output declares, is not counted."""
    shapes = {}
    for line in call.splitlines():
        for m in _BUFFER.finditer(line):
            dims = tuple(int(d) for d in m.group(2).split(",") if d.strip())
            shapes[m.group(1)] = (dims, _DTYPE_BYTES.get(m.group(3), 0))
        for m in _VIEW.finditer(line):  # a view of a custom op's output keeps its shape, dtype unknown (0)
            dims = tuple(int(d) for d in m.group(3).split(",") if d.strip())
            shapes[m.group(1)] = (dims, shapes.get(m.group(2), ((), 0))[1])
        for m in _REUSE.finditer(line):
            if m.group(2) in shapes:
                shapes[m.group(1)] = shapes[m.group(2)]
    calls = nbytes = 0
    for m in _ADDMM.finditer(call):
        dims, size = shapes.get(m.group(1), ((), 0))
        size = size or shapes.get(m.group(2), ((), 0))[1]  # addmm's output has its input's dtype
        if len(dims) == 2 and size:
            calls += 1
            nbytes += 3 * dims[0] * dims[1] * size
    return calls, nbytes


def wrapper_calls(code: str) -> dict:
    """Launches and bytes of the Triton kernels that the generated wrapper ``code`` runs per call, and its
    other calls (``extern_kernels.mm``, ``torch.ops.gspn2.propagate``, ...)."""
    start = code.rfind("def call(self, args)")
    call = code[start if start >= 0 else code.rindex("\ndef call("):]
    gb = {}
    for m in _KERNEL_DEF.finditer(code):
        found = _NUM_GB.search(m.group(2))
        gb[m.group(1)] = float(found.group(1)) if found else 0.0
    launches = Counter(re.findall(r"\b(triton_\w+)\.run\(", call))
    kernels = {k: {"launches": n, "gb": gb.get(k, 0.0) * n} for k, n in launches.items()}
    other = Counter(_EXTERN.findall(call))
    lines = [line for line in call.splitlines() if not line.lstrip().startswith("#")]
    sums = sum(len(_WRAPPER_SUM.findall(line)) for line in lines)
    if sums:
        other["aten.sum (wrapper)"] = sums
    calls, nbytes = matrix_addmm_bytes("\n".join(lines))
    if calls:
        other["extern_kernels.addmm with a matrix input"] = calls
    return {"kernels": kernels, "other": dict(other), "addmm_matrix_gb": nbytes / 1e9}


def compile_offline(name: str, task: str, resolution: int, batch: int, code_dir: Path | None = None) -> dict:
    """Compiles model ``name`` for the H200 with fake tensors; returns the graphs' saved bytes and calls."""
    import torch
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch._subclasses.fake_tensor import FakeTensorMode

    from gspn2.benchmark import model_at

    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        user_outputs = len(next(n for n in gm.graph.nodes if n.op == "output").args[0])

        def inner(graph, inputs, **kwargs):
            kind = "backward" if kwargs.get("is_backward") else "forward"
            saved = 0
            if kind == "forward" and not kwargs.get("is_inference"):
                outputs = next(n for n in graph.graph.nodes if n.op == "output").args[0]
                inputs_storage = {id(n.meta["val"].untyped_storage()) for n in graph.graph.nodes
                                  if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)}
                seen = set()
                for node in outputs[user_outputs:]:
                    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
                    if not isinstance(value, torch.Tensor):
                        continue
                    storage = id(value.untyped_storage())
                    if storage not in inputs_storage and storage not in seen:
                        seen.add(storage)
                        saved += value.untyped_storage().nbytes()
            compiled = compile_fx_inner(graph, inputs, **kwargs)
            graphs.append(dict(kind=kind, saved_bytes=saved, **wrapper_calls(compiled.source_code)))
            if code_dir is not None:
                code_dir.mkdir(parents=True, exist_ok=True)
                (code_dir / f"{name}_{task}_{len(graphs) - 1}_{kind}.py").write_text(compiled.source_code)
            return compiled

        return compile_fx(gm, example_inputs, inner_compile=inner)

    train = task == "train"
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = fake_cuda_model(model_at(name, resolution).train(train), mode)
    with mode:
        x = torch.empty(batch, 3, resolution, resolution, device="cuda").to(memory_format=torch.channels_last)
    compiled = torch.compile(model, backend=backend)
    try:
        with torch.inference_mode(not train), torch.autocast("cuda", dtype=torch.bfloat16):
            compiled(x)
    except Exception:  # running the generated code needs the GPU: expected once the graphs are built
        if not graphs or (train and not any(g["kind"] == "backward" for g in graphs)):
            raise
    return {"model": name, "task": task, "resolution": resolution, "batch": batch, "graphs": graphs}


def summary(result: dict, tbps: float) -> dict:
    """Totals of one ``compile_offline`` result: saved bytes, launches and GB per graph kind, other calls."""
    out = {"saved_mib": sum(g["saved_bytes"] for g in result["graphs"]) / 2**20}
    other = Counter()
    for kind in ("forward", "backward"):
        kernels = [k for g in result["graphs"] if g["kind"] == kind for k in g["kernels"].values()]
        out[f"{kind}_launches"] = sum(k["launches"] for k in kernels)
        out[f"{kind}_gb"] = sum(k["gb"] for k in kernels)
    for g in result["graphs"]:
        other.update(g["other"])
    out["floor_ms"] = (out["forward_gb"] + out["backward_gb"]) / tbps
    out["addmm_matrix_gb"] = sum(g.get("addmm_matrix_gb", 0.0) for g in result["graphs"])
    out["other"] = dict(sorted(other.items()))
    return out


def _environment() -> dict:
    """Versions, the commit and the gspn2 options of the environment, for the JSON output."""
    import timm
    import torch
    import triton

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_SOURCES, capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    options = {k: v for k, v in sorted(os.environ.items()) if k.startswith(("GSPN2_", "TORCHINDUCTOR_"))}
    return {"torch": torch.__version__, "timm": timm.__version__, "triton": triton.__version__,
            "commit": commit, "options": options}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["gspn2_tiny"])
    parser.add_argument("--task", choices=["train", "infer"], default="train")
    parser.add_argument("--resolution", type=int, default=224)
    parser.add_argument("--batch", type=int, default=None, help="default: 128 for train, 256 for infer")
    parser.add_argument("--tbps", type=float, default=4.2, help="DRAM rate for the floor, TB/s (default 4.2)")
    parser.add_argument("--top", type=int, default=0, help="also list the N kernels with the most bytes")
    parser.add_argument("--code-dir", type=Path, default=None, help="write each graph's generated code here")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--inductor", nargs="+", default=[], metavar="KEY=VALUE",
                        help="torch._inductor.config settings for the compilation, Python literals "
                             "(combo_kernels=True, triton.mix_order_reduction_split_size=128)")
    parser.add_argument("--child-json", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for flag in ("resolution", "batch", "top"):
        value = getattr(args, flag)
        if value is not None and value < (0 if flag == "top" else 1):
            parser.error(f"--{flag} must be {'>= 0' if flag == 'top' else 'positive'}, got {value}")
    if args.tbps <= 0:
        parser.error(f"--tbps must be positive, got {args.tbps}")
    batch = args.batch or (128 if args.task == "train" else 256)

    if args.child_json is not None:  # one model, in the process with the interposed library
        if os.environ.get(_MARK) != "1":
            parser.error("--child-json is internal: the process must run with the interposed library")
        import warnings

        warnings.filterwarnings("ignore")
        pretend_h200()
        import torch._inductor.config

        from gspn2.benchmark import inductor_config

        torch._inductor.config.patch(inductor_config(args.inductor)).__enter__()  # one model, then exit
        from gspn2.inductor import compile_options  # gspn2's pass, as gspn2.inductor.compile applies it

        torch._inductor.config.patch(compile_options() or {}).__enter__()
        import gspn2.models  # noqa: F401  (registers the GSPN-2 models with timm)

        result = compile_offline(args.models[0], args.task, args.resolution, batch, args.code_dir)
        args.child_json.write_text(json.dumps(result))
        return

    from gspn2.benchmark import inductor_config

    try:
        inductor = inductor_config(args.inductor)
    except ValueError as e:
        parser.error(str(e))
    # Each model in a process of its own, started with the interposed library.
    lib = build_interposer()
    env = dict(os.environ, **{_MARK: "1"})
    env["LD_PRELOAD"] = ":".join(filter(None, [str(lib / "libinterpose.so"), env.get("LD_PRELOAD")]))
    env["LD_LIBRARY_PATH"] = ":".join(filter(None, [str(lib / "driver"), env.get("LD_LIBRARY_PATH")]))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            out = Path(tmp) / "result.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--models", name, "--task", args.task,
                   "--resolution", str(args.resolution), "--batch", str(batch), "--child-json", str(out)]
            if args.code_dir is not None:
                cmd += ["--code-dir", str(args.code_dir)]
            if args.inductor:
                cmd += ["--inductor", *args.inductor]
            done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  check=False)
            if done.returncode != 0:
                sys.exit(f"{name}: compiling for the H200 failed (exit {done.returncode}):\n"
                         f"{done.stdout[-4000:]}")
            result = json.loads(out.read_text())
            result["summary"] = summary(result, args.tbps)
            results.append(result)

    print(f"torch.compile for an H200 without one: {args.task}, batch {batch}, {args.resolution}^2, "
          f"bf16 autocast, channels_last; floor at {args.tbps} TB/s")
    print(f"{'model':32s} {'saved MiB':>10s} {'MiB/img':>8s} {'fwd launches':>12s} {'fwd GB':>7s} "
          f"{'bwd launches':>12s} {'bwd GB':>7s} {'floor ms':>8s}")
    for r in results:
        s = r["summary"]
        print(f"{r['model']:32s} {s['saved_mib']:10.1f} {s['saved_mib'] / batch:8.2f} "
              f"{s['forward_launches']:12d} {s['forward_gb']:7.2f} {s['backward_launches']:12d} "
              f"{s['backward_gb']:7.2f} {s['floor_ms']:8.2f}")
    for r in results:
        print(f"{r['model']}: " + ", ".join(f"{k} x{n}" for k, n in r["summary"]["other"].items()))
        if r["summary"]["addmm_matrix_gb"]:
            print(f"  ATen's copies inside the addmm calls with a matrix input (not in the Triton GB): "
                  f"{r['summary']['addmm_matrix_gb']:.2f} GB")
        if args.top:
            rows = [(k["gb"], k["launches"], name, g["kind"])
                    for g in r["graphs"] for name, k in g["kernels"].items()]
            for gb, n, name, kind in sorted(rows, reverse=True)[: args.top]:
                print(f"  {gb:8.3f} GB  x{n:<3d} {kind:8s} {name}")
    if args.json is not None:
        record = {"env": dict(_environment(), inductor=inductor), "task": args.task, "batch": batch,
                  "resolution": args.resolution,
                  "tbps": args.tbps, "results": results}
        args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
