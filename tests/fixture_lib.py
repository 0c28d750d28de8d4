"""What the family fixture generators (``tests/gen_qwen2.py``, ``gen_qwen3.py``, ``gen_phi3.py``,
``gen_gemma.py``) share: the weights' recipe (seeded, norms perturbed, every value an f16 one),
llama.cpp's converter and quantiser out of the pinned sdist, the reference logits of transformers
and llama.cpp, and the measurements each folder's ``stats.json`` records.

Import it before torch: it sets the thread counts the references were made with.

Why f16: the fixtures must fit the repository's test-data budget. Every weight is rounded to f16
before anything is computed, so the f16 safetensors file, the F16 GGUF (the converter keeps the
norms in f32, exactly) and transformers' f32 reference logits all hold or use the same numbers,
and the tests hold the engine to the same 1e-3 as with f32 files.
"""

from __future__ import annotations

import os

# Two threads everywhere, as for the other references (set before torch starts its pools).
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import hashlib
import json
import re
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

import fetch_vocab  # the sdist's pinned sha256
import numpy as np
import safetensors
import tokenizers
import torch
import transformers

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"
SDIST = REPO / ".cache" / "wheels" / "llama_cpp_python-0.3.36.tar.gz"
VENDOR = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
# The GGUF copies of every family: the f16 weights as they are (llama.cpp's converter), and
# llama.cpp's 8-bit blocks (its quantiser, from the F16 file).
GGUF_TYPES = ["F16", "Q8_0"]
# Perturbed norm weights sit on this grid, so that they, and the 1 + w gemma's converter
# stores, are exact in f16.
NORM_GRID = 2.0**-8


def start() -> Path:
    """Two torch threads, and the converter unpacked; returns the converter's folder."""
    torch.set_num_threads(2)
    return unpack_llamacpp()


def unpack_llamacpp() -> Path:
    """The converter, its ``conversion`` package and gguf-py, out of the sdist, into
    ``.cache/fixture-llamacpp/``; gguf-py goes first on ``sys.path``, as the converter puts it."""
    root = REPO / ".cache" / "fixture-llamacpp" / VENDOR
    if not (root / "convert_hf_to_gguf.py").exists():
        digest = hashlib.sha256(SDIST.read_bytes()).hexdigest()
        if digest != fetch_vocab.SHA256:
            raise SystemExit(f"{SDIST}: expected sha256 {fetch_vocab.SHA256}, got {digest}")
        with tarfile.open(SDIST) as tf:
            members = [
                m
                for m in tf.getmembers()
                if m.name == VENDOR + "convert_hf_to_gguf.py"
                or m.name.startswith(VENDOR + "conversion/")
                or m.name.startswith(VENDOR + "gguf-py/")
            ]
            tf.extractall(root.parents[2], members=members, filter="data")
    sys.path.insert(0, str(root / "gguf-py"))
    return root


def clean(out: Path) -> None:
    """An empty `out` but for its README (everything else there is generated)."""
    out.mkdir(parents=True, exist_ok=True)
    for p in out.iterdir():
        if p.name != "README.md":
            p.unlink()


def perturb_norms(model: torch.nn.Module, lo: float, hi: float) -> None:
    """Every norm weight drawn again in [lo, hi] from the seeded stream (the default init
    leaves them at 1 or 0, which would hide a missing norm weight), on the NORM_GRID."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(lo, hi)
                p.copy_(torch.round(p / NORM_GRID) * NORM_GRID)


def round_to_f16(model: torch.nn.Module) -> None:
    """Every parameter rounded to the nearest f16 (kept in f32): the weights every file holds."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.float16).to(torch.float32))


def save_f16(model: torch.nn.Module, out: Path) -> None:
    """`model` (f16 values in f32) saved by transformers as f16 safetensors, losslessly."""
    # The tensors alone are cast: the model itself stays f32 (casting it would round its RoPE
    # frequency buffers too).
    # A tied head shares the embedding's storage and is not written twice.
    half, seen = {}, set()
    for k, v in model.state_dict().items():
        if v.data_ptr() not in seen:
            seen.add(v.data_ptr())
            half[k] = v.to(torch.float16)
    model.save_pretrained(out, state_dict=half)
    cfg = json.loads((out / "config.json").read_text())
    cfg["dtype"] = "float16"
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def logits(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    """transformers' f32 logits for every position of `ids`."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=False).logits[0]
    return out.float().numpy().astype("<f4")


def logits_f64(load: Callable, ids: list[int]) -> np.ndarray:
    """The forward pass of `load(None)` (a copy of the model) in f64: the f32 noise floor."""
    with torch.no_grad():
        return load(None).double()(torch.tensor([ids]), use_cache=False).logits[0].numpy()


def greedy(model: torch.nn.Module, ids: list[int], steps: int) -> tuple[list[int], list[float]]:
    """`steps` argmax tokens after `ids`, each from a full forward pass over everything so far,
    with each step's top-1/top-2 margin."""
    seq, out, gaps = list(ids), [], []
    for _ in range(steps):
        last = logits(model, seq)[-1].astype(np.float64)
        top = np.sort(last)
        gaps.append(float(top[-1] - top[-2]))
        nxt = int(last.argmax())
        out.append(nxt)
        seq.append(nxt)
    return out, gaps


def margins(a: np.ndarray) -> list[float]:
    """Top-1 minus top-2 at each position."""
    s = np.sort(a.astype(np.float64), -1)
    return [float(m) for m in s[:, -1] - s[:, -2]]


def stats(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return {
        "max_abs": float(d.max()),
        "mean_abs": float(d.mean()),
        "argmax_agree": int((a.argmax(-1) == b.argmax(-1)).sum()),
    }


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def convert(
    src: Path, outtype: str, dest: Path, root: Path, pre: str | None = None, args=()
) -> None:
    """Run the vendored converter on the transformers folder `src`. Its pre-tokenizer check
    hashes the ids of a fixed text and knows only real vocabularies; a tiny vocabulary with a
    real family's exact pre-tokenizer names that family as `pre`."""
    patch = (
        f"import conversion.base as b\nb.TextModel.get_vocab_base_pre = lambda s, t: {pre!r}\n"
        if pre
        else ""
    )
    boot = (
        "import sys\n"
        f"sys.path.insert(0, {str(root)!r})\n"
        f"sys.path.insert(1, {str(root / 'gguf-py')!r})\n"
        f"{patch}"
        "import convert_hf_to_gguf as c\n"
        f"sys.argv = ['convert_hf_to_gguf.py', {str(src)!r}, '--outtype', {outtype!r},"
        f" '--outfile', {str(dest)!r}, *{list(args)!r}]\n"
        "c.main()\n"
    )
    subprocess.run([sys.executable, "-c", boot], check=True, cwd=root, capture_output=True)


def gguf_state_dict(
    path: Path,
    gguf_to_hf: dict[str, str],
    norm_shift: float = 0.0,
    fix: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of the GGUF dequantised to f32 by gguf-py, under its transformers name (norm
    weights less `norm_shift`, which gemma's converter adds), and each tensor's GGUF type. A
    tied head is the embedding's tensor under both names. LongRoPE's factor lists, which the
    converter writes as tensors from the config, are left out. `fix` rewrites the result where
    the converter changed more than names (the experts' stacking, llama's q/k row order)."""
    import gguf

    reader = gguf.GGUFReader(path)
    sd, types = {}, {}
    for t in reader.tensors:
        if t.name.startswith("rope_factors_"):
            continue  # LongRoPE's lists: the config's, not parameters of the model
        parts = t.name.split(".")
        if parts[0] == "blk":
            hf = f"model.layers.{parts[1]}." + gguf_to_hf[".".join(parts[2:])]
        else:
            hf = gguf_to_hf[t.name]
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = [int(n) for n in reversed(t.shape.tolist())]
        x = torch.from_numpy(np.array(data, dtype=np.float32).reshape(shape))
        sd[hf] = x - norm_shift if hf.endswith("norm.weight") else x
        types[t.name] = t.tensor_type.name
    if "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    if fix is not None:
        sd = fix(sd)
    return sd, types


def gguf_metadata(path: Path, arch: str, keys: tuple[str, ...]) -> dict[str, object]:
    """The GGUF's `arch.*` keys, its file type and the named tokenizer keys."""
    import gguf

    reader = gguf.GGUFReader(path)
    keep = {}
    for name, field in reader.fields.items():
        if name.startswith((arch + ".", "general.architecture", "general.file_type")) or (
            name in keys
        ):
            keep[name] = field.contents()
    keep["n_tokens"] = len(reader.fields["tokenizer.ggml.tokens"].contents())
    return keep


def llamacpp_logits(path: Path, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits for every position of `ids` (llama-cpp-python 0.3.36)."""
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(path),
        logits_all=True,
        n_ctx=64,
        n_threads=2,
        n_batch=64,
        verbose=False,
        seed=0,
    )
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype="<f4")


def write_ggufs(
    out: Path,
    stem: str,
    model: torch.nn.Module,
    ids: list[int],
    ref: np.ndarray,
    root: Path,
    *,
    load: Callable[[dict | None], torch.nn.Module],
    gguf_to_hf: dict[str, str],
    metadata: Callable[[Path], dict[str, object]],
    norm_shift: float = 0.0,
    pre: str | None = None,
    args=(),
    llamacpp: bool = True,
    fix: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
    types: list[str] = GGUF_TYPES,
) -> dict[str, object]:
    """`stem-F16.gguf` (or those of `types`, F16 first) with what each is measured against (see
    `measure_gguf`): F16 converted from `out` by llama.cpp's converter, every other type
    quantised from that file by llama.cpp's quantiser (`quantize`), as llama.cpp's users make
    them."""
    entries: dict[str, object] = {}
    assert not types or types[0] == "F16", types
    for ty in types:
        dest = out / f"{stem}-{ty}.gguf"
        if ty == "F16":
            convert(out, "f16", dest, root, pre, args)
        else:
            quantize(out / f"{stem}-F16.gguf", dest, ty)
        entries[ty] = measure_gguf(
            out,
            dest,
            ty,
            model,
            ids,
            ref,
            load=load,
            gguf_to_hf=gguf_to_hf,
            metadata=metadata,
            norm_shift=norm_shift,
            llamacpp=llamacpp,
            fix=fix,
        )
    return entries


def measure_gguf(
    out: Path,
    dest: Path,
    ty: str,
    model: torch.nn.Module,
    ids: list[int],
    ref: np.ndarray,
    *,
    load: Callable[[dict | None], torch.nn.Module],
    gguf_to_hf: dict[str, str],
    metadata: Callable[[Path], dict[str, object]],
    norm_shift: float = 0.0,
    llamacpp: bool = True,
    fix: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
) -> dict[str, object]:
    """The GGUF `dest` (of type `ty`) measured, its logits written to `out`. An F16 file holds
    the model's tensors bit for bit (its logits in transformers are `ref` exactly); a quantised
    file's weights, dequantised by gguf-py, give transformers' `hf_dequant_logits_{ty}.npy`;
    llama.cpp's logits for the file go to `llamacpp_logits_{ty}.npy` when `llamacpp`."""
    want = model.state_dict()
    sd, types = gguf_state_dict(dest, gguf_to_hf, norm_shift, fix)
    entry: dict[str, object] = {
        "bytes": dest.stat().st_size,
        "sha256": sha256(dest),
        "types": dict(sorted(types.items())),
        "metadata": metadata(dest),
    }
    if ty == "F16":
        # The converter writes these rows as they are (or `fix` undoes what it did).
        assert sorted(sd) == sorted(want), sorted(set(sd) ^ set(want))
        for k, v in want.items():
            assert torch.equal(sd[k], v), f"the F16 GGUF does not hold {k} bit for bit"
        entry["tensors_equal_safetensors"] = True
    got = logits(load(sd), ids)
    if ty == "F16":
        assert np.array_equal(got, ref)
    else:
        np.save(out / f"hf_dequant_logits_{ty}.npy", got)
        entry["hf_dequant_top1_minus_top2_min"] = min(margins(got))
    entry["hf_dequant_vs_hf_logits"] = stats(ref, got)
    if llamacpp:
        lc = llamacpp_logits(dest, ids)
        np.save(out / f"llamacpp_logits_{ty}.npy", lc)
        entry["llamacpp_vs_hf_logits"] = stats(ref, lc)
        entry["llamacpp_vs_hf_dequant_logits"] = stats(got, lc)
    return entry


# llama.cpp's quantiser's file types (`llama_ftype`), by the name its `llama-quantize` tool
# gives them.
FTYPES = {"Q8_0": 7, "Q4_K_M": 15}


def quantize(src: Path, dest: Path, ftype: str) -> None:
    """`src` (an F16 GGUF) quantised by llama.cpp (`llama_model_quantize`, 2 threads, no
    importance matrix) to `ftype`, whose mix of block types is llama.cpp's own choice per tensor
    (it leaves 1-D tensors and the MoE routers as they are, and falls back to another type for
    rows not a multiple of the block wide)."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dest).encode(), ctypes.byref(params))
    assert rc == 0, f"llama_model_quantize {src} -> {ftype}: {rc}"


def files(out: Path) -> dict[str, dict[str, object]]:
    """Size and sha256 of every generated file of `out` (not the README, not stats.json)."""
    return {
        p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)}
        for p in sorted(out.iterdir())
        if p.suffix != ".md" and p.name != "stats.json"
    }


def versions(root: Path, **extra: str) -> dict[str, object]:
    """The versions every reference was made with."""
    v: dict[str, object] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "safetensors": safetensors.__version__,
        "numpy": np.__version__,
        **extra,
        "converter": "convert_hf_to_gguf.py of llama-cpp-python 0.3.36 (sdist, vendored)",
        "gguf-py": re.search(
            r'^version = "(.+)"', (root / "gguf-py/pyproject.toml").read_text(), re.M
        )[1],
    }
    import llama_cpp

    v["llama-cpp-python"] = llama_cpp.__version__
    return v


def write_stats(out: Path, report: dict[str, object]) -> None:
    (out / "stats.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")


# Mixture-of-experts fixtures (``gen_qwen3moe.py``, ``gen_mixtral.py``): the converter stacks each
# layer's experts into one 3-D tensor per projection; transformers 5 holds gate and up fused in
# one ``gate_up_proj`` of [experts, 2 * ffn, hidden] (and writes them per expert on save).
MOE_GGUF_TO_HF = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_exps",
    "ffn_up_exps.weight": "mlp.experts.up_exps",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
}


def fuse_experts(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The GGUF's stacked gate and up experts as transformers' fused ``gate_up_proj``."""
    out = {}
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_exps"):
            up = sd[k.replace("gate_exps", "up_exps")]
            out[k.replace("gate_exps", "gate_up_proj")] = torch.cat([v, up], dim=1)
        elif not k.endswith("mlp.experts.up_exps"):
            out[k] = v
    return out


def routing(model: torch.nn.Module, ids: list[int]) -> dict[str, object]:
    """Which experts each layer's router picks at every position of `ids`, and how close the
    choice is: the smallest gap between the k-th and (k+1)-th router probability (a gap near 0
    would let rounding pick another expert). Only the layers with a router count (a Qwen3-MoE
    may give some layers a dense MLP); ``layers`` lists them when some layer has none."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def hook(_m, _inp, out):
        router_logits, _scores, indices = out
        seen.append((router_logits.detach().float(), indices.detach()))

    layers = model.model.layers
    routed = [i for i, layer in enumerate(layers) if hasattr(layer.mlp, "gate")]
    handles = [layers[i].mlp.gate.register_forward_hook(hook) for i in routed]
    try:
        logits(model, ids)
    finally:
        for h in handles:
            h.remove()
    k = model.config.num_experts_per_tok
    chosen, gaps = [], []
    for router_logits, indices in seen:
        probs = torch.sort(torch.softmax(router_logits, -1), -1, descending=True).values
        gaps.append(float((probs[:, k - 1] - probs[:, k]).min()))
        chosen.append([sorted(int(e) for e in row) for row in indices])
    out: dict[str, object] = {"experts": chosen, "kth_gap_min": gaps}
    if len(routed) < len(layers):
        out["layers"] = routed
    return out


def check_routing(r: dict[str, object], n_experts: int) -> None:
    """Routing that matters: every expert is used, and tokens of one layer pick different sets."""
    for layer in r["experts"]:
        used = {e for row in layer for e in row}
        assert used == set(range(n_experts)), f"experts never routed to: {used}"
        assert len({tuple(row) for row in layer}) > 2, "every token picks the same experts"
