"""The read-only records the native module hands out: a checkpoint's ``TensorInfo`` rows and
``ModelSpec``, the ``Device`` rows of an inventory, and a plan's ``DeviceUsage`` and
``Placement`` rows.

Each is a frozen dataclass. The native module builds it from a serde view of the core value
(``pythonize``), so what a field holds is decided in the core; here it is declared, documented
and given its ``repr``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, kw_only=True)
class TensorInfo:
    """One tensor of a checkpoint: where it is and what it holds."""

    name: str
    """The tensor's name as stored in the file."""
    dtype: str
    """The element type's name, e.g. ``"Q4_K"``, ``"F16"``, ``"BF16"``."""
    shape: tuple[int, ...]
    """The shape in numpy (row-major) order: the reverse of GGUF's ``ne``."""
    nbytes: int
    """Exact bytes on disk (``Model.tensor_info``: as the model holds it)."""
    file: str = field(repr=False)
    """The path of the file holding the data."""
    offset: int = field(repr=False)
    """Absolute byte offset of the data within ``file``."""
    layer: int | None
    """The repeating block this tensor belongs to, or None."""
    role: str | None
    """What the tensor does (``"attn_q"``, ``"ffn_down"``, ``"token_embd"``, ...), or None when
    unknown."""

    def __post_init__(self) -> None:
        # The native module hands the shape over as a list.
        object.__setattr__(self, "shape", tuple(self.shape))

    @property
    def n_elements(self) -> int:
        """Number of elements (the product of the shape)."""
        return math.prod(self.shape)


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """The architecture of a checkpoint, read from GGUF metadata or an HF ``config.json``. A plan
    source for ``weightlift.plan`` and ``weightlift.fit``."""

    architecture: str
    """``general.architecture`` or the HF ``model_type`` (e.g. ``"llama"``)."""
    n_layers: int
    """Number of repeating blocks."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int = field(repr=False)
    """Width of the feed-forward layer."""
    n_heads: int
    """Attention (query) heads."""
    n_kv_heads: list[int] = field(repr=False)
    """KV heads per layer (one entry per layer)."""
    head_dim: int
    """Dimension of one attention head."""
    vocab_size: int
    """Vocabulary size."""
    context_length: int = field(repr=False)
    """The context length the model was trained for."""
    rope_theta: float = field(repr=False)
    """RoPE base frequency."""
    rope_dim: int = field(repr=False)
    """Rotary dimensions, usually ``head_dim``."""
    rms_norm_eps: float = field(repr=False)
    """RMSNorm epsilon."""
    tie_word_embeddings: bool = field(repr=False)
    """True when the output projection reuses the token embedding."""
    attention_bias: bool = field(repr=False)
    """Whether the q/k/v projections carry biases."""

    def to_dict(self) -> dict[str, Any]:
        """Every field as a plain dict."""
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class Device:
    """One device of an inventory (``weightlift.devices()``, ``weightlift.parse_devices()``).
    ``capacity`` is None for an unbounded device (``disk``, or ``cpu`` when its memory is
    unknown)."""

    name: str
    """Normalised name: ``"cpu"``, ``"cuda:0"``, ``"virtual:1"``, ``"disk"``."""
    kind: str
    """``"cpu"``, ``"cuda"``, ``"virtual"`` or ``"disk"``."""
    capacity: int | None
    """Bytes, or None when unbounded."""
    reserve: int
    """Bytes kept free (exllamav2's ``reserve_vram``, llama.cpp's fit margin)."""
    overhead: int
    """Bytes of fixed overhead: for ``cuda:N`` its context and modules, cuBLAS workspace and
    graph memory (see ``overhead_parts``)."""
    overhead_parts: list[tuple[str, int, str]]
    """The overhead part by part: ``[(name, bytes, where the figure comes from)]``."""

    def __repr__(self) -> str:
        return f"Device({self.name!r}, capacity={self.capacity})"


@dataclass(frozen=True, kw_only=True)
class DeviceUsage:
    """A device's share of a plan (``Plan.devices``), in bytes. ``capacity`` and ``free`` are
    None for unbounded devices."""

    name: str
    """The device's normalised name, e.g. ``"cuda:0"``."""
    kind: str
    """``"cpu"``, ``"cuda"``, ``"virtual"`` or ``"disk"``."""
    capacity: int | None
    """Bytes the device has after any ``max_memory`` cap, or None when it is unbounded."""
    weights: int
    """Bytes of the weights placed here, after any dtype conversion."""
    kv: int
    """Bytes of the KV cache of the layers placed here."""
    scratch: int
    """Bytes of compute scratch; on the cpu, plus the host staging buffers for uploads."""
    kernel_scratch: int
    """The part of ``scratch`` the kernels allocate for themselves (on ``cuda:N``, its prompt
    products' tiles; 0 elsewhere)."""
    overhead: int
    """Bytes of fixed overhead charged here (0 on a device that holds nothing)."""
    overhead_parts: list[tuple[str, int, str]]
    """The overhead charged here, part by part: ``[(name, bytes, where the figure comes
    from)]``, e.g. ``("cuda context and modules", 569376768, "measured on this sm_90")``."""
    reserve: int
    """Bytes kept free."""
    free: int | None
    """Bytes left free, or None when the device is unbounded."""
    used: int
    """weights + kv + scratch + overhead + reserve."""
    layers: list[tuple[int, int]]
    """Inclusive layer ranges placed here, e.g. ``[(0, 11)]``."""
    holds: list[str]
    """Other things held here (``"token_embd"``, ``"output"``, ...)."""
    implicit: bool
    """True when the planner added the device (not in the given list)."""

    def __repr__(self) -> str:
        return (
            f"DeviceUsage({self.name!r}, weights={self.weights}, kv={self.kv}, "
            f"scratch={self.scratch}, overhead={self.overhead}, reserve={self.reserve}, "
            f"free={self.free})"
        )


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where one tensor of a plan goes (``Plan.tensors``). ``shards`` lists ``(device, start,
    end, bytes)`` row ranges when the tensor is split across devices (llama.cpp row split,
    tensor parallel), else None."""

    name: str
    """The tensor's name."""
    device: str
    """The device holding it, or its main device when it is split."""
    dtype: str
    """The dtype after any conversion."""
    nbytes: int
    """Bytes after any conversion."""
    layer: int | None
    """The repeating block the tensor belongs to, or None."""
    shards: list[tuple[str, int, int, int]] | None
    """The row ranges of a split tensor, ``[(device, start, end, bytes)]``, else None."""

    def __repr__(self) -> str:
        return f"Placement({self.name!r} -> {self.device}, {self.nbytes} bytes {self.dtype})"
