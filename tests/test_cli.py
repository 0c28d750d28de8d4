"""The `weightlift` command, run as a user runs it: a subprocess of the installed entry point."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import gen_fixtures as gen
import gguf
import pytest
import weightlift as wl
from conftest import ReferenceJson, engine_greedy_ids

EXE = Path(sys.executable).with_name("weightlift")


def run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    cmd = [str(EXE)] if EXE.exists() else [sys.executable, "-m", "weightlift.cli"]
    env = {**os.environ, "PYTHONWARNINGS": "error"}
    return subprocess.run(
        [*cmd, *map(str, args)], capture_output=True, text=True, timeout=120, env=env
    )


def test_devices_lists_driver_nvrtc_gpus_and_host():
    p = run("devices")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith("driver   ") and lines[1].startswith("nvrtc    "), p.stdout
    assert lines[2].startswith("cublas   "), p.stdout
    assert any(line.startswith("cpu ") for line in lines), p.stdout
    doc = json.loads(run("devices", "--json").stdout)
    assert set(doc) == {"driver", "nvrtc", "cublas", "devices", "plan"}
    assert [d["name"] for d in doc["plan"]][-1] == "disk"
    if not Path("/proc/driver/nvidia").exists():
        assert lines[0].startswith("driver   none: libcuda.so.1 not found: install the NVIDIA")
        assert "no cuda devices" in lines
    if "error" not in doc["nvrtc"]:
        # found without LD_LIBRARY_PATH pointing at it: the search covers sys.path's wheels
        assert Path(doc["nvrtc"]["path"]).name.startswith("libnvrtc.so"), doc["nvrtc"]
        assert lines[1] == f"nvrtc    {doc['nvrtc']['path']} ({doc['nvrtc']['version']})"


def test_devices_finds_pip_nvrtc_without_ld_library_path():
    """The wheel's NVRTC in this Python's site-packages is found with no LD_LIBRARY_PATH."""
    import importlib.util

    if importlib.util.find_spec("nvidia") is None:
        pytest.skip("no pip nvidia packages in this environment")
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    code = "import weightlift, json; print(json.dumps(weightlift.cuda_info()['nvrtc']))"
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert p.returncode == 0, p.stderr
    nvrtc = json.loads(p.stdout)
    assert "error" not in nvrtc, nvrtc
    assert "site-packages/nvidia/" in nvrtc["path"], nvrtc


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
    # the scan says that it ran, over what, and its result
    total = sum(int(t.n_bytes) for t in reader.tensors)
    assert doc["check"]["tensors"] == len(reader.tensors) and doc["check"]["bytes"] == total
    assert doc["check"]["non_finite"] == 0
    assert "check" not in json.loads(run("inspect", "--json", tiny_llama_gguf).stdout)
    p = run("inspect", "--check-tensors", tiny_llama_gguf)
    assert f"NaN/Inf scan of {len(reader.tensors)} tensors" in p.stdout
    assert "is finite" in p.stdout


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


# ----------------------------------------------------------------------------------------------
# weightlift load

DEMO_LOAD = ("--devices", "virtual:2x160MiB,cpu", "--ctx", "8192", "--cache", "q8")
MEMORY_COLS = ("weights", "kv", "scratch", "planned", "held")


def memory_table(out: str) -> dict[str, dict[str, float]]:
    """The `memory after load` table: device -> column -> MiB (plus the diff in %)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("memory after load"))
    assert lines[start + 1].split() == ["device", *MEMORY_COLS, "diff"]
    rows: dict[str, dict[str, float]] = {}
    for line in lines[start + 2 :]:
        cells = line.split()
        if len(cells) != len(MEMORY_COLS) + 2:
            break
        row = dict(zip(MEMORY_COLS, map(float, cells[1:-1]), strict=True))
        row["diff"] = float(cells[-1].rstrip("%"))
        rows[cells[0]] = row
    return rows


def test_load_demo_two_virtual_devices(demo_gguf):
    p = run("load", demo_gguf, *DEMO_LOAD)
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""  # no bar when stderr is not a terminal
    out = p.stdout
    # The plan table (Plan.explain) comes first, then the memory table.
    assert out.index("plan: llama (30 layers), strategy autosplit") < out.index(
        "memory after load (MiB)"
    )
    assert "ctx 8192 × batch 1, cache q8" in out
    rows = memory_table(out)
    assert list(rows) == ["virtual:0", "virtual:1", "cpu", "total"]
    for name, row in rows.items():
        assert row["held"] > 0, name  # both virtual devices hold layers
        assert abs(row["held"] - row["planned"]) <= row["planned"] / 100, (name, row)
        assert abs(row["diff"]) <= 1.0, (name, row)
        parts = row["weights"] + row["kv"] + row["scratch"]
        assert abs(parts - row["planned"]) <= 0.02, (name, row)
    # The weights held sum to the file's tensor bytes (gguf-py: 96,576,768 B = 92.10 MiB).
    assert rows["total"]["weights"] == pytest.approx(96_576_768 / 2**20, abs=0.01)
    assert "loaded 92.1 MiB in " in out and "GB/s" in out


def test_load_json_matches_gguf_py(demo_gguf, demo_reader):
    p = run("load", demo_gguf, *DEMO_LOAD, "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    memory = doc["memory"]
    assert set(memory) == {"virtual:0", "virtual:1", "cpu"}
    for name, row in memory.items():
        assert row["planned"] == row["weights"] + row["kv"] + row["scratch"], name
        assert abs(row["held"] - row["planned"]) <= row["planned"] / 100, (name, row)
    # Weights: exactly the tensor bytes gguf-py reads; a file tensor is placed once.
    assert sum(r["weights"] for r in memory.values()) == sum(
        int(t.n_bytes) for t in demo_reader.tensors
    )
    assert doc["bytes"] == sum(int(t.n_bytes) for t in demo_reader.tensors)
    # KV: 2 x n_kv_heads x head_dim x ctx per layer at 8.5 bits (q8: one f16 scale per 32).
    f = demo_reader.fields
    n_layer = int(f["llama.block_count"].contents())
    n_head = int(f["llama.attention.head_count"].contents())
    n_kv = int(f["llama.attention.head_count_kv"].contents())
    head_dim = int(f["llama.embedding_length"].contents()) // n_head
    assert sum(r["kv"] for r in memory.values()) == n_layer * 2 * n_kv * head_dim * 8192 * 17 // 16
    assert memory["cpu"]["kv"] == 0  # every layer sits on a virtual device, its cache beside it
    assert doc["plan"]["strategy"] == "autosplit"


def test_load_json_offloaded_cache(demo_gguf, demo_reader):
    """--cache-offload: the plan's kv column holds the whole cache on the cpu and two prefetch
    slots (one layer each) on every layer device; what is held matches it within 1 %."""
    p = run("load", demo_gguf, *DEMO_LOAD, "--cache-offload", "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    memory = doc["memory"]
    for name, row in memory.items():
        assert row["planned"] == row["weights"] + row["kv"] + row["scratch"], name
        assert abs(row["held"] - row["planned"]) <= row["planned"] / 100, (name, row)
    f = demo_reader.fields
    n_layer = int(f["llama.block_count"].contents())
    n_head = int(f["llama.attention.head_count"].contents())
    n_kv = int(f["llama.attention.head_count_kv"].contents())
    head_dim = int(f["llama.embedding_length"].contents()) // n_head
    layer = 2 * n_kv * head_dim * 8192 * 17 // 16  # q8: 8.5 bits per value
    layers = doc["plan"]["layers"]
    assert doc["plan"]["cache"]["offload"] is True
    assert memory["cpu"]["kv"] == n_layer * layer + min(2, layers.count("cpu")) * layer
    for name in ("virtual:0", "virtual:1"):
        assert memory[name]["kv"] == min(2, layers.count(name)) * layer, name


def test_load_progress_bar(demo_gguf):
    p = run("load", demo_gguf, *DEMO_LOAD, "--progress")
    assert p.returncode == 0, p.stderr
    bar = p.stderr
    assert "loading: 100%" in bar and "92.1M/92.1M" in bar  # bytes in binary units
    assert "B/s" in bar and "<00:00" in bar  # the rate and the ETA


def test_load_read_paths(demo_gguf):
    """use_mmap=False, O_DIRECT (buffered where refused) and the NaN/Inf scan all load."""
    p = run("load", demo_gguf, "--no-mmap", "--direct-io", "--check-tensors")
    assert p.returncode == 0, p.stderr
    rows = memory_table(p.stdout)
    assert rows["cpu"]["weights"] == pytest.approx(96_576_768 / 2**20, abs=0.01)
    assert abs(rows["cpu"]["diff"]) <= 1.0


@pytest.mark.parametrize(
    "args, has",
    [
        (("--devices", "virtual:1x16MiB", "-ngl", "-1"), "16.00 MiB"),
        # --max-memory in device order caps virtual:0 below its capacity.
        (("--devices", "virtual:1x64MiB", "-ngl", "30", "--max-memory", "8MiB"), "8.00 MiB"),
        (
            ("--devices", "virtual:1x64MiB", "-ngl", "30", "--max-memory", "virtual:0=8MiB"),
            "8.00 MiB",
        ),
    ],
    ids=["capacity", "max-memory-list", "max-memory-map"],
)
def test_load_too_small_device_exit_2(demo_gguf, args, has):
    p = run("load", demo_gguf, *args)
    assert p.returncode == 2
    assert p.stdout == ""
    lines = p.stderr.splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("weightlift: error: out of memory")
    assert "virtual:0 is short by" in lines[0] and f"has {has}" in lines[0]
    assert "Traceback" not in p.stderr


def test_plan_with_a_bf16_cache(demo_gguf):
    """--cache bf16: the one cache grammar, 2 bytes a value in the plan's kv column."""
    p = run(
        "plan", demo_gguf, "--devices", "virtual:2x160MiB,cpu", "--ctx", "512", "--cache", "bf16"
    )
    assert p.returncode == 0, p.stderr
    assert "ctx 512 × batch 1, cache bf16" in p.stdout


@pytest.mark.parametrize(
    "args, expected",
    [
        (("--devices", "virtual:lots"), "'lots'"),
        (("--cache", "q9"), "'q9'"),
        (("--strategy", "nope"), "'nope'"),
    ],
    ids=["devices", "cache", "strategy"],
)
def test_load_bad_request_exit_2(demo_gguf, args, expected):
    p = run("load", demo_gguf, *args)
    assert p.returncode == 2 and p.stdout == ""
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("weightlift: error: "), p.stderr
    assert expected in lines[0]


def test_load_ctrl_c_exit_130(demo_gguf):
    """SIGINT mid-load: the load stops, frees what it allocated, and the command exits 130."""
    import signal

    # The real CLI, with the progress callback slowed so the signal lands mid-load.
    script = (
        "import signal, sys, time\n"
        # Ctrl-C as at a terminal, whatever this test's process inherited (see conftest)
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "import weightlift.cli as cli\n"
        "call = cli._ProgressBar.__call__\n"
        "def slow(self, *a):\n"
        "    if not self.done:\n"
        "        sys.stderr.write('started\\n'); sys.stderr.flush()\n"
        "    time.sleep(0.05)\n"
        "    return call(self, *a)\n"
        "cli._ProgressBar.__call__ = slow\n"
        "sys.exit(cli.main(sys.argv[1:]))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script, "load", str(demo_gguf), "--devices", "virtual:2x160MiB"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    assert proc.stderr.readline() == "started\n"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err == "weightlift: interrupted\n"
    assert out == ""


def test_load_cancel_frees_everything(demo_gguf, monkeypatch, capsys):
    """A KeyboardInterrupt from the progress path cancels the load: exit 130, nothing held."""
    import weightlift
    import weightlift.cli as cli

    models: list[weightlift.Model] = []
    model_cls = weightlift.Model

    def make(*a, **kw):
        m = model_cls(*a, **kw)
        models.append(m)
        return m

    calls = []

    def interrupt(self, done, total, tensor, device):
        calls.append(tensor)
        if len(calls) == 20:
            raise KeyboardInterrupt
        return True

    monkeypatch.setattr(cli.weightlift, "Model", make)
    monkeypatch.setattr(cli._ProgressBar, "__call__", interrupt)
    try:
        status = cli.main(["load", str(demo_gguf), "--devices", "virtual:2x160MiB"])
    finally:
        monkeypatch.undo()
    assert status == 130
    assert capsys.readouterr().err == "weightlift: interrupted\n"
    assert len(calls) == 20 and len(models) == 1
    m = models[0]
    assert not m.loaded and m.plan is None
    assert all(v == 0 for v in m.device_usage().values()), m.device_usage()


GREEDY = ReferenceJson("smollm2-135m/greedy.json")


def test_run_prints_llamacpp_greedy_text_then_timings(demo_gguf):
    p = run(
        "run", demo_gguf, "--devices", "virtual:2x160MiB,cpu", "--ctx", "256",
        "-p", GREEDY["prompt"], "-n", "32", "--temp", "0", "--threads", "2",
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    # llama.cpp's ids, or ids parting from a reference only at a near-tie (conftest), as the
    # same model computes them on the cpu alone, up to the end-of-generation token
    with wl.load_gguf(demo_gguf, n_ctx=256) as m:
        ids = engine_greedy_ids(m)
        n = ids.index(m.token_eos()) if m.token_eos() in ids else len(ids)
        text = m.detokenize(ids[:n])
    if ids == GREEDY["llamacpp"]["ids"]:
        assert text == GREEDY["llamacpp"]["text"]
    assert p.stdout == GREEDY["prompt"] + text + "\n"
    lines = p.stderr.splitlines()
    assert any(line.startswith("load time") for line in lines)
    prompt = next(line for line in lines if line.startswith("prompt eval time"))
    assert "/     5 tokens" in prompt and "tokens per second" in prompt
    gen_line = next(line for line in lines if line.startswith("eval time"))
    assert f"/ {min(n, 31):5d} runs" in gen_line and "tokens per second" in gen_line


CHAT_FLAGS = ("--chat", "-n", "6", "--temp", "0", "--ctx", "512", "--threads", "2")


def chat(path: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """``weightlift run PATH --chat`` greedily, with ``stdin`` as its input (None: no stdin)."""
    cmd = [str(EXE)] if EXE.exists() else [sys.executable, "-m", "weightlift.cli"]
    return subprocess.run(
        [*cmd, "run", str(path), *CHAT_FLAGS, *args],
        input=stdin,
        stdin=subprocess.DEVNULL if stdin is None else None,
        capture_output=True,
        text=True,
        timeout=120,
    )


def usage(stderr: str, line: str) -> list[int]:
    """The token count of every timing line that starts with ``line`` (``prompt eval time``,
    ``eval time``, ``reused prompt``)."""
    rows = [r for r in stderr.splitlines() if r.startswith(line)]
    return [int(re.search(r"(\d+) (?:tokens|runs)\b", r)[1]) for r in rows]


@pytest.fixture(scope="module")
def chat_model(demo_gguf) -> wl.Model:
    """The demo model as ``run --chat`` loads it with CHAT_FLAGS (run's 512-token batches)."""
    model = wl.Model(demo_gguf, runtime=wl.RuntimeSpec(max_input_len=512), n_threads=2)
    model.load(cache=wl.CacheSpec(512, 1, "fp16"))
    return model


def replies(model: wl.Model, turns: list[str]) -> list[str]:
    """The greedy answers to ``turns``, each asked with the whole conversation before it."""
    messages: list[dict[str, str]] = []
    out = []
    for user in turns:
        messages.append({"role": "user", "content": user})
        r = model.create_chat_completion(messages, max_tokens=6, temperature=0, repeat_penalty=1.0)
        out.append(r["choices"][0]["message"]["content"])
        messages.append({"role": "assistant", "content": out[-1]})
    return out


def test_run_chat_answers_p_then_stdin_turns_until_exit(demo_gguf, chat_model):
    # llama-cli's conversation mode: -p is the first turn, each line of stdin the next, /exit
    # ends the chat (the line after it is never read as a turn), blank lines are no turn.
    turns = ["My name is Ada and I like tea.", "What is my name?"]
    p = chat(demo_gguf, "-p", turns[0], stdin=f"{turns[1]}\n\n/exit\nNever answered\n")
    assert p.returncode == 0, p.stderr
    # Not a terminal: no "> " marker, only the answers, each on its line.
    answers = replies(chat_model, turns)
    assert p.stdout == "".join(f"{r}\n" for r in answers)
    # (Asked alone, the second turn gets another answer: the one above needed the first turn.)
    assert replies(chat_model, turns[1:]) != answers[1:]
    # Two turns, the second on top of the first: its prompt starts with the first exchange,
    # which the cache still holds (the first prompt and every token fed back after it).
    prompts, evals = usage(p.stderr, "prompt eval time"), usage(p.stderr, "eval time")
    assert len(prompts) == len(evals) == 2
    assert usage(p.stderr, "reused prompt") == [prompts[0] + evals[0]]
    assert p.stderr.count("load time") == 1


def test_run_chat_without_p_reads_every_turn_until_end_of_input(demo_gguf, chat_model):
    turns = ["Hi", "What is two plus two?"]
    p = chat(demo_gguf, stdin="".join(f"{t}\n" for t in turns))
    assert p.returncode == 0, p.stderr
    assert p.stdout == "".join(f"{r}\n" for r in replies(chat_model, turns))
    assert len(usage(p.stderr, "prompt eval time")) == 2
    assert "reused prompt" in p.stderr


def test_run_chat_with_no_input_answers_p_and_ends(demo_gguf, chat_model):
    # As `make demo` runs it: stdin at end of input (or closed) ends the chat after -p.
    p = chat(demo_gguf, "-p", "Hi")
    assert p.returncode == 0, p.stderr
    assert p.stdout == replies(chat_model, ["Hi"])[0] + "\n"
    p = chat(demo_gguf, "-p", "Hi", stdin="")
    assert p.returncode == 0, p.stderr
    assert len(usage(p.stderr, "prompt eval time")) == 1


def test_run_chat_takes_a_built_in_chat_format(demo_gguf, chat_model):
    # --chat-format: the reply and prompt of that format in place of the model's template
    p = chat(demo_gguf, "-p", "Hi", "--chat-format", "zephyr")
    assert p.returncode == 0, p.stderr
    messages = [{"role": "user", "content": "Hi"}]
    args = {"max_tokens": 6, "temperature": 0, "repeat_penalty": 1.0}
    own = chat_model.create_chat_completion(messages, **args)["usage"]["prompt_tokens"]
    chat_model.chat_format = "zephyr"
    try:
        r = chat_model.create_chat_completion(messages, **args)
    finally:
        chat_model.chat_format = None
    assert p.stdout == r["choices"][0]["message"]["content"] + "\n"
    assert usage(p.stderr, "prompt eval time") == [r["usage"]["prompt_tokens"]] != [own]
    p = chat(demo_gguf, "-p", "Hi", "--chat-format", "nope")
    assert p.returncode == 2, p.stderr
    assert "chat format 'nope'" in p.stderr and "chatml" in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize(
    ("typed", "end"), [(b"/exit\n", "\n> "), (b"\x04", "\n> \n")], ids=["exit", "ctrl-d"]
)
def test_run_chat_on_a_terminal_prompts_for_each_turn(demo_gguf, typed, end):
    # stdin a terminal: "> " asks for each turn after the -p answer; /exit ends the chat, and
    # so does Ctrl-D (end of input), which also ends the prompt's line.
    pty = pytest.importorskip("pty")
    leader, follower = pty.openpty()
    try:
        cmd = [str(EXE)] if EXE.exists() else [sys.executable, "-m", "weightlift.cli"]
        proc = subprocess.Popen(
            [*cmd, "run", str(demo_gguf), *CHAT_FLAGS, "-p", "Hi"],
            stdin=follower,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        os.write(leader, typed)
        out, err = proc.communicate(timeout=120)
    finally:
        os.close(leader)
        os.close(follower)
    assert proc.returncode == 0, err
    assert out.endswith(end) and out.count("> ") == 1
    assert len(usage(err, "prompt eval time")) == 1


@pytest.mark.parametrize("stdin", [None, "hi\n"], ids=["p", "stdin"])
def test_run_chat_without_a_chat_template_exit_2(tiny_llama_gguf, stdin):
    args = ("-p", "hi") if stdin is None else ()
    p = chat(tiny_llama_gguf, *args, stdin=stdin)
    assert p.returncode == 2, p.stderr
    assert (
        "a chat completion with this model is not supported: its checkpoint has no chat "
        "template (tokenizer.chat_template)" in p.stderr
    )
    assert "--chat-format" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ([], "expected a prompt"),
        (["-p", "hi", "--temp", "-1"], "temperature"),
        (["-p", "x" * 3000, "--ctx", "64"], "do not fit the cache"),
        (["-p", "hi", "--compute", "turbo"], "compute"),
    ],
)
def test_run_bad_request_exit_2(demo_gguf, args, expected):
    p = run("run", demo_gguf, *args)
    assert p.returncode == 2, p.stderr
    assert expected in p.stderr and "Traceback" not in p.stderr
    # nothing is echoed before the request is refused
    assert p.stdout == ""


def test_load_one_rank_of_a_world(demo_gguf):
    # A rank's process: its one device stands for every rank, and it holds only its own share.
    p = run(
        "load", demo_gguf, "--devices", "virtual:256MiB,cpu", "--ctx", "256",
        "--world", "localhost:2", "--rank", "1", "--json",
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert [r["rank"] for r in doc["plan"]["tp"]["ranks"]] == [0, 1]
    memory = doc["memory"]
    assert set(memory) == {"virtual:1", "cpu"}
    for name, row in memory.items():
        assert row["held"] == row["planned"] > 0, (name, row)
    # The plan over both ranks, as every rank makes it.
    p = run("plan", demo_gguf, "--devices", "virtual:2x256MiB,cpu", "--world", "localhost:2")
    assert p.returncode == 0, p.stderr
    assert "rank   1  localhost cuda:1  (planned as virtual:1)" in p.stdout


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--rank", "0", "-ngl", "4"], "--world: expected only the cache flags beside it"),
        (["--rank", "2"], "below the world's 2 ranks"),
        (["--rank", "0", "-p", "hi"], "no NCCL transport"),
        (["--rank", "0", "--chat"], "cannot share a terminal"),
    ],
)
def test_run_one_rank_refuses_clearly(demo_gguf, args, expected):
    p = run("run", demo_gguf, "--devices", "virtual:256MiB,cpu", "--world", "localhost:2", *args)
    assert p.returncode == 2, p.stderr
    assert expected in p.stderr and "Traceback" not in p.stderr
