"""``Cache``, ``TPContext``, ``Batch`` and ``LlamaGrammar``, declared here over their native
classes.

Each docstring is written once, here; what a property computes from one native call, and the
conversion numpy does anyway (``Cache.write``'s float32), is Python. Every rule is the core's.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from weightlift import _native
from weightlift._api import _documented

if TYPE_CHECKING:
    from weightlift._native import TPGroupMember

_Split = list[tuple[int, int, int]]
# (device_index, offset, rows, cols)
_ScratchSlices = list[tuple[int, int, int, int]]


class Cache(_native.Cache):
    """A KV cache for a model. ``max_seq_len`` and ``batch_size`` are keyword-only (exllamav2 takes
    ``batch_size`` first, so a positional ``Cache(model, 1, 8192)`` would mean opposite things);
    ``max_seq_len=None`` (or exllamav2's ``-1``) is the model's trained context length. ``dtype``:
    fp16, bf16, fp8 (e4m3), q8, q6 (8-bit K, 4-bit V), q4 or f32, the quantised ones with one f16
    scale per 32 values. A lazy cache is allocated during the load, layer by layer on each layer's
    device; on a loaded model it is allocated at once. ``offload`` keeps it in host RAM and
    prefetches the next layer to its device on a second thread.
    """

    __slots__ = ()

    @property
    def max_seq_len(self) -> int:
        return self._config()[0]

    @property
    def batch_size(self) -> int:
        return self._config()[1]

    @property
    def dtype(self) -> str:
        return self._config()[2]

    @property
    def offload(self) -> bool:
        return self._config()[3]

    def __repr__(self) -> str:
        max_seq_len, batch_size, dtype, offload = self._config()
        return (
            f"Cache(max_seq_len={max_seq_len}, batch_size={batch_size}, dtype='{dtype}', "
            f"offload={offload})"
        )

    def write(self, layer: int, pos: int, k: npt.ArrayLike, v: npt.ArrayLike) -> None:
        """Write ``k`` and ``v`` (float32, ``(batch, n_kv_heads, n_tokens, head_dim)``) at position
        ``pos``."""
        k = np.ascontiguousarray(k, np.float32)
        v = np.ascontiguousarray(v, np.float32)
        self._write(layer, pos, k, v)

    seq_len = _documented(
        _native.Cache.seq_len,
        """Tokens held: where the next ``Model.forward(ids, cache=...)`` appends.""",
    )
    reset = _documented(_native.Cache.reset, """Forget every token (the memory stays allocated).""")
    truncate = _documented(
        _native.Cache.truncate,
        """Keep the first ``n`` tokens (at most ``seq_len``) and forget the rest.

        A sliding-window layer keeps only its last cells (a ring), so ``n`` must leave that
        layer's window still held: rewinding further raises ``PlanError`` naming the layer, its
        window and the first position it holds; ``reset()`` and running the prompt again is
        the fix.
        """,
    )
    tokens = _documented(
        _native.Cache.tokens,
        """The token ids at positions ``0..seq_len``; empty when some were written directly with
        ``write()``.
        """,
    )
    save_state = _documented(
        _native.Cache.save_state,
        """The tokens held and their keys and values as the cache stores them, as bytes
        ``load_state()`` takes back: into a cache of the same model and dtype bit for bit (a
        quantised cache's groups included, on any device or split), into one of another dtype
        as the values they decode to.
        """,
    )
    load_state = _documented(
        _native.Cache.load_state, """Replace what the cache holds with a ``save_state()`` result."""
    )
    memory = _documented(
        _native.Cache.memory,
        """Bytes held per device: the layers, and an offloaded cache's prefetch slots.""",
    )
    expected_memory = _documented(
        _native.Cache.expected_memory,
        """What ``memory()`` should hold for the devices the layers were allocated for: each layer's
        K and V on its device; offloaded, every layer on ``cpu`` plus, on each layer device, two
        prefetch slots of its largest layer (one when it computes a single layer). A plan made for
        this cache predicts the same bytes in its kv column.
        """,
    )
    device_of = _documented(
        _native.Cache.device_of,
        """The device layer ``layer`` computes on (and, unless offloaded, lives on).""",
    )
    read = _documented(
        _native.Cache.read,
        """Read positions ``start..end`` back as float32 ``(k, v)``, each
        ``(batch, n_kv_heads, end - start, head_dim)``.
        """,
    )
    fetch = _documented(
        _native.Cache.fetch,
        """Offload: copy ``layer`` to its device (taking the prefetched copy when there is one) and
        start prefetching the next layer on a second thread. Returns the device name.
        """,
    )
    free = _documented(_native.Cache.free, """Free every layer.""")


class TPContext(_native.TPContext):
    """exllamav2's ``TPContext``: the five split tables (from the planner), collectives over the
    accelerators (host-staged copies; real copies between virtual arenas), per-device RoPE tables
    and scratch. ``gpu_split``: GB per accelerator (None: each device's free memory).
    ``expect_cache_tokens`` (0: the model's context length × batch 1) of ``expect_cache_base`` (a
    cache dtype) are subtracted before splitting, as exllamav2 does.

    ``Model.tp`` is the context a ``load_tp()`` model's forward pass runs through: its collectives
    and staging buffers are what ``forward`` and ``generate`` use.
    """

    __slots__ = ()

    @property
    def kv_split(self) -> _Split:
        """``get_split(BROADCAST_KV)``: ``(device, a, b)`` per device."""
        return self.get_split(_native.BROADCAST_KV)

    @property
    def id_split(self) -> _Split:
        """``get_split(BROADCAST_ID)``."""
        return self.get_split(_native.BROADCAST_ID)

    @property
    def vc_split(self) -> _Split:
        """``get_split(BROADCAST_VC)``."""
        return self.get_split(_native.BROADCAST_VC)

    @property
    def rs_split(self) -> _Split:
        """``get_split(BROADCAST_RS)``."""
        return self.get_split(_native.BROADCAST_RS)

    @property
    def q_split(self) -> _Split:
        """``get_split(BROADCAST_Q)``."""
        return self.get_split(_native.BROADCAST_Q)

    @property
    def ex_split(self) -> _Split:
        """``get_split(BROADCAST_EX)``: whole routed experts per device (expert parallelism,
        ``Plan.tp_split("ex")``); empty for a dense model."""
        return self.get_split(_native.BROADCAST_EX)

    @staticmethod
    def thread_group(world_size: int) -> list[TPGroupMember]:
        """One member per rank of a group whose ranks run as threads of this process (each rank a
        model of its own, its forward calls on a thread of its own)."""
        return _native.TPContext.thread_group(world_size)

    def get_scratch_slice_tp(
        self, rows: int, dtype: str, broadcast_type: int, dim: int = 1
    ) -> _ScratchSlices:
        """One scratch slice per device of the table, ``(rows, (b - a)·dim)``: a list of
        ``(device_index, offset, rows, cols)``."""
        return self._scratch_slices(rows, dtype, broadcast_type, dim, False)

    def get_scratch_slice_tp_bc(
        self, rows: int, dtype: str, broadcast_type: int, dim: int = 1
    ) -> _ScratchSlices:
        """One full-width scratch slice per device of the table, ``(rows, end·dim)``."""
        return self._scratch_slices(rows, dtype, broadcast_type, dim, True)

    peer_copies = _documented(
        _native.TPContext.peer_copies,
        """Whether the forward pass on GPUs copies activations device to device where the driver
        allows (the default), or stages every copy through host memory.
        """,
        settable=True,
    )
    rank = _documented(
        _native.TPContext.rank,
        """The rank this process drives in a multi-process run (``load_tp(world=..., rank=...)``);
        None when it drives every device.
        """,
    )
    transport = _documented(
        _native.TPContext.transport,
        """The transport of the collectives: ``"host-staged"``, ``"threads"`` or ``"nccl"``.""",
    )
    join = _documented(
        _native.TPContext.join,
        """Meet the other ranks through ``member`` of a thread group: its rank must be this
        context's. A member joins once.
        """,
    )
    join_nccl = _documented(
        _native.TPContext.join_nccl,
        """Join the multi-process run the launcher describes (torchrun's ``RANK``, ``WORLD_SIZE``,
        ``LOCAL_RANK``; the NCCL id in ``WEIGHTLIFT_NCCL_ID`` or the file
        ``WEIGHTLIFT_NCCL_ID_FILE`` names, which rank 0 writes), waiting up to ``wait`` seconds for
        the id: the collectives then run over NCCL. Returns ``(rank, world_size)``. Needs a build
        with the ``nccl`` feature.
        """,
    )
    device_name = _documented(
        _native.TPContext.device_name, """The device name of table index ``i``."""
    )
    finalize = _documented(
        _native.TPContext.finalize,
        """Allocate the two host staging buffers (exllamav2's pinned temps).""",
    )
    gather = _documented(
        _native.TPContext.gather,
        """Concatenate per-device slices (one per device of the table, in order) along the columns
        into a host numpy array ``(rows, end·dim)``.
        """,
    )
    allgather = _documented(
        _native.TPContext.allgather,
        """Gather over ``broadcast_type_g``, then broadcast the result to table
        ``broadcast_type_b``.
        """,
    )
    add_residual = _documented(
        _native.TPContext.add_residual,
        """On each device ``i`` of the table: ``target[i] += source[i][:, a·dim : b·dim]`` (in
        place).
        """,
    )
    get_sin_cos = _documented(
        _native.TPContext.get_sin_cos,
        """Per-device RoPE tables: ``(sin, cos)``, two lists of DeviceTensors
        ``(max_seq_len, head_dim)`` f32, one per device of ``all_devices()``.
        """,
    )
    reserve_scratch = _documented(
        _native.TPContext.reserve_scratch, """Reserve scratch bytes per device index."""
    )


class Batch(_native.Batch):
    """Up to ``parallel`` generations of ``model`` at once, each in a slot: the model's own cache
    and ``parallel - 1`` more of its length. A slot keeps its tokens after a generation, and a new
    one goes to the free slot holding the longest prefix of its prompt; a longer prefix that another
    slot holds (a running generation's too) is copied into it, so a repeated system prompt runs
    once. ``create_completion(..., batch=b)`` and
    ``create_chat_completion(..., batch=b)`` start a generation and return its id; ``step()`` runs
    one token of each generation (their forward calls as one) and returns ``(id, kind, value,
    timings)`` tuples: ``"chunk"`` (a streamed chunk), ``"text"``, ``"whole"`` (the whole response
    of a call with ``stream=False``; it has ended), ``"end"`` (a stream has ended; the value is its
    ``usage`` dict) or ``"error"`` (the exception it ended with). ``timings`` is the finished
    generation's ``Model.timings``, else None. A generation's tokens are those it gets alone.
    """

    __slots__ = ()

    parallel = _documented(_native.Batch.parallel, """Slots in all.""")
    running = _documented(_native.Batch.running, """Generations running.""")
    n_ctx = _documented(_native.Batch.n_ctx, """Positions of each slot.""")
    step = _documented(
        _native.Batch.step,
        """One token of every running generation; see the class. Raises when the shared forward
        call fails (a device out of memory): every running generation has then ended.
        """,
    )
    cancel = _documented(
        _native.Batch.cancel,
        """End generation ``id`` now (its client went away), freeing its slot; False when it is not
        running.
        """,
    )


class LlamaGrammar(_native.LlamaGrammar):
    """A parsed GBNF grammar (llama.cpp's grammar format, root rule ``root``), as llama-cpp-python's
    ``LlamaGrammar``: pass it as ``grammar=`` to keep generated text inside it. A grammar that does
    not parse raises ``GrammarError`` (a ValueError) naming the line, the column and what was
    expected.
    """

    __slots__ = ()

    @classmethod
    def from_string(cls, grammar: str, verbose: bool = True) -> LlamaGrammar:
        """Parse GBNF ``grammar``. ``verbose`` is llama-cpp-python's and changes nothing: errors
        raise."""
        return cls(_grammar=grammar)

    @classmethod
    def from_json_schema(cls, json_schema: str, verbose: bool = True) -> LlamaGrammar:
        """The grammar of the JSON texts that JSON Schema ``json_schema`` (JSON text) accepts, as
        llama-cpp-python's ``from_json_schema`` (llama.cpp's converter) lays them out: required
        properties first in schema order, at most one space between tokens. A keyword it cannot
        enforce (``pattern``, most ``format`` values, bounds on ``number``, ...) raises
        ``UnsupportedError`` naming the keyword and where it is in the schema, where
        llama-cpp-python ignores it; text that is not a schema raises ``GrammarError``.
        ``verbose`` changes nothing.
        """
        return cls(_grammar=_native.LlamaGrammar._schema_gbnf(json_schema))

    @classmethod
    def from_file(cls, file: str | os.PathLike[str], verbose: bool = True) -> LlamaGrammar:
        """Read and parse the GBNF file ``file`` (a path). An unreadable file raises the matching
        ``OSError``."""
        with open(file, encoding="utf-8") as f:
            return cls(_grammar=f.read())

    text = _documented(_native.LlamaGrammar.text, """The GBNF text.""")
