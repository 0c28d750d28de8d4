"""The shapes a plan is asked for: ``CacheSpec`` (the KV cache) and ``RuntimeSpec`` (the limits
that size each device's scratch).

Each is a frozen dataclass whose fields the core checks when it is made, by the grammar that reads
a ``cache=`` or ``runtime=`` dict; wherever one is taken, such a dict is taken too. A plan's
``cache`` and ``runtime`` come back as these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from weightlift import _native

if TYPE_CHECKING:
    from weightlift._types import ModelSpec


def _check(spec: Any, key: str) -> None:
    """Check ``spec`` as the grammar reads keyword ``key``, and keep the values it reads (a cache
    dtype by its one name: ``"f16"`` is ``"fp16"``)."""
    for name, value in _native._spec_fields(key, spec).items():
        object.__setattr__(spec, name, value)


@dataclass(frozen=True)
class CacheSpec:
    """The KV cache to plan for: ``max_seq_len`` tokens × ``batch_size``, in ``dtype`` (fp16, bf16,
    fp8, q8, q6, q4 or f32; the quantised ones carry one f16 scale per 32 values, q6 is 8-bit K,
    4-bit V). ``offload=True`` plans transformers' ``OffloadedCache``: the whole cache in host RAM
    (the cpu's kv column) and, on each device that computes layers, two prefetch slots of its
    largest layer (one when it computes a single layer).
    """

    max_seq_len: int
    """Tokens per sequence (at least 1)."""
    batch_size: int = 1
    """Sequences (at least 1)."""
    dtype: str = "fp16"
    """The cache dtype's name."""
    offload: bool = False
    """True for a cache offloaded to host RAM."""

    def __post_init__(self) -> None:
        _check(self, "cache")

    def nbytes(self, spec: ModelSpec) -> int:
        """Bytes of the whole cache for a model."""
        return _native._cache_nbytes(self, spec)

    def __repr__(self) -> str:
        offload = ", offload=True" if self.offload else ""
        return (
            f"CacheSpec(max_seq_len={self.max_seq_len}, batch_size={self.batch_size}, "
            f"dtype={self.dtype!r}{offload})"
        )


@dataclass(frozen=True)
class RuntimeSpec:
    """Runtime limits that decide per-device scratch, named and defaulted as exllamav2's config."""

    max_input_len: int = 2048
    """Longest chunk of input ids in one forward pass: the workspace holds ``min(max_input_len,
    max_seq_len) × batch`` tokens."""
    max_attention_size: int = 2048**2
    """Largest attention-weights matrix, in elements per head."""
    max_dq_size: int = 512 * 1024**2
    """Most elements dequantised at once."""
    low_mem: bool = False
    """exllamav2's ``set_low_mem()``: ``max_input_len`` capped at 1024 and
    ``max_attention_size`` at 1024²."""

    def __post_init__(self) -> None:
        _check(self, "runtime")
