"""Shared fixtures: generated GGUF/safetensors files (written by gguf-py and the `safetensors`
package), the SmolLM2 demo model, and the tiny-llama reference pack beside the checkout."""

from __future__ import annotations

import os
from pathlib import Path

import gen_fixtures as gen
import pytest

REPO = Path(__file__).resolve().parents[1]
# The shared reference data sits beside the checkout (CI lays it out the same way).
REFERENCE = REPO.parent / "shared" / "reference"
TINY_LLAMA = REFERENCE / "tiny-llama"
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
    """gguf-py's reader of the demo model (about 2 s to build, so shared)."""
    import gguf

    return gguf.GGUFReader(demo_gguf)


def _reference(sub: str) -> Path:
    path = TINY_LLAMA / sub
    if not path.is_dir():
        pytest.skip(
            f"reference pack {path} is absent (expected ../shared/reference beside the repo)"
        )
    return path


@pytest.fixture(scope="session")
def tiny_llama_st() -> Path:
    return _reference("safetensors")


@pytest.fixture(scope="session")
def tiny_llama_st_sharded() -> Path:
    return _reference("safetensors-sharded")


@pytest.fixture(scope="session")
def tiny_llama_gguf_dir() -> Path:
    return _reference("gguf")
