"""Small GGUF and safetensors fixtures, written by the reference writers (gguf-py's GGUFWriter and
the `safetensors` package), never by weightlift.

Run directly to write them into a folder: ``python tests/gen_fixtures.py OUTDIR``. The tests call
the same functions through session fixtures in ``conftest.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import safetensors
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from safetensors.numpy import save_file

# --------------------------------------------------------------------------------------------
# GGUF: every metadata value type and every tensor type

# One value per scalar type, plus strings and arrays (nested ones too). GGUFWriter refuses empty
# arrays, so there are none.
METADATA: dict[str, tuple[Any, V, V | None]] = {
    "test.u8": (200, V.UINT8, None),
    "test.i8": (-100, V.INT8, None),
    "test.u16": (60000, V.UINT16, None),
    "test.i16": (-30000, V.INT16, None),
    "test.u32": (4_000_000_000, V.UINT32, None),
    "test.i32": (-2_000_000_000, V.INT32, None),
    "test.f32": (0.1, V.FLOAT32, None),
    "test.bool_true": (True, V.BOOL, None),
    "test.bool_false": (False, V.BOOL, None),
    "test.string": ("héllo wörld ✓", V.STRING, None),
    "test.empty_string": ("", V.STRING, None),
    "test.u64": (2**64 - 1, V.UINT64, None),
    "test.i64": (-(2**63), V.INT64, None),
    "test.f64": (-1.5e300, V.FLOAT64, None),
    "test.array_u8": ([0, 1, 255], V.ARRAY, V.UINT8),
    "test.array_i32": ([-1, 0, 1, 2**31 - 1], V.ARRAY, V.INT32),
    "test.array_f32": ([0.5, -2.25, 1e-3], V.ARRAY, V.FLOAT32),
    "test.array_f64": ([0.1, 1e308], V.ARRAY, V.FLOAT64),
    "test.array_bool": ([True, False, True], V.ARRAY, V.BOOL),
    "test.array_str": (["a", "", "ünïcode", "tab\there"], V.ARRAY, V.STRING),
    "test.array_u64": ([2**64 - 1, 0], V.ARRAY, V.UINT64),
    "test.array_i64": ([-(2**63), 2**63 - 1], V.ARRAY, V.INT64),
    "test.array_nested": ([[1, 2], [3], [4, 5, 6]], V.ARRAY, None),
    "test.array_nested_str": ([["x", "y"], ["z"]], V.ARRAY, None),
}

# Types whose blocks are built from random bytes, with the byte offsets (within one block) of the
# scale fields that must be finite. Layouts from gguf-py's quants.py / ggml-common.h.
F16_SCALES: dict[Q, tuple[int, ...]] = {
    Q.Q2_K: (80, 82),  # scales[16] qs[64] d dmin
    Q.Q3_K: (108,),  # hmask[32] qs[64] scales[12] d
    Q.Q4_K: (0, 2),  # d dmin scales[12] qs[128]
    Q.Q5_K: (0, 2),  # d dmin scales[12] qh[32] qs[128]
    Q.Q6_K: (208,),  # ql[128] qh[64] scales[16] d
    Q.IQ2_XXS: (0,),
    Q.IQ2_XS: (0,),
    Q.IQ2_S: (0,),
    Q.IQ3_XXS: (0,),
    Q.IQ3_S: (0,),
    Q.IQ1_S: (0,),
    Q.IQ4_NL: (0,),
    Q.IQ4_XS: (0,),
    Q.TQ1_0: (52,),  # qs[48] qh[4] d
    Q.TQ2_0: (64,),  # qs[64] d
    Q.Q1_0: (0,),  # d qs[16]
}
# Types gguf.quants.quantize can produce from float data.
QUANTIZABLE = (Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.TQ1_0, Q.TQ2_0, Q.MXFP4)
# Types with odd scale encodings, built by hand below.
SPECIAL_RANDOM = (Q.IQ1_M, Q.MXFP4, Q.NVFP4, Q.Q8_K)

ROWS, COLS = 3, 512  # 512 is a multiple of every block size (32, 64, 128, 256)


def _finite_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """n small, finite, non-zero f16 scales as raw bytes, shape (n, 2)."""
    mag = rng.uniform(1e-3, 0.5, n) * rng.choice([-1.0, 1.0], n)
    return mag.astype(np.float16).view(np.uint8).reshape(n, 2)


def random_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random block bytes for `qtype` with every scale finite, shaped (rows, bytes_per_row)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // block
    data = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    if qtype in F16_SCALES:
        for off in F16_SCALES[qtype]:
            data[:, off : off + 2] = _finite_f16(rng, n_blocks)
    elif qtype == Q.IQ1_M:
        # The f16 scale is spread over the top nibbles of the last four u16 words.
        d = _finite_f16(rng, n_blocks).view(np.uint16).reshape(n_blocks)
        words = data[:, 48:56].copy().view(np.uint16)  # (n_blocks, 4)
        for i, shift in enumerate((12, 8, 4, 0)):
            nibble = ((d >> np.uint16(4 * i)) & np.uint16(0xF)).astype(np.uint16)
            words[:, i] = (words[:, i] & np.uint16(0x0FFF)) | (nibble << np.uint16(12))
            del shift
        data[:, 48:56] = words.view(np.uint8)
    elif qtype == Q.MXFP4:
        data[:, 0] = rng.integers(110, 140, n_blocks)  # E8M0 exponent; 0xFF would be NaN
    elif qtype == Q.NVFP4:
        pass  # four UE4M3 scales: every byte decodes to a finite value (0x7F reads as 0)
    elif qtype == Q.Q8_K:
        data[:, 0:4] = (
            rng.uniform(1e-3, 0.5, n_blocks).astype(np.float32).view(np.uint8).reshape(-1, 4)
        )
    else:
        raise ValueError(f"no random-block recipe for {qtype.name}")
    return data.reshape(rows, -1)


def write_all_types_gguf(path: Path, seed: int = 0) -> dict[str, Q]:
    """A GGUF with every metadata value type and one tensor per ggml type gguf-py can write.

    Returns {tensor name: ggml type}. Q8_1 is left out: gguf-py sizes its block at 40 bytes (an
    older layout with f32 scales), ggml at 36, so gguf-py cannot write a file llama.cpp reads.
    """
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch="testarch")
    for key, (value, vtype, sub) in METADATA.items():
        w.add_key_value(key, value, vtype, sub)
    made: dict[str, Q] = {}

    floats = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    w.add_tensor("t.F32", floats)
    made["t.F32"] = Q.F32
    w.add_tensor("t.F16", floats.astype(np.float16))
    made["t.F16"] = Q.F16
    w.add_tensor("t.F64", rng.standard_normal((2, 5)))
    made["t.F64"] = Q.F64
    for np_t, q in ((np.int8, Q.I8), (np.int16, Q.I16), (np.int32, Q.I32), (np.int64, Q.I64)):
        info = np.iinfo(np_t)
        w.add_tensor(f"t.{q.name}", rng.integers(info.min, info.max, (4, 6), dtype=np_t))
        made[f"t.{q.name}"] = q
    # Shapes of every rank, to check the ne -> numpy reversal.
    w.add_tensor("t.F32_1d", rng.standard_normal(7).astype(np.float32))
    made["t.F32_1d"] = Q.F32
    w.add_tensor("t.F32_3d", rng.standard_normal((2, 3, 4)).astype(np.float32))
    made["t.F32_3d"] = Q.F32
    w.add_tensor("t.F32_4d", rng.standard_normal((2, 3, 4, 5)).astype(np.float32))
    made["t.F32_4d"] = Q.F32

    for q in QUANTIZABLE:
        data = floats * 3.0 if q is not Q.TQ1_0 and q is not Q.TQ2_0 else np.sign(floats)
        w.add_tensor(f"t.{q.name}", gguf.quants.quantize(data, q), raw_dtype=q)
        made[f"t.{q.name}"] = q
    for q in [*F16_SCALES, *SPECIAL_RANDOM]:
        name = f"t.{q.name}" if f"t.{q.name}" not in made else f"t.{q.name}_random"
        w.add_tensor(name, random_blocks(q, ROWS, COLS, rng), raw_dtype=q)
        made[name] = q
    # A 3-D quantised tensor: rows span two outer dimensions.
    q3 = gguf.quants.quantize(rng.standard_normal((2, 3, 64)).astype(np.float32), Q.Q8_0)
    w.add_tensor("t.Q8_0_3d", q3, raw_dtype=Q.Q8_0)
    made["t.Q8_0_3d"] = Q.Q8_0

    _finish(w)
    return made


def _finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# --------------------------------------------------------------------------------------------
# A tiny llama in GGUF, with real llama metadata (for ModelSpec, roles and the tokenizer)

LLAMA = {
    "n_layers": 2,
    "hidden": 64,
    "ffn": 128,
    "heads": 4,
    "kv_heads": 2,
    "vocab": 40,
    "ctx": 256,
}


def write_tiny_llama_gguf(
    path: Path,
    seed: int = 1,
    *,
    poison: str | None = None,
    split_max_tensors: int = 0,
) -> dict[str, Q]:
    """A two-layer llama with llama.cpp's tensor names and a small BPE vocab.

    `poison="nan_f32"` puts a NaN at flat index 7 of ``blk.1.attn_norm.weight``
    (`poison="nan_output_norm"`: of ``output_norm.weight``);
    `poison="inf_q8_0"` sets the f16 scale of block 2 of ``blk.0.ffn_down.weight`` to +Inf.
    `split_max_tensors` writes a split set (``-00001-of-0000N.gguf``) through gguf-py.
    """
    rng = np.random.default_rng(seed)
    c = LLAMA
    w = gguf.GGUFWriter(path, arch="llama", split_max_tensors=split_max_tensors)
    w.add_name("tiny-llama-fixture")
    w.add_block_count(c["n_layers"])
    w.add_context_length(c["ctx"])
    w.add_embedding_length(c["hidden"])
    w.add_feed_forward_length(c["ffn"])
    w.add_head_count(c["heads"])
    w.add_head_count_kv(c["kv_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(c["hidden"] // c["heads"])
    w.add_vocab_size(c["vocab"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    tokens = [f"tok{i}" for i in range(c["vocab"])]
    w.add_token_list(tokens)
    w.add_token_types([1] * c["vocab"])
    w.add_token_merges([f"tok{i} tok{i + 1}" for i in range(10)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    made: dict[str, Q] = {}

    def add(name: str, shape: tuple[int, ...], q: Q) -> None:
        data = rng.standard_normal(shape).astype(np.float32) * 0.1
        if q == Q.F32:
            arr = data
            target = {"nan_f32": "blk.1.attn_norm.weight", "nan_output_norm": "output_norm.weight"}
            if name == target.get(poison or ""):
                arr = data.copy()
                arr.reshape(-1)[7] = np.nan
            w.add_tensor(name, arr)
        else:
            qd = gguf.quants.quantize(data, q)
            if poison == "inf_q8_0" and name == "blk.0.ffn_down.weight":
                blocks = qd.reshape(-1, 34)
                blocks[2, 0:2] = np.array([np.inf], dtype=np.float16).view(np.uint8)
            w.add_tensor(name, qd, raw_dtype=q)
        made[name] = q

    h, f, v = c["hidden"], c["ffn"], c["vocab"]
    kv = c["kv_heads"] * (h // c["heads"])
    add("token_embd.weight", (v, h), Q.Q8_0)
    for i in range(c["n_layers"]):
        add(f"blk.{i}.attn_norm.weight", (h,), Q.F32)
        add(f"blk.{i}.attn_q.weight", (h, h), Q.Q4_0)
        add(f"blk.{i}.attn_k.weight", (kv, h), Q.Q4_1)
        add(f"blk.{i}.attn_v.weight", (kv, h), Q.Q8_0)
        add(f"blk.{i}.attn_output.weight", (h, h), Q.Q5_0)
        add(f"blk.{i}.ffn_norm.weight", (h,), Q.F32)
        add(f"blk.{i}.ffn_gate.weight", (f, h), Q.Q5_1)
        add(f"blk.{i}.ffn_up.weight", (f, h), Q.F16)
        add(f"blk.{i}.ffn_down.weight", (h, f), Q.Q8_0)
    add("output_norm.weight", (h,), Q.F32)
    add("output.weight", (v, h), Q.F16)
    _finish(w)
    return made


def write_bf16_llama_gguf(st_folder: Path, path: Path) -> None:
    """The reference tiny llama (a bf16 `save_pretrained` folder) as a BF16 GGUF, as llama.cpp's
    converter names and lays it out: every tensor keeps its bf16 bytes, `q_proj`/`k_proj` rows
    are permuted to llama.cpp's adjacent rope pairs, and the tied embedding is the only output
    matrix. The bytes come from the `safetensors` package; nothing is rounded."""
    cfg = json.loads((st_folder / "config.json").read_text())
    raw: dict[str, np.ndarray] = {}
    for f in sorted(st_folder.glob("*.safetensors")):
        for name, info in safetensors.deserialize(f.read_bytes()):
            assert info["dtype"] == "BF16", (name, info["dtype"])
            raw[name] = np.frombuffer(bytes(info["data"]), dtype=np.uint16).reshape(info["shape"])
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def permute(w: np.ndarray, n_head: int) -> np.ndarray:
        rows, cols = w.shape
        return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)

    w = gguf.GGUFWriter(path, arch="llama")
    w.add_name("tiny-llama-bf16")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(cfg["hidden_size"] // heads)
    w.add_vocab_size(cfg["vocab_size"])

    def add(name: str, data: np.ndarray) -> None:
        w.add_tensor(name, np.ascontiguousarray(data), raw_dtype=Q.BF16)

    add("token_embd.weight", raw["model.embed_tokens.weight"])
    for i in range(cfg["num_hidden_layers"]):
        hf = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", raw[hf + "input_layernorm.weight"])
        add(f"blk.{i}.attn_q.weight", permute(raw[hf + "self_attn.q_proj.weight"], heads))
        add(f"blk.{i}.attn_k.weight", permute(raw[hf + "self_attn.k_proj.weight"], kv_heads))
        add(f"blk.{i}.attn_v.weight", raw[hf + "self_attn.v_proj.weight"])
        add(f"blk.{i}.attn_output.weight", raw[hf + "self_attn.o_proj.weight"])
        add(f"blk.{i}.ffn_norm.weight", raw[hf + "post_attention_layernorm.weight"])
        add(f"blk.{i}.ffn_gate.weight", raw[hf + "mlp.gate_proj.weight"])
        add(f"blk.{i}.ffn_up.weight", raw[hf + "mlp.up_proj.weight"])
        add(f"blk.{i}.ffn_down.weight", raw[hf + "mlp.down_proj.weight"])
    add("output_norm.weight", raw["model.norm.weight"])
    _finish(w)


# --------------------------------------------------------------------------------------------
# safetensors

ST_DTYPES = (
    np.float64,
    np.float32,
    np.float16,
    np.int64,
    np.uint64,
    np.int32,
    np.uint32,
    np.int16,
    np.uint16,
    np.int8,
    np.uint8,
    np.bool_,
    np.complex64,
)


def st_tensors(seed: int = 2) -> dict[str, np.ndarray]:
    """One tensor per numpy-representable safetensors dtype, plus a llama-shaped set."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for dt in ST_DTYPES:
        name = f"t.{np.dtype(dt).name}"
        if np.issubdtype(dt, np.floating):
            out[name] = rng.standard_normal((3, 5)).astype(dt)
        elif np.issubdtype(dt, np.complexfloating):
            out[name] = (rng.standard_normal((2, 3)) + 1j * rng.standard_normal((2, 3))).astype(dt)
        elif dt is np.bool_:
            out[name] = rng.integers(0, 2, (4, 4)).astype(bool)
        else:
            info = np.iinfo(dt)
            out[name] = rng.integers(info.min, info.max, (3, 4), dtype=dt, endpoint=True)
    out["t.scalar"] = np.array(3.5, dtype=np.float32)
    out["t.empty_dim_free_4d"] = rng.standard_normal((1, 2, 3, 4)).astype(np.float32)
    return out


def st_llama_tensors(seed: int = 3) -> dict[str, np.ndarray]:
    """HF llama names for a two-layer model shaped like LLAMA."""
    rng = np.random.default_rng(seed)
    c = LLAMA
    h, f, v = c["hidden"], c["ffn"], c["vocab"]
    kv = c["kv_heads"] * (h // c["heads"])

    def r(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float16)

    out = {
        "model.embed_tokens.weight": r(v, h),
        "model.norm.weight": r(h),
        "lm_head.weight": r(v, h),
    }
    for i in range(c["n_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = r(h)
        out[p + "self_attn.q_proj.weight"] = r(h, h)
        out[p + "self_attn.k_proj.weight"] = r(kv, h)
        out[p + "self_attn.v_proj.weight"] = r(kv, h)
        out[p + "self_attn.o_proj.weight"] = r(h, h)
        out[p + "post_attention_layernorm.weight"] = r(h)
        out[p + "mlp.gate_proj.weight"] = r(f, h)
        out[p + "mlp.up_proj.weight"] = r(f, h)
        out[p + "mlp.down_proj.weight"] = r(h, f)
    return out


def hf_config() -> dict[str, Any]:
    c = LLAMA
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": c["hidden"],
        "intermediate_size": c["ffn"],
        "num_attention_heads": c["heads"],
        "num_key_value_heads": c["kv_heads"],
        "num_hidden_layers": c["n_layers"],
        "max_position_embeddings": c["ctx"],
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": c["vocab"],
        "tie_word_embeddings": False,
    }


def write_st_single(path: Path) -> dict[str, np.ndarray]:
    tensors = st_tensors()
    save_file(tensors, str(path), metadata={"format": "np", "note": "single"})
    return tensors


def write_st_folder(folder: Path) -> dict[str, np.ndarray]:
    """A folder with `model.safetensors`, `config.json` and `tokenizer.json`."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = st_llama_tensors()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf_config()))
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE"}}))
    return tensors


def write_st_sharded(folder: Path, n_shards: int = 3) -> dict[str, np.ndarray]:
    """A sharded folder with `model.safetensors.index.json`, as transformers writes one."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = st_llama_tensors()
    names = list(tensors)
    weight_map: dict[str, str] = {}
    total = 0
    for k in range(n_shards):
        part = names[k::n_shards]
        fname = f"model-{k + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(folder / fname), metadata={"format": "pt"})
        for n in part:
            weight_map[n] = fname
            total += tensors[n].nbytes
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (folder / "config.json").write_text(json.dumps(hf_config()))
    return tensors


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_all_types_gguf(out / "all_types.gguf")
    write_tiny_llama_gguf(out / "tiny_llama.gguf")
    write_st_single(out / "single.safetensors")
    write_st_folder(out / "st_folder")
    write_st_sharded(out / "st_sharded")
    sys.stderr.write(f"fixtures written to {out}\n")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "fixtures"))
