"""The `weightlift` command, run as a user runs it: a subprocess of the installed entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gen_fixtures as gen
import gguf
import pytest

EXE = Path(sys.executable).with_name("weightlift")


def run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    cmd = [str(EXE)] if EXE.exists() else [sys.executable, "-m", "weightlift.cli"]
    env = {**os.environ, "PYTHONWARNINGS": "error"}
    return subprocess.run(
        [*cmd, *map(str, args)], capture_output=True, text=True, timeout=120, env=env
    )


def test_inspect_demo_model(demo_gguf):
    p = run("inspect", demo_gguf)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "llama" in out and "30 layers" in out
    assert "Q4_1" in out and "210 tensors" in out and "Q8_0" in out
    assert "134,515,008" in out  # parameters
    assert "96,576,768" in out  # bytes of tensor data
    assert "blk 0-29" in out  # bytes per layer, equal runs grouped
    assert "49152 tokens" in out and "smollm" in out
    assert p.stderr == ""


def test_inspect_json(demo_gguf, demo_reader):
    p = run("inspect", "--json", demo_gguf)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    reader = demo_reader
    assert doc["format"] == "gguf" and doc["architecture"] == "llama"
    assert doc["n_tensors"] == len(reader.tensors) == 272
    assert doc["n_params"] == sum(int(t.n_elements) for t in reader.tensors)
    assert doc["nbytes"] == sum(int(t.n_bytes) for t in reader.tensors)
    assert doc["types"]["Q4_1"]["count"] == 210
    assert sum(row["bytes"] for row in doc["types"].values()) == doc["nbytes"]
    assert len(doc["layer_bytes"]) == 30
    assert sum(doc["layer_bytes"]) + doc["non_layer_bytes"] == doc["nbytes"]
    assert doc["tokenizer"]["n_tokens"] == 49152
    assert doc["spec"]["n_layers"] == 30
    assert "tensors" not in doc


def test_inspect_tensors(tiny_llama_gguf):
    p = run("inspect", "--tensors", tiny_llama_gguf)
    assert p.returncode == 0, p.stderr
    assert "blk.1.ffn_down.weight" in p.stdout and "token_embd.weight" in p.stdout
    p = run("inspect", "--json", "--tensors", "--check-tensors", tiny_llama_gguf)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    reader = gguf.GGUFReader(tiny_llama_gguf)
    assert [t["name"] for t in doc["tensors"]] == [t.name for t in reader.tensors]
    assert [t["offset"] for t in doc["tensors"]] == [int(t.data_offset) for t in reader.tensors]


def test_inspect_safetensors_folder(st_sharded):
    folder, _ = st_sharded
    p = run("inspect", folder)
    assert p.returncode == 0, p.stderr
    assert "safetensors (3 files)" in p.stdout and "llama" in p.stdout


@pytest.mark.parametrize(
    "content, expected",
    [
        (b"", "truncated"),
        (b"GGUF\x03\x00", "truncated"),
        (b"not a model at all, just text", "GGUF"),
    ],
    ids=["empty", "short-header", "text"],
)
def test_bad_file_one_line_exit_2(tmp_path, content, expected):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    p = run("inspect", bad)
    assert p.returncode == 2
    assert p.stdout == ""
    lines = p.stderr.splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("weightlift: error: ")
    assert str(bad) in lines[0] and expected in lines[0]
    assert "Traceback" not in p.stderr


def test_missing_file_exit_2(tmp_path):
    p = run("inspect", tmp_path / "nope.gguf")
    assert p.returncode == 2
    assert p.stderr.startswith("weightlift: error: ") and "nope.gguf" in p.stderr
    assert "No such file" in p.stderr and "Traceback" not in p.stderr


def test_check_tensors_flag_reports_nan(tmp_path):
    path = tmp_path / "nan.gguf"
    gen.write_tiny_llama_gguf(path, poison="nan_f32")
    assert run("inspect", path).returncode == 0
    p = run("inspect", "--check-tensors", path)
    assert p.returncode == 2
    assert "blk.1.attn_norm.weight" in p.stderr and "Traceback" not in p.stderr


def test_usage_errors():
    p = run()
    assert p.returncode == 2 and "usage:" in p.stderr
    p = run("--version")
    assert p.returncode == 0 and p.stdout.startswith("weightlift ")
