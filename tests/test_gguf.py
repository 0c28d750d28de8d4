"""GGUF: metadata, tensor table, raw views and dequantisation, against gguf-py's GGUFReader and
gguf.quants (code nobody here wrote), on fixtures gguf-py wrote and on real files."""

from __future__ import annotations

import gc
from pathlib import Path

import gen_fixtures as gen
import gguf
import numpy as np
import pytest
import weightlift as wl
from gguf import GGMLQuantizationType as Q

# Tolerance: none. Every type must be bit-identical to gguf-py, whether it goes through the
# kernels crate (F32, F16, BF16, Q4_0..Q8_0, Q2_K..Q6_K, IQ4_NL) or the format crate's scalar
# reference (the other IQ types, TQ1_0, TQ2_0, MXFP4, NVFP4): both compute each element with the
# same f32 operations, in the same order, as gguf.quants.
DEQUANTIZABLE = set(gguf.quants._type_traits) | {Q.F32, Q.F16}


def reader_value(field: gguf.ReaderField):
    return field.contents()


def assert_dequant_equal(ours: np.ndarray, ref: np.ndarray, qtype: Q, name: str) -> None:
    assert ours.dtype == np.float32, name
    assert ours.shape == ref.shape, name
    np.testing.assert_array_equal(ours, ref.astype(np.float32), err_msg=f"{name} ({qtype.name})")


# --------------------------------------------------------------------------------------------
# fixtures written by gguf-py


@pytest.fixture(scope="module")
def all_types(all_types_gguf):
    path, made = all_types_gguf
    reader = gguf.GGUFReader(path)
    with wl.open(path) as ckpt:
        yield ckpt, reader, made


def test_metadata_equals_reader(all_types):
    ckpt, reader, _ = all_types
    meta = ckpt.metadata
    expected = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(meta) == list(expected), "same keys, in file order"
    for key, field in expected.items():
        if field.types[:2] == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.ARRAY]:
            # gguf-py's reader flattens nested arrays; compare the flattening, and the nesting
            # against what gguf-py's writer was given.
            flat = [x for inner in meta[key] for x in inner]
            assert flat == reader_value(field), key
            assert meta[key] == gen.METADATA[key][0], key
        else:
            assert meta[key] == reader_value(field), key
            assert type(meta[key]) is type(reader_value(field)), key


def test_metadata_python_types(all_types):
    meta = all_types[0].metadata
    assert meta["test.u64"] == 2**64 - 1 and meta["test.i64"] == -(2**63)
    assert meta["test.bool_true"] is True and meta["test.bool_false"] is False
    assert meta["test.f32"] == float(np.float32(0.1))
    assert meta["test.string"] == "héllo wörld ✓" and meta["test.empty_string"] == ""
    assert meta["test.array_nested_str"] == [["x", "y"], ["z"]]
    assert meta["general.architecture"] == "testarch"


def test_tensor_table_equals_reader(all_types, all_types_gguf):
    ckpt, reader, made = all_types
    path = all_types_gguf[0]
    ours = ckpt.tensors
    assert [t.name for t in ours] == [t.name for t in reader.tensors]
    assert len(ckpt) == len(reader.tensors) == len(made)
    for t, r in zip(ours, reader.tensors, strict=True):
        assert t.dtype == r.tensor_type.name, t.name
        assert t.shape == tuple(int(d) for d in reversed(r.shape)), t.name
        assert t.nbytes == r.n_bytes, t.name
        assert t.offset == r.data_offset, t.name
        assert t.n_elements == r.n_elements, t.name
        assert Path(t.file) == path
        assert t.layer is None
    assert ckpt.nbytes == sum(int(r.n_bytes) for r in reader.tensors)
    assert ckpt.n_params == sum(int(r.n_elements) for r in reader.tensors)
    assert ckpt.format == "gguf" and [Path(f) for f in ckpt.files] == [path]


def test_raw_views_equal_reader_data(all_types):
    ckpt, reader, _ = all_types
    for r in reader.tensors:
        raw = ckpt.raw(r.name)
        assert not raw.flags.writeable, r.name
        assert not raw.flags.owndata, r.name
        if r.tensor_type in (Q.F32, Q.F16, Q.F64, Q.I8, Q.I16, Q.I32, Q.I64):
            assert raw.dtype == r.data.dtype, r.name
            assert raw.shape == ckpt[r.name].shape, r.name
            np.testing.assert_array_equal(raw, r.data.reshape(raw.shape), err_msg=r.name)
        else:
            # uint8 rows of the stored bytes, the shape gguf-py's reader gives them
            assert raw.dtype == np.uint8 and raw.shape == r.data.shape, r.name
            assert raw.tobytes() == r.data.tobytes(), r.name
        with pytest.raises(ValueError, match="read-only"):
            raw[..., 0] = 0


@pytest.mark.parametrize("qtype", sorted(DEQUANTIZABLE, key=int), ids=lambda q: q.name)
def test_dequantize_equals_gguf_py(all_types, qtype):
    ckpt, reader, made = all_types
    names = [n for n, q in made.items() if q == qtype]
    assert names, f"fixture has no {qtype.name} tensor"
    by_name = {r.name: r for r in reader.tensors}
    for name in names:
        ref = gguf.quants.dequantize(by_name[name].data, qtype)
        assert np.isfinite(ref).all(), "fixture scales must be finite"
        assert_dequant_equal(ckpt.dequantize(name), ref, qtype, name)


def test_dequantize_shapes_follow_tensor_shape(all_types):
    ckpt = all_types[0]
    for name in ("t.F32_1d", "t.F32_3d", "t.F32_4d", "t.Q8_0_3d"):
        assert ckpt.dequantize(name).shape == ckpt[name].shape


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0, Q.IQ2_XXS], ids=lambda q: q.name)
def test_dequantize_into_out_equals_gguf_py(all_types, qtype):
    ckpt, reader, made = all_types
    name = next(n for n, q in made.items() if q == qtype)
    ref = gguf.quants.dequantize(next(r for r in reader.tensors if r.name == name).data, qtype)
    out = np.full(ckpt[name].shape, np.nan, dtype=np.float32)
    assert ckpt.dequantize(name, out=out) is out
    assert_dequant_equal(out, ref, qtype, name)


def test_dequantize_out_must_fit(all_types):
    ckpt = all_types[0]
    shape = ckpt["t.Q8_0_3d"].shape
    with pytest.raises(ValueError, match=r"expected an array of shape"):
        ckpt.dequantize("t.Q8_0_3d", out=np.zeros(7, dtype=np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        ckpt.dequantize("t.Q8_0_3d", out=np.zeros(shape[::-1], dtype=np.float32).T)
    frozen = np.zeros(shape, dtype=np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="t.Q8_0_3d"):
        ckpt.dequantize("t.Q8_0_3d", out=frozen)


def test_dequantize_plain_types_equal_numpy_cast(all_types):
    ckpt, reader, made = all_types
    by_name = {r.name: r for r in reader.tensors}
    for name, q in made.items():
        if q in (Q.F64, Q.I8, Q.I16, Q.I32, Q.I64):
            ref = by_name[name].data.astype(np.float32)
            np.testing.assert_array_equal(ckpt.dequantize(name), ref, err_msg=name)


def test_dequantize_unsupported_type_is_format_error(all_types):
    ckpt = all_types[0]
    # Q1_0 is sized and listed, but neither gguf-py nor weightlift can dequantise it.
    with pytest.raises(wl.FormatError, match=r"t\.Q1_0") as info:
        ckpt.dequantize("t.Q1_0")
    assert "Q1_0" in str(info.value) and "all_types.gguf" in str(info.value)


def test_unknown_tensor_name(all_types):
    ckpt = all_types[0]
    with pytest.raises(wl.FormatError, match="no tensor named 'nope'"):
        ckpt.raw("nope")
    with pytest.raises(wl.FormatError, match="'nope'"):
        ckpt.dequantize("nope")
    with pytest.raises(KeyError):
        ckpt["nope"]
    assert "nope" not in ckpt and "t.F32" in ckpt
    assert ckpt["t.F32"] == ckpt.tensors[0]
    assert list(ckpt) == [t.name for t in ckpt.tensors]


# --------------------------------------------------------------------------------------------
# lifetime: views share the map and outlive close()


def test_raw_view_outlives_close_and_checkpoint(tiny_llama_gguf):
    reader = gguf.GGUFReader(tiny_llama_gguf)
    expected = {r.name: r.data.tobytes() for r in reader.tensors}
    ckpt = wl.open(tiny_llama_gguf)
    views = {name: ckpt.raw(name) for name in expected}
    ckpt.close()
    assert ckpt.closed
    del ckpt
    gc.collect()
    for name, view in views.items():
        assert view.tobytes() == expected[name], name


def test_closed_checkpoint_raises(tiny_llama_gguf):
    with wl.open(tiny_llama_gguf) as ckpt:
        assert not ckpt.closed
        assert "tiny_llama.gguf" in repr(ckpt)
    assert ckpt.closed and "closed" in repr(ckpt)
    for op in (lambda: ckpt.raw("output.weight"), lambda: ckpt.dequantize("output.weight")):
        with pytest.raises(wl.ClosedError, match="is closed") as info:
            op()
        assert isinstance(info.value, (wl.WeightliftError, ValueError))
        assert "tiny_llama.gguf" in str(info.value)
    with pytest.raises(wl.ClosedError):
        _ = ckpt.tensors
    ckpt.close()  # closing twice is fine
    assert ckpt.format == "gguf" and ckpt.path.endswith("tiny_llama.gguf")


def test_exit_does_not_swallow_exceptions(tiny_llama_gguf):
    with pytest.raises(RuntimeError, match="boom"):
        with wl.open(tiny_llama_gguf):
            raise RuntimeError("boom")


# --------------------------------------------------------------------------------------------
# llama: spec, roles, tokenizer, vocab_only, check_tensors, split files


def test_tiny_llama_spec_and_roles(tiny_llama_gguf):
    reader = gguf.GGUFReader(tiny_llama_gguf)
    field = reader.fields
    c = gen.LLAMA
    with wl.open(tiny_llama_gguf) as ckpt:
        spec = ckpt.spec
        assert spec is not None and ckpt.spec_error is None
        assert spec.architecture == "llama"
        assert spec.n_layers == field["llama.block_count"].contents() == c["n_layers"]
        assert spec.hidden_size == field["llama.embedding_length"].contents()
        assert spec.intermediate_size == field["llama.feed_forward_length"].contents()
        assert spec.n_heads == field["llama.attention.head_count"].contents()
        assert spec.n_kv_heads == [c["kv_heads"]] * c["n_layers"]
        assert spec.head_dim == c["hidden"] // c["heads"]
        assert spec.vocab_size == c["vocab"]
        assert spec.context_length == c["ctx"]
        assert spec.rope_theta == 10000.0
        assert spec.rms_norm_eps == pytest.approx(1e-5)
        assert spec.tie_word_embeddings is False  # output.weight is present
        d = spec.to_dict()
        assert d["architecture"] == "llama" and d["n_layers"] == c["n_layers"]
        assert "ModelSpec(" in repr(spec) and spec == ckpt.spec

        t = ckpt["blk.1.ffn_down.weight"]
        assert (t.layer, t.role) == (1, "ffn_down")
        assert (ckpt["blk.0.attn_q.weight"].layer, ckpt["blk.0.attn_q.weight"].role) == (
            0,
            "attn_q",
        )
        assert (ckpt["token_embd.weight"].layer, ckpt["token_embd.weight"].role) == (
            None,
            "token_embd",
        )
        assert ckpt["output_norm.weight"].role == "output_norm"
        assert ckpt["output.weight"].role == "output"
        assert {t.layer for t in ckpt.tensors} == {None, 0, 1}

        tok = ckpt.tokenizer
        assert tok["model"] == "gpt2" and tok["pre"] == "default"
        assert tok["n_tokens"] == c["vocab"] and tok["n_merges"] == 10
        assert (tok["bos_token_id"], tok["eos_token_id"]) == (1, 2)
        assert ckpt.config is None


def test_vocab_only(tiny_llama_gguf):
    full = wl.open(tiny_llama_gguf)
    with wl.open(tiny_llama_gguf, vocab_only=True) as ckpt:
        assert ckpt.tensors == [] and len(ckpt) == 0
        assert ckpt.metadata == full.metadata
        assert ckpt.metadata["tokenizer.ggml.tokens"][:2] == ["tok0", "tok1"]
        assert ckpt.tokenizer == full.tokenizer
        assert ckpt.nbytes == 0
        with pytest.raises(wl.FormatError):
            ckpt.raw("output.weight")


def test_check_tensors_clean_file_opens(tiny_llama_gguf, all_types_gguf):
    with wl.open(tiny_llama_gguf, check_tensors=True) as ckpt:
        assert len(ckpt) == 21
    with wl.open(all_types_gguf[0], check_tensors=True) as ckpt:
        assert len(ckpt) == len(all_types_gguf[1])


def test_check_tensors_finds_nan_in_f32(tmp_path):
    path = tmp_path / "nan.gguf"
    gen.write_tiny_llama_gguf(path, poison="nan_f32")
    wl.open(path).close()  # structurally fine; only the scan sees it
    with pytest.raises(wl.FormatError) as info:
        wl.open(path, check_tensors=True)
    msg = str(info.value)
    assert "blk.1.attn_norm.weight" in msg and "7" in msg and "nan" in msg.lower()


def test_check_tensors_finds_inf_in_q8_0_scale(tmp_path):
    path = tmp_path / "inf.gguf"
    gen.write_tiny_llama_gguf(path, poison="inf_q8_0")
    with pytest.raises(wl.FormatError) as info:
        wl.open(path, check_tensors=True)
    msg = str(info.value)
    # Block 2 covers elements 64..95; the scan reports the block's first element.
    assert "blk.0.ffn_down.weight" in msg and "64" in msg and "inf" in msg.lower()


def test_split_gguf_opens_as_one(tmp_path):
    base = tmp_path / "split.gguf"
    made = gen.write_tiny_llama_gguf(base, split_max_tensors=8)
    parts = sorted(tmp_path.glob("split-*-of-*.gguf"))
    assert len(parts) == 3
    readers = [gguf.GGUFReader(p) for p in parts]
    with wl.open(parts[0]) as ckpt:
        assert [Path(f) for f in ckpt.files] == parts
        assert [t.name for t in ckpt.tensors] == [t.name for r in readers for t in r.tensors]
        assert set(made) == {t.name for t in ckpt.tensors}
        located = [(p, t) for p, rd in zip(parts, readers, strict=True) for t in rd.tensors]
        for t, (part, r) in zip(ckpt.tensors, located, strict=True):
            assert Path(t.file) == part and t.offset == r.data_offset, t.name
            assert ckpt.raw(t.name).tobytes() == r.data.tobytes(), t.name
        assert ckpt.spec is not None and ckpt.spec.n_layers == 2


# --------------------------------------------------------------------------------------------
# real files


@pytest.fixture(scope="module")
def demo(demo_gguf, demo_reader):
    with wl.open(demo_gguf) as ckpt:
        yield ckpt, demo_reader


def test_demo_model_table_and_metadata(demo):
    ckpt, reader = demo
    assert len(ckpt.tensors) == len(reader.tensors) == 272
    for t, r in zip(ckpt.tensors, reader.tensors, strict=True):
        assert t.name == r.name
        assert t.dtype == r.tensor_type.name
        assert t.shape == tuple(int(d) for d in reversed(r.shape))
        assert (t.nbytes, t.offset) == (r.n_bytes, r.data_offset)
    meta = ckpt.metadata
    expected = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(meta) == list(expected)
    assert meta == expected
    counts: dict[str, int] = {}
    for t in ckpt.tensors:
        counts[t.dtype] = counts.get(t.dtype, 0) + 1
    assert counts == {"Q4_1": 210, "Q8_0": 1, "F32": 61}


def test_demo_model_spec(demo):
    ckpt, _ = demo
    s = ckpt.spec
    assert s is not None
    assert (s.architecture, s.n_layers, s.hidden_size, s.intermediate_size) == (
        "llama",
        30,
        576,
        1536,
    )
    assert (s.n_heads, s.head_dim, s.vocab_size) == (9, 64, 49152)
    assert s.n_kv_heads == [3] * 30
    assert s.rope_theta == 100000.0 and s.tie_word_embeddings
    assert ckpt.tokenizer["pre"] == "smollm"
    assert {t.layer for t in ckpt.tensors if t.layer is not None} == set(range(30))
    assert all(t.role is not None for t in ckpt.tensors)


def test_demo_model_dequantize(demo):
    ckpt, reader = demo
    by_name = {r.name: r for r in reader.tensors}
    for name in ("blk.0.attn_q.weight", "blk.29.ffn_down.weight", "output_norm.weight"):
        r = by_name[name]
        assert_dequant_equal(
            ckpt.dequantize(name),
            gguf.quants.dequantize(r.data, r.tensor_type),
            r.tensor_type,
            name,
        )


@pytest.mark.parametrize("quant", ["Q4_K_M", "Q6_K", "Q8_0"])
def test_tiny_llama_reference_gguf(tiny_llama_gguf_dir, quant):
    """llama.cpp-written K-quant files: one tensor of every type they hold."""
    path = tiny_llama_gguf_dir / f"tiny-llama-{quant}.gguf"
    reader = gguf.GGUFReader(path)
    with wl.open(path) as ckpt:
        assert [t.name for t in ckpt.tensors] == [r.name for r in reader.tensors]
        seen: set[Q] = set()
        for r in reader.tensors:
            t = ckpt[r.name]
            assert (t.dtype, t.nbytes, t.offset) == (r.tensor_type.name, r.n_bytes, r.data_offset)
            if r.tensor_type in seen or r.tensor_type not in DEQUANTIZABLE:
                continue
            seen.add(r.tensor_type)
            ref = gguf.quants.dequantize(r.data, r.tensor_type)
            assert_dequant_equal(ckpt.dequantize(r.name), ref, r.tensor_type, r.name)
        assert seen
        assert ckpt.spec is not None and ckpt.spec.n_layers == 2


def test_warnings_for_unknown_architecture(all_types, demo):
    ckpt = all_types[0]
    assert any("testarch" in w for w in ckpt.warnings)
    assert ckpt.spec is None and ckpt.spec_error
    assert all(t.role is None for t in ckpt.tensors)
    assert demo[0].warnings == []
