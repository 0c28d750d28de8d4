"""safetensors: single files, folders and sharded indexes, against the `safetensors` package's own
reader (`safe_open`, `deserialize`) on files that package wrote, and on the tiny-llama pack."""

from __future__ import annotations

import json
from pathlib import Path

import gen_fixtures as gen
import numpy as np
import safetensors
import weightlift as wl
from conftest import DATA
from safetensors import safe_open


def reference_tensors(files: list[Path]) -> dict[str, dict]:
    """name -> {dtype, shape, data (bytes), file} from the safetensors package's deserializer."""
    out: dict[str, dict] = {}
    for f in files:
        for name, spec in safetensors.deserialize(f.read_bytes()):
            out[name] = {**spec, "file": f}
    return out


def check_against_reference(ckpt: wl.Checkpoint, files: list[Path]) -> None:
    ref = reference_tensors(files)
    ours = {t.name: t for t in ckpt.tensors}
    assert set(ours) == set(ref)
    assert [Path(f) for f in ckpt.files] == files
    for name, r in ref.items():
        t = ours[name]
        assert t.dtype == r["dtype"], name
        assert t.shape == tuple(r["shape"]), name
        assert t.nbytes == len(r["data"]), name
        assert Path(t.file) == r["file"], name
        raw = ckpt.raw(name)
        assert raw.tobytes() == bytes(r["data"]), name
        assert not raw.flags.writeable
        # The offset is absolute within the file: the bytes there are the tensor's.
        with open(t.file, "rb") as fh:
            fh.seek(t.offset)
            assert fh.read(t.nbytes) == bytes(r["data"]), name
    assert ckpt.nbytes == sum(len(r["data"]) for r in ref.values())


def test_single_file_every_numpy_dtype(st_single):
    path, tensors = st_single
    with wl.open(path) as ckpt, safe_open(path, framework="np") as ref:
        assert ckpt.format == "safetensors"
        assert ckpt.metadata == ref.metadata() == {"format": "np", "note": "single"}
        assert set(ref.keys()) == {t.name for t in ckpt.tensors}
        for name in ref.keys():
            expected = ref.get_tensor(name)
            raw = ckpt.raw(name)
            assert raw.dtype == expected.dtype, name
            assert raw.shape == expected.shape == ckpt[name].shape, name
            np.testing.assert_array_equal(raw, expected, err_msg=name)
            np.testing.assert_array_equal(raw, tensors[name], err_msg=name)
        check_against_reference(ckpt, [path])
        assert ckpt.spec is None and "config.json" in (ckpt.spec_error or "")
        assert ckpt.config is None


def test_single_file_dequantize_float_and_int_types(st_single):
    path, tensors = st_single
    with wl.open(path) as ckpt:
        for name in (
            "t.float64",
            "t.float32",
            "t.float16",
            "t.int8",
            "t.int16",
            "t.int32",
            "t.int64",
        ):
            out = ckpt.dequantize(name)
            np.testing.assert_array_equal(out, tensors[name].astype(np.float32), err_msg=name)
        assert ckpt.dequantize("t.scalar").shape == ()
        assert float(ckpt.dequantize("t.scalar")) == 3.5


def test_bf16_and_f8_written_by_serialize(tmp_path):
    rng = np.random.default_rng(5)
    f32 = rng.standard_normal((4, 8)).astype(np.float32)
    bf16_bits = (f32.view(np.uint32) >> 16).astype(np.uint16)  # truncation is a valid bf16
    f8 = rng.integers(0, 256, 16, dtype=np.uint8)
    path = tmp_path / "bf16.safetensors"

    def spec(dtype: str, shape: list[int], arr: np.ndarray) -> safetensors.TensorSpec:
        return safetensors.TensorSpec(
            dtype=dtype, shape=shape, data_ptr=arr.ctypes.data, data_len=arr.nbytes
        )

    safetensors.serialize_file(
        {
            "w.bf16": spec("bfloat16", [4, 8], bf16_bits),
            "w.f8_e4m3": spec("float8_e4m3fn", [16], f8),
            "w.f8_e5m2": spec("float8_e5m2", [2, 8], f8),
        },
        str(path),
    )
    with wl.open(path) as ckpt:
        check_against_reference(ckpt, [path])
        assert ckpt["w.bf16"].dtype == "BF16" and ckpt["w.bf16"].shape == (4, 8)
        raw = ckpt.raw("w.bf16")
        # uint8 rows of the stored bytes: (4, 8) BF16 values are 4 rows of 16 bytes
        assert raw.dtype == np.uint8 and raw.shape == (4, 16)
        # bf16 is the top half of an f32: widening it is exact.
        expected = (bf16_bits.astype(np.uint32) << 16).view(np.float32)
        np.testing.assert_array_equal(ckpt.dequantize("w.bf16"), expected)
        assert ckpt.raw("w.f8_e5m2").dtype == np.uint8


def test_folder(st_folder):
    folder, tensors = st_folder
    with wl.open(folder) as ckpt:
        check_against_reference(ckpt, [folder / "model.safetensors"])
        for name, arr in tensors.items():
            np.testing.assert_array_equal(ckpt.raw(name), arr, err_msg=name)
            np.testing.assert_array_equal(ckpt.dequantize(name), arr.astype(np.float32))
        assert ckpt.tokenizer["has_tokenizer_json"] is True
        assert ckpt.config == gen.hf_config()
        spec = ckpt.spec
        assert spec is not None and spec.architecture == "llama"
        c = gen.LLAMA
        assert (spec.n_layers, spec.hidden_size, spec.intermediate_size) == (
            c["n_layers"],
            c["hidden"],
            c["ffn"],
        )
        assert spec.n_kv_heads == [c["kv_heads"]] * c["n_layers"]
        assert ckpt["model.layers.1.mlp.down_proj.weight"].layer == 1
        assert ckpt["model.layers.1.mlp.down_proj.weight"].role == "ffn_down"
        assert ckpt["model.layers.0.self_attn.q_proj.weight"].role == "attn_q"
        assert ckpt["model.embed_tokens.weight"].role == "token_embd"
        assert ckpt["lm_head.weight"].role == "output"
        assert ckpt["model.norm.weight"].role == "output_norm"
    # The single file inside the folder opens on its own too.
    with wl.open(folder / "model.safetensors") as ckpt:
        assert len(ckpt) == len(tensors)


def test_sharded_index(st_sharded):
    folder, tensors = st_sharded
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted({folder / f for f in index["weight_map"].values()})
    for path in (folder, folder / "model.safetensors.index.json"):
        with wl.open(path) as ckpt:
            check_against_reference(ckpt, shards)
            for name, shard in index["weight_map"].items():
                assert Path(ckpt[name].file) == folder / shard, name
            for name, arr in tensors.items():
                np.testing.assert_array_equal(ckpt.raw(name), arr, err_msg=name)
            assert ckpt.spec is not None and ckpt.spec.n_layers == gen.LLAMA["n_layers"]


# --------------------------------------------------------------------------------------------
# the tiny-llama reference pack (tests/reference/), written by transformers


def test_tiny_llama_single(tiny_llama_st):
    model = json.loads((tiny_llama_st.parent / "model.json").read_text())
    with wl.open(tiny_llama_st) as ckpt:
        check_against_reference(ckpt, [tiny_llama_st / "model.safetensors"])
        assert ckpt.n_params == model["n_params"] == 9_766_144
        for name, (shape, dtype) in model["tensors"].items():
            assert ckpt[name].shape == tuple(shape) and dtype == "bfloat16", name
            assert ckpt[name].dtype == "BF16"
        spec = ckpt.spec
        assert spec is not None
        assert (spec.n_layers, spec.hidden_size, spec.n_heads, spec.head_dim) == (2, 256, 4, 64)
        assert spec.n_kv_heads == [2, 2] and spec.vocab_size == 32000
        assert spec.tie_word_embeddings and spec.rope_theta == 10000.0
        assert ckpt.tokenizer["has_tokenizer_json"] is True
        # Dequantised bf16 widens exactly to f32.
        with safe_open(tiny_llama_st / "model.safetensors", framework="np") as ref:
            assert ckpt.metadata == ref.metadata()
        raw = ckpt.raw("model.norm.weight").view(np.uint16).astype(np.uint32) << 16
        np.testing.assert_array_equal(ckpt.dequantize("model.norm.weight"), raw.view(np.float32))


def test_tiny_llama_sharded(tiny_llama_st, tiny_llama_st_sharded):
    index = json.loads((DATA / "tiny-llama" / "model.safetensors.index.json").read_text())
    shards = sorted({tiny_llama_st_sharded / f for f in index["weight_map"].values()})
    with wl.open(tiny_llama_st_sharded) as sharded, wl.open(tiny_llama_st) as single:
        check_against_reference(sharded, shards)
        for name, shard in index["weight_map"].items():
            assert Path(sharded[name].file).name == shard
            assert sharded.raw(name).tobytes() == single.raw(name).tobytes(), name
        assert sharded.config == json.loads((DATA / "tiny-llama" / "config.json").read_text())
        assert sharded.spec == single.spec
