"""The package surface: exports, the exception hierarchy, and OS errors from open()."""

from __future__ import annotations

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
}


def test_exports():
    assert CONTRACT <= set(wl.__all__)
    for name in wl.__all__:
        assert hasattr(wl, name), name
    assert wl.__version__ == "0.1.0"


def test_exception_hierarchy():
    assert issubclass(wl.FormatError, wl.WeightliftError)
    assert issubclass(wl.FormatError, ValueError)
    assert issubclass(wl.OutOfMemoryError, wl.WeightliftError)
    assert issubclass(wl.OutOfMemoryError, MemoryError)
    assert issubclass(wl.PlanError, wl.WeightliftError) and issubclass(wl.PlanError, ValueError)
    assert issubclass(wl.ClosedError, wl.WeightliftError) and issubclass(wl.ClosedError, ValueError)
    assert issubclass(wl.CudaUnavailable, wl.DeviceError)
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
