"""The classes the native module hands out, declared here.

The read-only records: a checkpoint's ``TensorInfo`` rows and ``ModelSpec``, the ``Device`` rows
of an inventory, and a plan's ``DeviceUsage`` and ``Placement`` rows. Each is a frozen
dataclass. The native module builds it from a serde view of the core value (``pythonize``), so
what a field holds is decided in the core; here it is declared, documented and given its
``repr``.

``Checkpoint`` (with ``open``) and ``Plan`` subclass native classes that hold the core value and
what needs Rust (the memory map and its views; the rules a plan answers from). Their properties
read one pythonized view of it, and their dunders are written here.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from weightlift import _native
from weightlift._errors import ClosedError
from weightlift._specs import CacheSpec, RuntimeSpec


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


def open(
    path: str | os.PathLike[str], *, check_tensors: bool = False, vocab_only: bool = False
) -> Checkpoint:
    """Open a GGUF file (or the first of a split set), a safetensors file, a folder of safetensors
    shards, or a ``model.safetensors.index.json``. Nothing is copied: tensors stay in the memory
    map. Every structural check runs before this returns.

    ``check_tensors`` also scans every float tensor, and the scales of quantised blocks, for NaN
    and Inf. ``vocab_only`` reads the metadata and tokenizer only (no tensor table).

    Raises ``FormatError`` for a corrupt or unsupported file and an ``OSError`` subclass when the
    operating system refuses it.
    """
    return Checkpoint(path, check_tensors=check_tensors, vocab_only=vocab_only)


class Checkpoint(_native.Checkpoint):
    """An opened checkpoint. Tensor data stays in the memory map; ``raw()`` views share it.

    Usable as a context manager. ``close()`` drops this object's hold on the files; views already
    handed out by ``raw()`` keep the map alive until the last of them is gone.
    """

    __slots__ = ()

    @property
    def files(self) -> list[str]:
        """The files that make up the checkpoint, in order."""
        return self._view()["files"]

    @property
    def spec(self) -> ModelSpec | None:
        """The architecture, or None when it could not be read (see ``spec_error``)."""
        spec = self._view()["spec"]
        return None if spec is None else ModelSpec(**spec)

    @property
    def spec_error(self) -> str | None:
        """Why ``spec`` is None, or None when it is present."""
        return self._view()["spec_error"]

    @property
    def warnings(self) -> list[str]:
        """Things that did not stop the checkpoint from opening: an architecture whose tensor
        roles are unknown, tensors that match no role, a tie the config contradicts."""
        return self._view()["warnings"]

    @property
    def tensors(self) -> list[TensorInfo]:
        """The tensor table, in the order the checkpoint lists it (empty when opened
        ``vocab_only``)."""
        return self._tensors()

    @property
    def tokenizer(self) -> dict[str, Any]:
        """A summary of the tokenizer: ``model``, ``pre``, ``n_tokens``, ``n_merges``,
        ``bos_token_id``, ``eos_token_id`` and ``has_tokenizer_json``."""
        return self._view()["tokenizer"]

    @property
    def experts(self) -> dict[str, Any] | None:
        """How a mixture-of-experts model routes: ``n_experts`` a layer, ``n_used`` a token,
        ``expert_ffn`` (each expert's width), ``norm_topk_prob`` (whether the chosen weights are
        renormalised) and ``dense_layers`` where some layers are dense; None for a dense model.
        Raises ``FormatError`` where the metadata or config.json is corrupted."""
        return self._experts()

    @property
    def sliding_window(self) -> dict[str, Any] | None:
        """The sliding-window attention: ``window`` (tokens) and ``layers`` (the indexes of the
        layers that attend to it; the others attend to everything); None without one."""
        return self._sliding_window()

    @property
    def rope_scaling(self) -> dict[str, Any] | None:
        """The RoPE scaling the forward pass applies: ``kind`` (``linear``, ``llama3``,
        ``yarn`` or ``longrope``), ``factor`` (the context's stretch) and ``original_context``
        where the checkpoint gives them, ``from`` (``config.json``, ``metadata`` or
        ``tensors``) and ``layers`` (``all``, or ``full_attention``: Gemma 3 scales its global
        layers only); None for plain RoPE. Raises ``UnsupportedError`` for a scaling the
        forward pass does not apply, as loading would."""
        return self._rope_scaling()

    @property
    def config(self) -> dict[str, Any] | None:
        """The HF ``config.json`` beside safetensors weights, as a dict; None for GGUF."""
        return self._view()["config"]

    @property
    def n_params(self) -> int:
        """Total number of parameters (elements over all tensors)."""
        return self._view()["n_params"]

    @property
    def nbytes(self) -> int:
        """Total bytes of tensor data."""
        return self._view()["nbytes"]

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *_args: object) -> Literal[False]:
        self.close()
        return False

    def __contains__(self, key: str, /) -> bool:
        return self._tensor(key) is not None

    def __getitem__(self, key: str, /) -> TensorInfo:
        """The ``TensorInfo`` of a tensor by name; KeyError when absent."""
        info = self._tensor(key)
        if info is None:
            raise KeyError(key)
        return info

    def __iter__(self) -> Iterator[str]:
        """Iterate over tensor names."""
        return iter(self._names())

    def __repr__(self) -> str:
        try:
            view = self._view()
        except ClosedError:
            return f"<Checkpoint {self.format} '{self.path}' (closed)>"
        return (
            f"<Checkpoint {self.format} '{self.path}': {view['n_tensors']} tensors, "
            f"{view['nbytes']} bytes>"
        )


class Plan(_native.Plan):
    """An immutable, deterministic placement plan. Round-trips through JSON."""

    __slots__ = ("_read",)
    _read: dict[str, Any]

    @property
    def _fields(self) -> dict[str, Any]:
        # A plan never changes: its view is read once, and each property builds new lists, dicts
        # and records from it.
        try:
            return self._read
        except AttributeError:
            self._read = self._view()
            return self._read

    @property
    def strategy(self) -> str:
        """The strategy that made the plan."""
        return self._fields["strategy"]

    @property
    def architecture(self) -> str:
        """The model's architecture (``ModelSpec.architecture``)."""
        return self._fields["architecture"]

    @property
    def n_layers(self) -> int:
        """Number of repeating blocks."""
        return self._fields["n_layers"]

    @property
    def quantize(self) -> str | None:
        """The quantise-on-load mode the sizes assume (``"int8"``, ``"q8_0"``, ...), or None."""
        return self._fields["quantize"]

    @property
    def cache(self) -> CacheSpec | None:
        """The KV cache the plan sizes, or None."""
        cache = self._fields["cache"]
        return None if cache is None else CacheSpec(**cache)

    @property
    def runtime(self) -> RuntimeSpec:
        """The runtime limits that sized each device's scratch."""
        return RuntimeSpec(**self._fields["runtime"])

    @property
    def layer_devices(self) -> list[str]:
        """The device of every repeating layer, in layer order."""
        return list(self._fields["layer_devices"])

    @property
    def embed_device(self) -> str:
        """The device of the token embedding."""
        return self._fields["embed_device"]

    @property
    def head_device(self) -> str:
        """The device of the output head."""
        return self._fields["head_device"]

    @property
    def tied_output_copy(self) -> str | None:
        """The device holding a separate copy of a tied output head (exllamav2 loads the tied
        embedding again as the head), or None."""
        return self._fields["tied_output_copy"]

    @property
    def tensors(self) -> list[Placement]:
        """Every tensor's placement, in checkpoint order."""
        return [Placement(**t) for t in self._fields["tensors"]]

    @property
    def devices(self) -> list[DeviceUsage]:
        """Per-device breakdown: weights, kv, scratch, overhead, reserve and free, in bytes."""
        return [DeviceUsage(**d) for d in self._fields["devices"]]

    @property
    def host(self) -> dict[str, int]:
        """Host RAM at its peak during loading, in bytes: ``staging``, ``owned_weights``,
        ``mapped_weights`` (page cache), ``disk_weights``, ``kv``, ``scratch``, ``peak_anon``,
        ``peak_total``."""
        return dict(self._fields["host"])

    @property
    def warnings(self) -> list[str]:
        """What the planner noted without refusing the plan."""
        return list(self._fields["warnings"])

    def __repr__(self) -> str:
        devices = ", ".join(
            f"{d.name}: {sum(b - a + 1 for a, b in d.layers)} layers" for d in self.devices
        )
        return f"<Plan {self.strategy} {self.architecture} ({self.n_layers} layers): {devices}>"
