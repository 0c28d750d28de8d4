"""Shared fixtures: generated GGUF/safetensors files (written by gguf-py and the `safetensors`
package), the SmolLM2 demo model, and the reference pack (`make reference` lays it out from
`tests/reference/`; a missing or stale one fails the tests that read it, naming the target)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import gen_fixtures as gen
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]

# Ctrl-C as at a terminal: a shell without job control starts a background job with SIGINT
# ignored (POSIX), and Python then leaves it ignored, so the tests of Ctrl-C would see none.
signal.signal(signal.SIGINT, signal.default_int_handler)
# The reference pack as `make reference` lays it out (`$WEIGHTLIFT_REFERENCE` moves it).
REFERENCE = Path(os.environ.get("WEIGHTLIFT_REFERENCE") or REPO / ".cache" / "reference")
TINY_LLAMA = REFERENCE / "tiny-llama"


def reference_problem() -> str | None:
    """Why the reference pack cannot be read, or None. `materialize.py` writes its copy of the
    manifest last, so a copy equal to the checkout's means complete and current."""
    stamp = REFERENCE / "manifest.json"
    if not stamp.is_file():
        return (
            f"the reference data is missing: {stamp} does not exist; run `make reference` "
            "(`make test` does), which lays it out from tests/reference/"
        )
    if "WEIGHTLIFT_REFERENCE" not in os.environ:
        want = REPO / "tests" / "reference" / "manifest.json"
        if want.is_file() and want.read_bytes() != stamp.read_bytes():
            return (
                f"the reference data in {REFERENCE} is out of date with {want}; "
                "run `make reference`"
            )
    return None


@pytest.fixture(scope="session")
def reference_data() -> Path:
    """The reference pack's folder; fails the test, naming `make reference`, without it."""
    problem = reference_problem()
    if problem:
        pytest.fail(problem, pytrace=False)
    return REFERENCE


def reference_file(rel: str) -> Path:
    """A file of the reference pack; fails the test, naming `make reference`, without it."""
    problem = reference_problem()
    if problem:
        pytest.fail(problem, pytrace=False)
    path = REFERENCE / rel
    if not path.exists():
        pytest.fail(f"reference file {path} is missing; run `make reference`", pytrace=False)
    return path


def kept_rows(name: str) -> tuple[list[int], np.ndarray]:
    """Logits the reference pack keeps at some positions only, whole vocabulary rows:
    `<name>_rows.npy` holds the rows at the positions `<name>_rows.json` lists (`name` under
    the pack, e.g. `tiny-llama/hf_dequant_logits_Q8_0`). `(positions, rows)`: compare the rows
    with the logits at those positions."""
    listed = json.loads(reference_file(f"{name}_rows.json").read_text())
    rows = np.load(reference_file(f"{name}_rows.npy"))
    positions = [int(p) for p in listed["positions"]]
    assert rows.shape[0] == len(positions), f"{name}_rows: {rows.shape} rows, {positions}"
    return positions, rows


class ReferenceJson(Mapping[str, Any]):
    """A JSON file of the reference pack, read at first use, so a test module imports (and its
    other tests run) without the data."""

    def __init__(self, rel: str) -> None:
        self.rel = rel
        self._read: dict[str, Any] | None = None

    def _data(self) -> dict[str, Any]:
        if self._read is None:
            self._read = json.loads(reference_file(self.rel).read_text())
        return self._read

    def __getitem__(self, key: str) -> Any:
        return self._data()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data())

    def __len__(self) -> int:
        return len(self._data())


GREEDY_REFERENCE = ReferenceJson("smollm2-135m/greedy.json")


def greedy_parting(ids: list[int], margin: float = 0.1) -> str | None:
    """The Rust suite's greedy rule (`follows_a_greedy_reference`), or None where `ids` keep it:
    the demo prompt's greedy ids are one reference's (llama.cpp's or transformers'), or part from
    the one they follow longest only where its own top-two margin is below `margin`. The fast
    path rounds activations to 8 bits as llama.cpp does, not bit for bit, and last-bit
    differences between instruction sets move its logits by a few hundredths through that
    rounding, so at a near-tie (where the references themselves part) it may take either
    branch."""
    parted = []
    for engine in ("llamacpp", "transformers"):
        theirs = GREEDY_REFERENCE[engine]["ids"]
        n = min(len(ids), len(theirs))
        agree = next((i for i in range(n) if ids[i] != theirs[i]), n)
        if agree == n:
            return None
        gap = GREEDY_REFERENCE[engine]["top1_minus_top2_per_step"][agree]
        parted.append((agree, engine, theirs[agree], gap))
    longest = max(p[0] for p in parted)
    if any(p[0] == longest and p[3] < margin for p in parted):
        return None
    return "; ".join(
        f"{engine}'s ids part from ours at step {step} ({theirs} against {ids[step]}), where its "
        f"margin is {gap:.3f}"
        for step, engine, theirs, gap in parted
    )


def engine_greedy_ids(model: Any, n: int = 32) -> list[int]:
    """The demo prompt's first `n` greedy ids as `model` (a loaded `Model`) computes them, one
    forward call a token on its own cache, emptied first (a cache of another size passed to
    `forward` would become the model's), checked by `greedy_parting`: what the generation and
    completion calls of the same model must give."""
    import weightlift as wl

    cache = model.cache if model.cache is not None else wl.Cache(model)
    cache.reset()
    logits = model.forward(GREEDY_REFERENCE["prompt_ids"], cache=cache)
    ids: list[int] = []
    while len(ids) < n:
        ids.append(int(np.argmax(logits.reshape(-1))))
        logits = model.forward(ids[-1:], cache=cache)
    parting = greedy_parting(ids)
    assert parting is None, f"greedy ids {ids}: {parting}"
    return ids


DATA = Path(__file__).resolve().parent / "data"
DEFAULT_DEMO = REPO / ".cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def fixtures_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fixtures")


@pytest.fixture(scope="session")
def all_types_gguf(fixtures_dir: Path) -> tuple[Path, dict[str, gen.Q]]:
    path = fixtures_dir / "all_types.gguf"
    return path, gen.write_all_types_gguf(path)


@pytest.fixture(scope="session")
def tiny_llama_gguf(fixtures_dir: Path) -> Path:
    path = fixtures_dir / "tiny_llama.gguf"
    gen.write_tiny_llama_gguf(path)
    return path


@pytest.fixture(scope="session")
def st_single(fixtures_dir: Path) -> tuple[Path, dict]:
    path = fixtures_dir / "single.safetensors"
    return path, gen.write_st_single(path)


@pytest.fixture(scope="session")
def st_folder(fixtures_dir: Path) -> tuple[Path, dict]:
    path = fixtures_dir / "st_folder"
    return path, gen.write_st_folder(path)


@pytest.fixture(scope="session")
def st_sharded(fixtures_dir: Path) -> tuple[Path, dict]:
    path = fixtures_dir / "st_sharded"
    return path, gen.write_st_sharded(path)


@pytest.fixture(scope="session")
def demo_gguf() -> Path:
    """The SmolLM2 demo model. Missing is a failure, not a skip: `make test` always fetches it."""
    path = Path(os.environ.get("WEIGHTLIFT_DEMO_GGUF", DEFAULT_DEMO))
    if not path.is_file():
        pytest.fail(f"demo model {path} is missing; run `make demo-model` (make test does)")
    return path


@pytest.fixture(scope="session")
def demo_reader(demo_gguf: Path):
    """gguf-py's reader of the demo model, shared: it takes seconds to build (gguf-py reads the
    vocabulary's metadata a field at a time)."""
    import gguf

    return gguf.GGUFReader(demo_gguf)


def _reference(sub: str) -> Path:
    return reference_file(f"tiny-llama/{sub}")


@pytest.fixture(scope="session")
def tiny_llama_st() -> Path:
    return _reference("safetensors")


@pytest.fixture(scope="session")
def tiny_llama_st_sharded() -> Path:
    return _reference("safetensors-sharded")


@pytest.fixture(scope="session")
def tiny_llama_gguf_dir() -> Path:
    return _reference("gguf")
