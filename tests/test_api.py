"""The package surface: exports, the engine's signatures, the exception hierarchy, and OS
errors from open()."""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest
import weightlift as wl

CONTRACT = {
    "open",
    "Checkpoint",
    "TensorInfo",
    "ModelSpec",
    "WeightliftError",
    "FormatError",
    "OutOfMemoryError",
    "DeviceError",
    "UnsupportedError",
    "plan",
    "fit",
    "devices",
    "parse_devices",
    "Plan",
    "CacheSpec",
    "RuntimeSpec",
    # The engine's API contract.
    "tensor",
    "DeviceTensor",
    "use_devices",
    "Model",
    "Cache",
    "TPContext",
    "from_pretrained",
    "load_gguf",
    "LoadCancelled",
    "BROADCAST_KV",
    "BROADCAST_ID",
    "BROADCAST_VC",
    "BROADCAST_RS",
    "BROADCAST_Q",
}


def test_exports():
    assert CONTRACT <= set(wl.__all__)
    for name in wl.__all__:
        assert hasattr(wl, name), name
    assert wl.__version__ == "0.1.0"


def test_all_is_exactly_the_public_names():
    # submodules (cli, server) show up once some test has imported them
    public = {n for n in dir(wl) if not n.startswith("_") and not inspect.ismodule(getattr(wl, n))}
    assert set(wl.__all__) - {"__version__"} == public
    assert len(wl.__all__) == len(set(wl.__all__))
    assert set(wl._native.__all__) <= set(wl.__all__)


def test_broadcast_constants():
    # exllamav2's TPContext numbering.
    assert (wl.BROADCAST_KV, wl.BROADCAST_ID, wl.BROADCAST_VC) == (0, 1, 2)
    assert (wl.BROADCAST_RS, wl.BROADCAST_Q) == (3, 4)


EMPTY = inspect.Parameter.empty
SELF = ("self", inspect.Parameter.POSITIONAL_ONLY, EMPTY)
POS = inspect.Parameter.POSITIONAL_OR_KEYWORD
KW = inspect.Parameter.KEYWORD_ONLY


def params(fn) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize(
    "fn, contract",
    [
        # weightlift.tensor(ndarray, device)
        (wl.tensor, [("array", POS, EMPTY), ("device", POS, EMPTY)]),
        # Model(source, *, devices=None, dtype="auto", runtime=None)
        (
            wl.Model,
            [
                ("source", POS, EMPTY),
                ("devices", KW, None),
                ("dtype", KW, "auto"),
                ("runtime", KW, None),
            ],
        ),
        # .load(plan=None, *, progress=False, callback=None, **plan_options)
        (
            wl.Model.load,
            [SELF, ("plan", POS, None)] + [("progress", KW, False), ("callback", KW, None)],
        ),
        # .load_autosplit(cache=None, reserve_vram=None, *, progress=False, callback=None)
        (
            wl.Model.load_autosplit,
            [SELF, ("cache", POS, None)]
            + [("reserve_vram", POS, None), ("progress", KW, False), ("callback", KW, None)],
        ),
        # .load_tp(gpu_split=None, expect_cache_tokens=0, expect_cache_base=None, *, progress,
        #          callback)
        (
            wl.Model.load_tp,
            [SELF, ("gpu_split", POS, None)]
            + [("expect_cache_tokens", POS, 0), ("expect_cache_base", POS, None)]
            + [("progress", KW, False), ("callback", KW, None)],
        ),
        (wl.Model.tensor, [SELF, ("name", POS, EMPTY), ("dequantize", POS, False)]),
        # Cache(model, *, max_seq_len=None, batch_size=1, dtype="fp16", lazy=True,
        # offload=False): keyword-only, so Cache(model, 1, 8192) cannot mean batch 8192
        (
            wl.Cache,
            [("model", POS, EMPTY), ("max_seq_len", KW, None), ("batch_size", KW, 1)]
            + [("dtype", KW, "fp16"), ("lazy", KW, True), ("offload", KW, False)],
        ),
        # TPContext(model, gpu_split, expect_cache_tokens=0, expect_cache_base=None);
        # gpu_split=None detects free memory, so None is its default.
        (
            wl.TPContext,
            [("model", POS, EMPTY), ("gpu_split", POS, None), ("expect_cache_tokens", POS, 0)]
            + [("expect_cache_base", POS, None)],
        ),
        # from_pretrained(path, *, device_map="auto", max_memory=None, dtype="auto", devices=None)
        (
            wl.from_pretrained,
            [("path", POS, EMPTY), ("device_map", KW, "auto"), ("max_memory", KW, None)]
            + [("dtype", KW, "auto"), ("devices", KW, None)],
        ),
        # load_gguf(path=None, *, n_gpu_layers=0 (llama-cpp-python's default), split_mode="layer",
        #   tensor_split=None, main_gpu=0,
        #   use_mmap=True, use_direct_io=False, use_mlock=False, check_tensors=False,
        #   vocab_only=False, progress_callback=None, devices=None); the path may also come as
        #   llama-cpp-python's model_path=, so it has a default.
        (
            wl.load_gguf,
            [("path", POS, None), ("n_gpu_layers", KW, 0), ("split_mode", KW, "layer")]
            + [("tensor_split", KW, None), ("main_gpu", KW, 0), ("use_mmap", KW, True)]
            + [("use_direct_io", KW, False), ("use_mlock", KW, False)]
            + [("check_tensors", KW, False), ("vocab_only", KW, False)]
            + [("progress_callback", KW, None), ("devices", KW, None)],
        ),
    ],
    ids=lambda x: getattr(x, "__qualname__", None),
)
def test_engine_signatures_follow_the_contract(fn, contract):
    """Names, order, keyword-only markers and defaults of the engine's API contract; extra
    keyword-only options may follow."""
    got = params(fn)
    assert got[: len(contract)] == contract
    assert all(
        kind in (KW, inspect.Parameter.VAR_KEYWORD)
        for _name, kind, _default in got[len(contract) :]
    )


def test_model_load_takes_the_placement_keywords_of_plan():
    """One spelling for every placement option: Model.load's keywords are plan()'s."""
    load = inspect.signature(wl.Model.load).parameters
    plan = inspect.signature(wl.plan).parameters
    placement = [
        "strategy",
        "reserve",
        "max_memory",
        "overhead",
        "n_gpu_layers",
        "split_mode",
        "tensor_split",
        "main_gpu",
        "device_map",
        "overrides",
        "gpu_split",
        "allow_disk",
    ]
    for name in placement:
        assert name in plan and name in load, name
        assert load[name].kind == inspect.Parameter.KEYWORD_ONLY, name
    assert not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in load.values())


def test_from_pretrained_device_map_none_means_auto(tiny_llama_gguf):
    # A small runtime keeps the planned scratch small enough for 64 MiB devices.
    kw = {"devices": "virtual:2x64MiB", "runtime": {"max_input_len": 16, "max_dq_size": 1 << 16}}
    kw["runtime"]["max_attention_size"] = 256
    a = wl.from_pretrained(tiny_llama_gguf, **kw)
    b = wl.from_pretrained(tiny_llama_gguf, device_map=None, **kw)
    c = wl.from_pretrained(tiny_llama_gguf, device_map="balanced", **kw)
    # (Plans differ in the cpu's free memory, read at planning time: compare the placements.)
    placed = [[(t.name, t.device) for t in m.plan.tensors] for m in (a, b, c) if m.plan]
    assert len(placed) == 3 and placed[0] == placed[1] == placed[2]
    assert a.plan is not None and a.plan.strategy == "balanced"
    assert a.layer_devices == b.layer_devices == c.layer_devices
    assert set(a.layer_devices) <= {"virtual:0", "virtual:1"}
    for m in (a, b, c):
        m.unload()


def test_exception_hierarchy():
    assert issubclass(wl.FormatError, wl.WeightliftError)
    assert issubclass(wl.FormatError, ValueError)
    assert issubclass(wl.OutOfMemoryError, wl.WeightliftError)
    assert issubclass(wl.OutOfMemoryError, MemoryError)
    assert issubclass(wl.PlanError, wl.WeightliftError) and issubclass(wl.PlanError, ValueError)
    assert issubclass(wl.ClosedError, wl.WeightliftError) and issubclass(wl.ClosedError, ValueError)
    assert issubclass(wl.CudaUnavailable, wl.DeviceError)
    assert issubclass(wl.GrammarError, wl.WeightliftError)
    assert issubclass(wl.GrammarError, ValueError)
    assert not issubclass(wl.GrammarError, wl.PlanError)
    assert issubclass(wl.UnsupportedError, wl.WeightliftError)


def test_missing_file_is_file_not_found(tmp_path):
    path = tmp_path / "absent.gguf"
    with pytest.raises(FileNotFoundError) as info:
        wl.open(path)
    e = info.value
    assert e.errno == 2 and e.filename == str(path)
    assert "No such file" in str(e) and "absent.gguf" in str(e)
    assert not isinstance(e, wl.WeightliftError)


def test_path_through_a_file_is_not_a_directory(tmp_path):
    f = tmp_path / "plain"
    f.write_bytes(b"x")
    with pytest.raises(NotADirectoryError) as info:
        wl.open(f / "model.gguf")
    assert info.value.filename == str(f / "model.gguf")


def test_folder_without_weights_is_format_error(tmp_path):
    with pytest.raises(wl.FormatError) as info:
        wl.open(tmp_path)
    assert str(tmp_path) in str(info.value) and "safetensors" in str(info.value)


def test_open_accepts_str_and_pathlike(tiny_llama_gguf):
    for p in (tiny_llama_gguf, str(tiny_llama_gguf), Path(str(tiny_llama_gguf))):
        with wl.open(p) as ckpt:
            assert ckpt.path == str(tiny_llama_gguf)


def test_views_survive_threads(tiny_llama_gguf):
    """raw()/dequantize() from many threads at once, with close() racing them."""
    import threading

    ckpt = wl.open(tiny_llama_gguf)
    names = [t.name for t in ckpt.tensors]
    expected = {n: ckpt.dequantize(n) for n in names}
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for n in names:
                try:
                    assert (ckpt.dequantize(n) == expected[n]).all()
                    ckpt.raw(n).sum()
                except wl.ClosedError:
                    return
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    ckpt.close()
    for t in threads:
        t.join()
    assert not errors, errors


def test_cuda_graphs_switch_and_counts_on_a_model_without_a_gpu(tiny_llama_st: Path) -> None:
    # on by default (the environment may turn it off), settable, and counted: a model on the
    # CPU never captures a decode step, so the counts stay at zero while it decodes
    m = wl.Model(tiny_llama_st, devices="cpu")
    m.load()
    assert m.cuda_graphs is (os.environ.get("WEIGHTLIFT_CUDA_GRAPHS", "1").strip() != "0")
    m.cuda_graphs = False
    assert m.cuda_graphs is False
    m.cuda_graphs = True
    out = m.generate([1, 2, 3], max_new_tokens=3)
    assert len(out) >= 1
    assert m.cuda_graph_counts() == (0, 0, None)
    assert "CUDA graph" in (type(m).cuda_graphs.__doc__ or "")


def test_from_pretrained_takes_transformers_words(tiny_llama_st: Path) -> None:
    """torch_dtype, load_in_8bit and quantization_config mean what they mean to transformers;
    what weightlift does not do is refused by name, and the loader-only words change nothing."""
    half = wl.from_pretrained(tiny_llama_st, torch_dtype="float16")
    linear = next(t.name for t in half.plan.tensors if t.name.endswith("mlp.up_proj.weight"))
    assert half.tensor_info(linear).dtype == "F16"
    with pytest.raises(TypeError, match="both dtype and torch_dtype"):
        wl.from_pretrained(tiny_llama_st, torch_dtype="float16", dtype="float32")
    eight = wl.from_pretrained(tiny_llama_st, load_in_8bit=True)
    assert eight.tensor_info(linear).dtype == "INT8" and eight.int8_threshold == 6.0
    config = {"quant_method": "bitsandbytes", "load_in_8bit": True, "llm_int8_threshold": 4.0}
    configured = wl.from_pretrained(tiny_llama_st, quantization_config=config)
    assert configured.tensor_info(linear).dtype == "INT8" and configured.int8_threshold == 4.0
    refused = [
        ({"load_in_4bit": True}, "4-bit NF4/FP4 is not built; quantize='q4_k'"),
        ({"quantization_config": {"load_in_4bit": True}}, "4-bit NF4/FP4"),
        ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quant_method 'gptq'"),
        ({"revision": "main"}, "reads local files only"),
    ]
    for kwargs, words in refused:
        with pytest.raises(wl.UnsupportedError, match=words):
            wl.from_pretrained(tiny_llama_st, **kwargs)
    with pytest.raises(wl.PlanError, match="load_in_8bit asks for quantize='int8'"):
        wl.from_pretrained(tiny_llama_st, load_in_8bit=True, quantize="q4_k")
    with pytest.raises(TypeError, match="unexpected keyword argument 'frobnicate'"):
        wl.from_pretrained(tiny_llama_st, frobnicate=1)
    loader_only = {"low_cpu_mem_usage": True, "trust_remote_code": True}
    plain = wl.from_pretrained(tiny_llama_st, attn_implementation="sdpa", **loader_only)
    assert (
        plain.tensor_info(linear).dtype
        == wl.from_pretrained(tiny_llama_st).tensor_info(linear).dtype
    )
