"""The entry points with long keyword lists, declared here: ``Model`` (its constructor, loads and
generation), ``plan``, ``fit``, ``from_pretrained``, ``load_gguf`` and ``sample``.

Each signature, with its defaults, and each docstring is written once, here; the body hands its
keywords, as one dict, to the native function that converts them for the engine. What a keyword
means, and every rule behind it, is the core's.
"""

from __future__ import annotations

import contextlib
import functools
import os
import types
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt

from weightlift import _native, _types
from weightlift._errors import PlanError, UnsupportedError

if TYPE_CHECKING:
    from weightlift._native import (
        Batch,
        Cache,
        CompletionStream,
        LlamaGrammar,
        _Callback,
        _Compute,
        _DeviceMap,
        _Devices,
        _FitTarget,
        _Overrides,
        _Path,
        _Quantize,
        _Sizes,
        _SplitMode,
        _Strategy,
    )
    from weightlift._specs import CacheSpec, RuntimeSpec
    from weightlift._types import Checkpoint, ModelSpec, Plan

_Offload = Literal["sequential", "group"]


def _documented(native: Any, doc: str, *, settable: bool = False) -> Any:
    """``native``, a method or property of a native class, with ``doc`` as its docstring (the
    signature stays the native one)."""
    if isinstance(native, types.GetSetDescriptorType):
        return property(native.__get__, native.__set__ if settable else None, doc=doc)

    @functools.wraps(native)
    def method(self: Any, /, *args: Any, **kwargs: Any) -> Any:
        return native(self, *args, **kwargs)

    method.__doc__ = doc
    return method


def _opened(source: Checkpoint | _Path, vocab_only: bool = False) -> Checkpoint:
    """``source``, a path opened (``vocab_only``: its metadata and tokenizer only)."""
    if isinstance(source, _native.Checkpoint):
        return source
    if not isinstance(source, (str, bytes, os.PathLike)):
        got = type(source).__name__
        raise TypeError(f"source must be a weightlift.Checkpoint or a path, got {got}")
    return _types.open(source, vocab_only=vocab_only)


@contextlib.contextmanager
def _progress(kw: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A load's keywords ``kw``, with ``progress=True`` drawn as the command line's loading bar
    in front of ``callback`` (the bar is left on screen once the load has finished)."""
    if not kw.get("progress"):
        yield kw
        return
    from weightlift.cli import _ProgressBar

    bar, callback = _ProgressBar(True), kw.get("callback")

    def report(bytes_done: int, bytes_total: int, tensor: str, device: str) -> Any:
        bar(bytes_done, bytes_total, tensor, device)
        return callback is None or callback(bytes_done, bytes_total, tensor, device)

    finished = False
    try:
        yield dict(kw, callback=report)
        finished = True
    finally:
        bar.close(finished)


class Model(_native.Model):
    """A model: a checkpoint and the devices it may use. Nothing is loaded until ``load()``,
    ``load_autosplit()`` or ``load_tp()``.

    ``source``: a ``Checkpoint`` or a path. ``devices``: the accelerator inventory as a spec
    (``"virtual:2x64MiB,cpu"``, ``"cuda:0,cuda:1"``); unlisted, ``cpu`` holds only the input
    embedding (see ``weightlift.plan``). ``None`` is the real machine: ``cpu`` plus every CUDA
    device found (in a build with the ``cuda`` feature). ``dtype``: ``"auto"`` keeps stored dtypes,
    ``"float16"`` converts F32/BF16 weights. ``runtime``: a ``RuntimeSpec`` or dict
    (``max_input_len``, ``max_attention_size``, ``max_dq_size``, ``low_mem``). ``compute``:
    ``"fast"`` (8-bit activations with quantised weights, as llama.cpp) or ``"exact"`` (f32 on
    dequantised weights). ``n_threads``: the forward pass's threads (default, 0 or llama.cpp's -1:
    physical cores; at most the CPUs the process may run on).
    ``quantize``: ``"int8"`` (LLM.int8, as transformers' ``load_in_8bit``), ``"q8_0"``, ``"q4_k"``
    or ``"q6_k"`` quantises a float checkpoint's linears while it loads; every plan of this model
    sizes them in that type (see ``weightlift.plan``).
    """

    def __new__(
        cls,
        source: Checkpoint | _Path,
        *,
        devices: _Devices | None = None,
        dtype: str = "auto",
        runtime: RuntimeSpec | Mapping[str, Any] | None = None,
        compute: _Compute = "fast",
        n_threads: int | None = None,
        quantize: _Quantize | None = None,
    ) -> Model:
        return super().__new__(cls, _opened(source), locals())

    def load(
        self,
        /,
        plan: Plan | str | None = None,
        *,
        progress: bool = False,
        callback: _Callback | None = None,
        cache: Cache | CacheSpec | Mapping[str, Any] | None = None,
        use_mmap: bool = True,
        use_direct_io: bool = False,
        check_tensors: bool = False,
        staging_bytes: int | None = None,
        strategy: _Strategy | None = None,
        reserve: _Sizes = None,
        max_memory: _Sizes = None,
        overhead: _Sizes = None,
        n_gpu_layers: int | None = None,
        split_mode: _SplitMode | None = None,
        tensor_split: Sequence[float] | None = None,
        main_gpu: int | None = None,
        device_map: _DeviceMap | None = None,
        overrides: _Overrides | None = None,
        gpu_split: Sequence[float] | None = None,
        allow_disk: bool | None = None,
        offload: _Offload | None = None,
        blocks_per_group: int = 1,
        prefetch: bool = True,
        n_cpu_moe: int | None = None,
    ) -> None:
        """Load by ``plan`` (a ``Plan`` or its JSON), or plan now with the placement keywords of
        ``weightlift.plan`` (``strategy``, ``reserve``, ``max_memory``, ``overhead``,
        ``n_gpu_layers``, ``split_mode``, ``tensor_split``, ``main_gpu``, ``device_map``,
        ``overrides``, ``gpu_split``, ``allow_disk``, ``n_cpu_moe``), which mean here what they mean
        there. ``offload="sequential"`` or ``"group"`` runs the layers kept on cpu or disk on the
        first accelerator, copying their matrices in first (``blocks_per_group`` layers at a time;
        ``prefetch`` copies the next group while one computes), as accelerate's and diffusers'
        offloading; ``None`` computes each layer where it is placed. ``cache`` is a ``Cache``
        (allocated lazily, layer by layer beside each layer) or a ``CacheSpec`` or dict (the model
        allocates that cache itself).

        ``callback(bytes_done, bytes_total, tensor, device)`` returning False cancels: everything is
        freed and ``LoadCancelled`` is raised. Ctrl-C raises KeyboardInterrupt the same way.
        """
        if plan is not None and not isinstance(plan, str):
            plan = plan.to_json()
        with _progress(locals()) as kw:
            self._load("load", kw)

    def load_autosplit(
        self,
        /,
        cache: Cache | None = None,
        reserve_vram: _Sizes = None,
        *,
        progress: bool = False,
        callback: _Callback | None = None,
        offload: _Offload | None = None,
        blocks_per_group: int = 1,
        prefetch: bool = True,
    ) -> None:
        """exllamav2's ``load_autosplit``: fill the accelerators in order, each layer's cache beside
        it, keeping ``reserve_vram`` free (one size for every accelerator, a list in accelerator
        order, or a dict by device; bytes or strings such as ``"256MiB"``). ``offload`` (with
        ``blocks_per_group``, ``prefetch``) runs the layers that spill to the cpu on the first
        accelerator, as in ``load()``.
        """
        with _progress(locals()) as kw:
            self._load("autosplit", kw)

    def load_tp(
        self,
        /,
        gpu_split: Sequence[float] | None = None,
        expect_cache_tokens: int = 0,
        expect_cache_base: str | None = None,
        *,
        progress: bool = False,
        callback: _Callback | None = None,
        world: str | None = None,
        rank: int | None = None,
    ) -> None:
        """exllamav2's ``load_tp``: weights split over the accelerators by the TPContext tables.
        ``gpu_split`` in GB per device (None: each device's free memory); the expected cache
        (``expect_cache_tokens``, 0 = the model's context length; ``expect_cache_base`` a cache
        dtype) is subtracted when splitting, and the model holds that cache, each device its kv
        heads. ``forward`` and ``generate`` then run tensor-parallel on cpu and virtual devices,
        through ``Model.tp``.

        Across processes (one per GPU, as torchrun starts them), ``world`` names the run's ranks
        (``"node0:4,node1:4"``) and ``rank`` this process's: the model's one accelerator stands for
        every rank in the plan, and only this rank's share is loaded on it. Its forward pass then
        meets the other ranks through the transport ``Model.tp`` is given
        (``TPContext.join_nccl()``, or a ``TPContext.thread_group`` member).
        """
        with _progress(locals()) as kw:
            self._load("tp", kw)

    def generate(
        self,
        /,
        prompt: str | bytes | Sequence[int],
        *,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        typical_p: float = 1.0,
        repeat_penalty: float | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        mirostat_mode: int = 0,
        mirostat_tau: float = 5.0,
        mirostat_eta: float = 0.1,
        grammar: str | LlamaGrammar | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stream: bool = False,
        cache: Cache | None = None,
        add_bos: bool | None = None,
        do_sample: bool | None = None,
        max_length: int | None = None,
        min_new_tokens: int | None = None,
        min_length: int | None = None,
        repetition_penalty: float | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        num_return_sequences: int = 1,
    ) -> str | list[str] | CompletionStream:
        """Generate text after ``prompt`` (a string or token ids): the text, or with ``stream=True``
        an iterator of text pieces. ``temperature=0`` is greedy over the whole vocabulary.
        ``mirostat_mode=1`` or ``2`` samples with Mirostat (target surprise ``mirostat_tau`` bits,
        learning rate ``mirostat_eta``) in place of top-k, typical, top-p, min-p and the
        temperature, as llama-cpp-python does. ``grammar`` (GBNF text or a ``LlamaGrammar``) keeps
        the text inside a grammar. Without a ``cache`` the model's own cache is used and the prefix
        it already holds is reused (a model loaded without one makes an fp16 cache for the prompt
        and ``max_new_tokens``, as transformers' generate does); with one the prompt is appended to
        it.

        transformers' words work too: ``do_sample=False`` is greedy and ``do_sample=True`` samples
        with transformers' defaults for what is not given (temperature 1, top-k 50, top-p 1, no
        min-p); ``max_length`` counts the prompt (``max_new_tokens`` wins when both are given; with
        neither, 32 new tokens; ``max_new_tokens <= 0`` runs until the cache is full);
        ``min_new_tokens`` (or ``min_length``, counting the prompt) holds the end-of-generation
        tokens back until that many new tokens (as ``create_completion``'s ``min_tokens``);
        ``repetition_penalty`` is ``repeat_penalty`` (over the last 64 tokens, as llama.cpp);
        ``eos_token_id`` (an id or a list) replaces the tokenizer's end-of-generation tokens;
        ``pad_token_id`` is accepted and unused (one sequence needs no padding);
        ``num_return_sequences=N`` above 1 samples N texts from the prompt at once (a ``Batch`` of N
        slots) and returns their list; their seeds are ``seed``, ``seed + 1``, ... (random without
        one); greedy decoding, ``stream`` and ``cache`` are refused with it.
        """
        return self._generate(locals())

    def create_completion(
        self,
        /,
        prompt: str | bytes | Sequence[int],
        suffix: str | None = None,
        max_tokens: int | None = 16,
        temperature: float = 0.8,
        top_p: float = 0.95,
        min_p: float = 0.05,
        typical_p: float = 1.0,
        logprobs: int | None = None,
        echo: bool = False,
        stop: str | Sequence[str] | None = None,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        repeat_penalty: float = 1.0,
        top_k: int = 40,
        stream: bool = False,
        seed: int | None = None,
        tfs_z: float = 1.0,
        mirostat_mode: int = 0,
        mirostat_tau: float = 5.0,
        mirostat_eta: float = 0.1,
        model: str | None = None,
        stopping_criteria: Any = None,
        logits_processor: Any = None,
        grammar: str | LlamaGrammar | None = None,
        logit_bias: Any = None,
        min_tokens: int = 0,
        batch: Batch | None = None,
    ) -> dict[str, Any] | CompletionStream | int:
        """llama-cpp-python's ``Llama.create_completion``: the same arguments and defaults, and an
        OpenAI-style ``text_completion`` dict (``["choices"][0]["text"]``, ``["usage"]``), or with
        ``stream=True`` an iterator of chunks. ``logprobs=N`` adds ``["choices"][0]["logprobs"]``:
        ``tokens``, ``text_offset``, ``token_logprobs`` (the log-softmax of the raw logits, before
        any sampling transform) and ``top_logprobs`` (the N most likely tokens keyed by their text,
        plus the chosen one), per generated token, after the prompt's tokens with ``echo=True`` (the
        first one null); each streamed chunk carries its token's. ``logprobs=0`` lists only the
        chosen token, None or False none. ``mirostat_mode=1`` or ``2`` samples with Mirostat in
        place of top-k, typical, top-p, min-p and the temperature; ``grammar`` (GBNF text or a
        ``LlamaGrammar``) keeps the text inside a grammar. Arguments it has that this build does not
        implement (``tfs_z`` other than 1) raise ``UnsupportedError`` when given. ``suffix`` asks
        for the text between ``prompt`` and it: a fill-in-the-middle prompt on a model whose
        vocabulary has FIM tokens (``spm_infill`` at load puts the suffix first), else the
        completion of ``prompt`` with ``suffix`` put after it, as llama-cpp-python does.
        ``logits_processor`` (``(input_ids, scores) -> scores``, after the bias) and
        ``stopping_criteria`` (``(input_ids, logits) -> bool``) are called with the GIL on every
        token, as llama-cpp-python calls them; they cannot call this model. ``logit_bias``
        (``{token_id: bias}``) is added to those tokens' logits before sampling; log-probabilities
        stay the model's own. ``min_tokens`` (llama-cpp-python's server's field) holds the
        end-of-generation tokens back until that many tokens are generated, unless nothing else
        may come (a grammar that must end); a ``stop`` string or ``max_tokens`` still ends the
        text sooner, as there. With
        ``batch`` (a ``Batch`` of this model) the completion starts in one of the batch's slots
        and its id is returned; ``Batch.step()`` runs it with the others and hands over its
        chunks, or with ``stream=False`` the dict.
        """
        return self._create_completion(locals())

    def __call__(
        self, /, prompt: str | bytes | Sequence[int], *args: Any, **kwargs: Any
    ) -> dict[str, Any] | CompletionStream | int:
        """``create_completion``, as ``Llama.__call__``."""
        return self.create_completion(prompt, *args, **kwargs)

    def create_chat_completion(
        self,
        /,
        messages: Sequence[Mapping[str, Any]],
        functions: Any = None,
        function_call: Any = None,
        tools: Any = None,
        tool_choice: Any = None,
        temperature: float = 0.2,
        top_p: float = 0.95,
        top_k: int = 40,
        min_p: float = 0.05,
        typical_p: float = 1.0,
        stream: bool = False,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        response_format: Mapping[str, Any] | None = None,
        max_tokens: int | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repeat_penalty: float = 1.0,
        tfs_z: float = 1.0,
        mirostat_mode: int = 0,
        mirostat_tau: float = 5.0,
        mirostat_eta: float = 0.1,
        model: str | None = None,
        logits_processor: Any = None,
        grammar: str | LlamaGrammar | None = None,
        logit_bias: Any = None,
        logprobs: bool | None = None,
        top_logprobs: int | None = None,
        min_tokens: int = 0,
        batch: Batch | None = None,
    ) -> dict[str, Any] | CompletionStream | int:
        """llama-cpp-python's ``Llama.create_chat_completion``: ``messages`` (dicts with ``role``
        and ``content``) rendered with the model's chat template and a generation prompt; returns a
        ``chat.completion`` dict (``["choices"][0]["message"]["content"]``), or with ``stream=True``
        an iterator of ``chat.completion.chunk`` dicts (a role delta, content deltas, then an empty
        delta with the finish reason). ``logprobs=True`` with ``top_logprobs=N`` adds
        ``["choices"][0]["logprobs"]["content"]``: per generated token its ``token`` text,
        ``logprob`` and ``top_logprobs`` (``{token, logprob, bytes}`` for the N most likely and the
        chosen one), ``bytes`` None, as llama-cpp-python (which, like this, returns None for
        ``logprobs=True`` without ``top_logprobs``). ``response_format={"type": "json_object"}``
        keeps the reply inside llama-cpp-python's JSON grammar (in place of ``grammar``), and with a
        ``"schema"`` (or OpenAI's ``{"type": "json_schema", "json_schema": {"schema": ...}}``)
        inside the schema's grammar (``LlamaGrammar.from_json_schema``); mirostat and ``grammar``
        and ``logit_bias`` are as in ``create_completion``. ``tools`` and ``tool_choice`` (or the
        legacy ``functions`` and ``function_call``) go to the chat template; a ``tool_choice``
        naming one tool returns a tool call (``message.tool_calls``, ``finish_reason``
        ``"tool_calls"``) whose arguments are kept inside the tool's ``parameters`` schema.
        ``tfs_z`` other than 1 raises ``UnsupportedError``; ``min_tokens`` and ``batch`` are as in
        ``create_completion``.
        """
        return self._create_chat_completion(locals())

    # The native methods and properties, documented here.
    unload = _documented(
        _native.Model.unload, """Free every tensor and cache layer this model holds."""
    )
    tp = _documented(
        _native.Model.tp,
        """The ``TPContext`` the forward pass runs through after ``load_tp()`` (its tables, its
        collectives and its staging buffers), the same object on every access; None otherwise.
        """,
    )
    plan = _documented(_native.Model.plan, """The plan of the last load, or None.""")

    def plan_json(self) -> str | None:
        """The last plan as JSON (None before a load)."""
        plan = self.plan
        return None if plan is None else plan.to_json()

    # The model's state, each read from one native view of its session (`_state()`), which
    # refuses a closed model (ClosedError) and a busy one (RuntimeError) as every call does.
    @property
    def loaded(self) -> bool:
        """True while the model holds a load: after one succeeds, until ``unload()`` or
        ``close()``."""
        return self._state()["loaded"]

    def memory(self) -> dict[str, int]:
        """Bytes held per device: weights (mmap views count on ``cpu``), cache layers, scratch."""
        return self._state()["memory"]

    def device_usage(self) -> dict[str, int]:
        """Bytes allocated right now per device (arena accounting; mmap views are not
        allocations)."""
        return self._state()["device_usage"]

    def peak_memory(self) -> dict[str, int]:
        """The most bytes allocated at once per device since the last load began (the same
        accounting as ``device_usage``): weights, cache, scratch and what forward passes held.
        """
        return self._state()["peak_memory"]

    def transfer_stats(self) -> dict[str, float]:
        """Copies between devices during the last forward call: ``copies`` (count), ``bytes`` and
        ``seconds`` (wall time spent copying).
        """
        return self._state()["transfer_stats"]

    @property
    def devices(self) -> str:
        """The device spec this model was made with (with ``devices=None``, the detected machine's,
        e.g. ``"cuda:0,cpu"``).
        """
        return self._state()["devices"]

    @property
    def locked_bytes(self) -> int:
        """Bytes of memory-mapped tensors locked in RAM (``use_mlock``)."""
        return self._state()["locked_bytes"]

    @property
    def warnings(self) -> list[str]:
        """Warnings from the last load (O_DIRECT fallback, unvalidated architecture, ...)."""
        return self._state()["warnings"]

    device_of = _documented(
        _native.Model.device_of,
        """The device of a tensor; a split tensor gives its devices joined by commas.""",
    )
    layer_devices = _documented(_native.Model.layer_devices, """The device of each layer.""")
    tensor = _documented(
        _native.Model.tensor,
        """A numpy copy of a tensor from wherever it lives (split tensors are reassembled, CUDA
        memory is copied back). Raw quantised blocks come back as uint8 rows; ``dequantize=True``
        gives float32, decoded at most ``runtime.max_dq_size`` values at a time so transient buffers
        stay within that chunk limit.
        """,
    )
    tensor_info = _documented(
        _native.Model.tensor_info,
        """A loaded tensor as it is held: its checkpoint entry with the held ``dtype`` (``"Q8_0"``,
        ``"INT8"``, ... after a quantising load; ``"F16"`` after ``dtype="float16"``) and the held
        ``nbytes`` (an INT8 tensor's include its f32 row scales).
        """,
    )
    close = _documented(
        _native.Model.close,
        """Free everything the model holds (as ``unload()``, the own cache included) and refuse
        every later call with ``ClosedError``. Closing twice does nothing; ``with`` closes on exit.
        """,
    )
    closed = _documented(_native.Model.closed, """True once ``close()`` has run.""")

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *_args: object) -> bool:
        self.close()
        return False

    cache = _documented(
        _native.Model.cache,
        """The cache generation and ``forward(cache=None)`` use: the one the model was loaded with,
        or the one it made for a prompt; None before either.
        """,
    )
    forward = _documented(
        _native.Model.forward,
        """Run token ``ids`` through the model and return float32 logits of shape ``[n, vocab]``:
        ``n`` is 1 for ``logits="last"`` and ``len(ids)`` for ``"all"``. With ``cache=None`` each
        call starts at position 0 on the model's own cache (made, fp16, when the model was loaded
        without one); with a ``Cache`` the ids are appended at its ``seq_len``. The GIL is released
        while it runs.
        """,
    )
    forward_batch = _documented(
        _native.Model.forward_batch,
        """Run several sequences in one call, each ``(cache, ids)`` appending its ids to its own
        ``Cache`` at its ``seq_len`` (a new prompt and single decode tokens mix freely: continuous
        batching), and return float32 logits of shape ``[len(seqs), vocab]``, the last position of
        each, the bits each sequence gets alone (in ``"fast"`` the decode tokens share each product:
        on the cpu every token keeps its own bits, on CUDA a product of several tokens may sum in
        another order or take cuBLAS, within fast mode's bound). A bad sequence (too long for its
        cache, a cache given twice) fails the call before any cache moves. The GIL is released
        while it runs.
        """,
    )

    @property
    def compute(self) -> str:
        """``"fast"`` or ``"exact"``."""
        return self._state()["compute"]

    @compute.setter
    def compute(self, value: _Compute) -> None:
        self._set("compute", value)

    @property
    def cuda_graphs(self) -> bool:
        """Whether a decode step that runs whole on one CUDA device is replayed from a captured
        CUDA graph (default on; ``WEIGHTLIFT_CUDA_GRAPHS=0`` starts it off). Both ways run the same
        kernels, so the logits are the same bits.
        """
        return self._state()["cuda_graphs"]

    @cuda_graphs.setter
    def cuda_graphs(self, on: bool) -> None:
        self._set("cuda_graphs", on)

    def cuda_graph_counts(self) -> tuple[int, int, str | None]:
        """``(captures, replays, refused)``: decode steps captured as CUDA graphs and replayed
        since the model was loaded, and why the driver refused the last capture (``None`` if it
        did not).
        """
        return self._state()["cuda_graph_counts"]

    n_threads = _documented(_native.Model.n_threads, """Threads of the forward pass.""")

    @property
    def int8_threshold(self) -> float:
        """LLM.int8's outlier threshold for ``quantize="int8"`` weights (transformers'
        ``llm_int8_threshold``, default 6.0): activation columns with a value at least this large
        multiply the dequantised weights in f32, the rest go through int8.
        """
        return self._state()["int8_threshold"]

    @int8_threshold.setter
    def int8_threshold(self, value: float) -> None:
        self._set("int8_threshold", value)

    @property
    def chat_format(self) -> str | None:
        """The chat format that chats are formatted with in place of the model's own chat
        template, by llama-cpp-python's ``chat_format`` names: a built-in format (``"chatml"``,
        ``"llama-3"``, ...) or ``"chat_template.NAME"`` for another template the GGUF names
        (``tokenizer.chat_template.NAME``); None (or ``"chat_template.default"``) for the
        model's own template. Setting it takes effect at the next chat; ``load_gguf`` and
        ``Llama`` take it as ``chat_format=``.
        """
        return self._state()["chat_format"]

    @chat_format.setter
    def chat_format(self, name: str | None) -> None:
        self._set("chat_format", name)

    def embed(
        self, ids: Sequence[int], *, pooling: int | str | None = None, normalize: bool = False
    ) -> list[float] | list[list[float]]:
        """The hidden states after the output norm of token ``ids`` (the head's input), pooled:
        ``pooling`` is llama.cpp's number (-1: the model's ``pooling_type``, else none; 0 none, 1
        mean, 2 cls, 3 last) or its name. No pooling gives one vector per token, the others one
        vector; ``normalize`` scales each to unit length. Runs on a cache of its own, so the model's
        cache and the prefix it holds are untouched. The GIL is released while it runs.
        """
        return self._embed(ids, {"pooling": pooling, "normalize": normalize})

    tokenize = _documented(
        _native.Model.tokenize,
        """Token ids of ``text`` (str, or UTF-8 bytes as llama-cpp-python takes). ``add_bos=None``
        follows the tokenizer (``tokenizer.ggml.add_bos_token`` / the tokenizer config); True or
        False forces it. Special tokens such as ``<|im_start|>`` are parsed only with
        ``special=True``. Needs no load.
        """,
    )
    detokenize = _documented(
        _native.Model.detokenize,
        """The text of token ``ids``. Special tokens are left out unless ``special=True``.""",
    )
    detokenize_bytes = _documented(
        _native.Model.detokenize_bytes,
        """The bytes of token ``ids`` (llama-cpp-python's ``Llama.detokenize``): ``detokenize``
        before the UTF-8 check, so a cut through a character stays cut.
        """,
    )
    timings = _documented(
        _native.Model.timings,
        """The last generation's timings: ``prompt_tokens``, ``prompt_ms``, ``prompt_per_second``,
        ``reused_tokens`` (prompt tokens the cache already held), ``eval_tokens``, ``eval_ms``,
        ``eval_per_second`` and ``sample_ms``; None before any.
        """,
    )
    n_ctx = _documented(
        _native.Model.n_ctx, """Positions in the model's own cache (``Llama.n_ctx()``)."""
    )
    n_vocab = _documented(
        _native.Model.n_vocab, """Rows of the token embedding (``Llama.n_vocab()``)."""
    )
    token_bos = _documented(
        _native.Model.token_bos, """The BOS id, or -1 (``Llama.token_bos()``)."""
    )
    token_eos = _documented(
        _native.Model.token_eos, """The EOS id, or -1 (``Llama.token_eos()``)."""
    )
    grammar_mask = _documented(
        _native.Model.grammar_mask,
        """``logits`` (one float32 row of the vocabulary) with every token that cannot begin text of
        ``grammar`` (GBNF text or a ``LlamaGrammar``) set to −inf, as llama.cpp's grammar sampler
        masks a row from the grammar's start: what ``Llama.sample(grammar=...)`` samples from. A
        grammar no token may begin raises ``GrammarError``.
        """,
    )


def plan(
    source: Checkpoint | str | os.PathLike[str] | Mapping[str, Any] | ModelSpec,
    *,
    devices: _Devices | None = None,
    strategy: _Strategy | None = None,
    dtype: str = "auto",
    cache: CacheSpec | Cache | Mapping[str, Any] | None = None,
    runtime: RuntimeSpec | Mapping[str, Any] | None = None,
    reserve: _Sizes = None,
    max_memory: _Sizes = None,
    n_gpu_layers: int | None = None,
    split_mode: _SplitMode | None = None,
    tensor_split: Sequence[float] | None = None,
    main_gpu: int | None = None,
    device_map: _DeviceMap | None = None,
    allow_disk: bool = False,
    weight_dtype: str | None = None,
    overhead: _Sizes = None,
    overrides: _Overrides | None = None,
    gpu_split: Sequence[float] | None = None,
    use_mmap: bool = True,
    cache_offload: bool = False,
    quantize: _Quantize | None = None,
    offload: _Offload | None = None,
    blocks_per_group: int = 1,
    prefetch: bool = True,
    world: str | None = None,
    n_cpu_moe: int | None = None,
) -> Plan:
    """Plan where every tensor and every layer's KV cache goes, by arithmetic, before a byte is
    read.

    ``source`` is a Checkpoint, a path (checkpoint, HF config.json, or a folder holding only a
    config.json), an HF config dict, or a ModelSpec. Config-only sources need ``weight_dtype``
    (``"bfloat16"``, ``"float16"``, ``"q8_0"``, ``"q4_k_m"``, ...) unless the config names its
    ``torch_dtype``. ``devices`` is a spec string (``"virtual:2x8GiB,cpu,disk"``) or a list of them;
    None (the default) is this machine's devices, every CUDA GPU then ``cpu``, as
    ``Model(devices=None)`` takes them.

    ``strategy`` is ``autosplit`` (exllamav2), ``sequential``, ``balanced``, ``balanced_low_0``
    (accelerate), ``layers`` (llama.cpp: ``n_gpu_layers``, ``split_mode``, ``tensor_split``,
    ``main_gpu``), ``tensor_parallel`` (exllamav2 TPContext: ``gpu_split`` in GB) or ``map``
    (``device_map`` prefixes and llama.cpp ``-ot`` style ``overrides``). Left at None, a
    ``device_map`` preset names its strategy (``"auto"`` = ``balanced``), a ``device_map`` dict or
    ``overrides`` imply ``map``, the llama.cpp options imply ``layers``, ``gpu_split`` implies
    ``tensor_parallel``, and otherwise it is ``autosplit``.

    ``n_cpu_moe=N`` (llama.cpp's ``--n-cpu-moe``) keeps the experts of a mixture-of-experts model's
    first N layers in host RAM, computed there on the tokens routed to them, and places the rest of
    each layer as the strategy says (``layers``, which it implies): the same as ``-ot`` overrides of
    those layers' expert tensors to ``cpu``, added after any ``overrides`` given.

    The two ways to ask for a balanced split give the maps of two libraries: ``device_map="auto" |
    "balanced" | "balanced_low_0" | "sequential"`` gives transformers 5's
    ``from_pretrained(device_map=...)`` (each GPU but the last gets its share of the model plus 1.25
    × the larger of the largest decoder layer and the largest module, usually the embedding; with no
    ``max_memory`` at all, 90% of the cpu), as ``from_pretrained`` does; ``strategy="balanced"`` (or
    ``"balanced_low_0"``, ``"sequential"``) without a preset gives accelerate's
    ``infer_auto_device_map(get_balanced_memory(...))`` (the share plus 1.25 × the larger of the
    first decoder layer and the mean module).

    ``reserve``, ``max_memory`` and ``overhead`` take one size for every accelerator, a list in
    accelerator order, or a dict keyed by device name or accelerator index; sizes are ints or
    strings such as ``"512MiB"``. ``cache`` is a ``CacheSpec``, a ``Cache`` or a dict; ``runtime`` a
    ``RuntimeSpec`` or a dict. ``cache_offload=True`` offloads ``cache`` to host RAM (as
    ``CacheSpec(..., offload=True)``): the cpu's kv column holds the whole cache and each device
    that computes layers two prefetch slots of its largest layer. ``quantize`` (``"int8"``,
    ``"q8_0"``, ``"q4_k"``, ``"q6_k"``) sizes a float checkpoint's linears as a quantising load will
    hold them: the blocks' linears in that type (a ggml type falls back as llama.cpp does when a row
    is not whole blocks: Q4_K to Q5_0, Q6_K to Q8_0), the embedding and head kept in full precision
    under int8 (as transformers) and promoted to Q6_K (q4_k, q6_k) or Q8_0 (q8_0) otherwise, norms
    and biases as they are. ``offload="sequential"`` or ``"group"`` (``blocks_per_group``,
    ``prefetch``) plans accelerate's and diffusers' offloaded execution: the layers kept on cpu or
    disk computed on the first accelerator, their onload slots charged to its scratch (see
    ``Model.load``). ``world`` (``"host:gpus[,host:gpus...]"``, torchrun's rank order) plans a
    multi-process tensor-parallel run: rank ``r`` stands for the ``r``-th accelerator of
    ``devices``, and ``explain()`` lists each rank's host and device. Raises ``OutOfMemoryError``
    (with ``.shortfalls`` and ``.fixes``) when it does not fit, ``CudaUnavailable`` for a ``cuda:N``
    without a size where CUDA cannot be used (as ``Model()`` does; ``cuda:N:24GiB`` plans without
    the GPU), and ``PlanError`` for an invalid request.

    Unlike either library, each device is also charged the KV cache and scratch placed on it,
    and the cpu the two upload staging buffers (at most 4 MiB each); with no cache,
    ``runtime=RuntimeSpec(0, 0, 0)`` and the cpu's budget 8 MiB larger, the maps are theirs.

    Architectures the engine does not run (anything but llama, mistral, qwen2, qwen3 and phi3)
    are planned with a warning; a head with no tensor of its own is tied to the embedding
    whatever the architecture; sliding-window layers (GGUF ``{arch}.attention.sliding_window``,
    config.json ``sliding_window`` with transformers' per-layer rules) keep llama.cpp's SWA
    cache, the window plus one input chunk padded to 256 tokens, for architectures the engine
    does not run. With ``allow_disk`` (or ``disk`` listed), a cpu too small for its share streams
    part of it from disk instead of failing: the embedding under ``autosplit``, the embedding and
    then its last layers under ``layers``.
    """
    return _native._plan(source, locals())


def fit(
    source: Checkpoint | str | os.PathLike[str] | Mapping[str, Any] | ModelSpec,
    *,
    devices: _Devices | None = None,
    target: _FitTarget = "max_seq_len",
    strategy: _Strategy | None = None,
    dtype: str = "auto",
    cache: CacheSpec | Cache | Mapping[str, Any] | None = None,
    cache_dtype: str | None = None,
    runtime: RuntimeSpec | Mapping[str, Any] | None = None,
    reserve: _Sizes = None,
    max_memory: _Sizes = None,
    n_gpu_layers: int | None = None,
    split_mode: _SplitMode | None = None,
    tensor_split: Sequence[float] | None = None,
    main_gpu: int | None = None,
    device_map: _DeviceMap | None = None,
    allow_disk: bool = False,
    weight_dtype: str | None = None,
    overhead: _Sizes = None,
    overrides: _Overrides | None = None,
    gpu_split: Sequence[float] | None = None,
    use_mmap: bool = True,
    cache_offload: bool = False,
    quantize: _Quantize | None = None,
    offload: _Offload | None = None,
    blocks_per_group: int = 1,
    prefetch: bool = True,
    n_cpu_moe: int | None = None,
) -> int:
    """The largest ``target`` that fits: ``"max_seq_len"`` (multiples of 256 up to the model's
    context length), ``"batch_size"``, or ``"n_gpu_layers"`` (strategy ``layers``); or
    ``"n_cpu_moe"``, the fewest layers of a mixture-of-experts model whose experts must stay in host
    RAM for the rest to fit the accelerators. Same options as ``plan()``; ``cache`` (or just
    ``cache_dtype``) gives the cache dtype and batch (fp16, batch 1 without one);
    ``cache_offload=True`` offloads that cache to host RAM; ``devices`` left at None is this
    machine's, as for ``plan()``. Raises ``OutOfMemoryError`` when even the smallest value does not
    fit.
    """
    return _native._fit(source, locals())


def from_pretrained(
    path: _Path,
    *,
    device_map: _DeviceMap | None = "auto",
    max_memory: _Sizes = None,
    dtype: Any = "auto",
    devices: _Devices | None = None,
    runtime: RuntimeSpec | Mapping[str, Any] | None = None,
    progress: bool = False,
    callback: _Callback | None = None,
    compute: _Compute = "fast",
    n_threads: int | None = None,
    quantize: _Quantize | None = None,
    offload: _Offload | None = None,
    blocks_per_group: int = 1,
    prefetch: bool = True,
    torch_dtype: Any = None,
    load_in_8bit: bool = False,
    load_in_4bit: bool = False,
    quantization_config: Any = None,
    **kwargs: Any,
) -> Model:
    """accelerate style: open ``path``, plan with ``device_map`` (``"auto"`` = balanced,
    ``"balanced"``, ``"balanced_low_0"``, ``"sequential"``, a device name, or a dict of module/layer
    prefix -> device, with ``"re:PATTERN"`` keys as llama.cpp ``-ot`` overrides) and ``max_memory``
    (one size, a list in accelerator order, or a dict by device name or index), and load. Returns
    the loaded Model. The presets place as transformers 5's ``from_pretrained`` does: ``balanced``
    caps each GPU but the last at its share of the model plus 1.25 × the larger of the largest
    decoder layer and the largest module (usually the embedding), not accelerate's first layer and
    mean module (``weightlift.plan(strategy="balanced")``); with no ``max_memory``, 90% of the cpu.
    Unlike transformers, each device's budget also pays for the KV cache and scratch the engine
    allocates there, and the cpu for the upload staging buffers. ``quantize="int8"`` is
    transformers' ``BitsAndBytesConfig(load_in_8bit=True)`` (also ``"q8_0"``, ``"q4_k"``,
    ``"q6_k"``; see ``Model``). ``offload="sequential"`` (or ``"group"`` with ``blocks_per_group``
    and ``prefetch``) computes the layers the map leaves on cpu or disk on the first accelerator, as
    accelerate's dispatch hooks do (see ``Model.load``); None computes each where it is.

    transformers' words work too: ``torch_dtype`` is ``dtype`` (either may be a ``torch.dtype``
    such as ``torch.float16``); ``load_in_8bit=True`` and ``quantization_config`` (a
    ``BitsAndBytesConfig`` or its dict, with ``load_in_8bit`` and ``llm_int8_threshold``) are
    ``quantize="int8"`` and ``Model.int8_threshold``; 4-bit bitsandbytes raises
    ``UnsupportedError``. ``low_cpu_mem_usage``, ``trust_remote_code``, ``attn_implementation``,
    ``use_safetensors``, ``local_files_only``, ``offload_folder`` and ``offload_state_dict``
    are accepted and change nothing; the Hub's ``revision``, ``cache_dir``, ``token`` and
    ``subfolder`` are refused, as weightlift reads local files only.
    """
    # the load reads from_pretrained's own keywords; the transformers words are read here
    kw = {k: v for k, v in locals().items() if k not in _TRANSFORMERS_WORDS}
    dtype, quantize, int8_threshold = _transformers_words(
        dtype, torch_dtype, quantize, load_in_8bit, load_in_4bit, quantization_config, kwargs
    )
    kw.update(dtype=dtype, quantize=quantize)
    model = Model(
        path,
        devices=devices,
        dtype=dtype,
        runtime=runtime,
        compute=compute,
        n_threads=n_threads,
        quantize=quantize,
    )
    if int8_threshold is not None:
        model.int8_threshold = int8_threshold
    with _progress(kw) as kw:
        model._load("pretrained", kw)
    return model


# from_pretrained's transformers keywords, which _transformers_words reads.
_TRANSFORMERS_WORDS = (
    "torch_dtype",
    "load_in_8bit",
    "load_in_4bit",
    "quantization_config",
    "kwargs",
)

# transformers' from_pretrained keywords that change nothing here.
_PRETRAINED_NO_EFFECT = (
    "low_cpu_mem_usage",
    "trust_remote_code",
    "attn_implementation",
    "use_safetensors",
    "local_files_only",
    "offload_folder",
    "offload_state_dict",
)

# transformers' Hub keywords: weightlift reads local files only.
_PRETRAINED_HUB = ("revision", "cache_dir", "token", "subfolder")


def _dtype_name(value: Any) -> Any:
    """A dtype as a name: ``torch.float16`` (a ``torch.dtype``, known by its text) as
    ``"float16"``; a string or anything else as it is, for the core's grammar to read."""
    text = str(value)
    if not isinstance(value, str) and text.startswith("torch."):
        return text.removeprefix("torch.")
    return value


def _transformers_words(
    dtype: Any,
    torch_dtype: Any,
    quantize: Any,
    load_in_8bit: bool,
    load_in_4bit: bool,
    quantization_config: Any,
    rest: dict[str, Any],
) -> tuple[Any, Any, float | None]:
    """from_pretrained's transformers keywords as weightlift's: (dtype, quantize, the LLM.int8
    outlier threshold or None)."""
    for name, value in rest.items():
        if name in _PRETRAINED_NO_EFFECT:
            continue
        if name in _PRETRAINED_HUB:
            if value is None:
                continue
            raise UnsupportedError(
                f"from_pretrained({name}=...) is not supported: weightlift reads local files "
                "only; download the model first (huggingface-cli download ORG/NAME --local-dir "
                "DIR) and pass DIR"
            )
        raise TypeError(f"from_pretrained() got an unexpected keyword argument '{name}'")
    if torch_dtype is not None:
        if dtype != "auto":
            raise TypeError(
                "from_pretrained: got both dtype and torch_dtype (transformers' former name "
                "for it); pass one"
            )
        dtype = torch_dtype
    config = quantization_config
    if config is not None and not isinstance(config, Mapping):
        config = config.to_dict() if hasattr(config, "to_dict") else vars(config)
    config = dict(config or {})
    method = config.get("quant_method", "bitsandbytes")
    if str(getattr(method, "value", method)) != "bitsandbytes":
        raise UnsupportedError(
            f"from_pretrained(quantization_config=...) with quant_method {method!r} is not "
            "supported: only bitsandbytes' 8-bit (load_in_8bit) quantises on load; a GPTQ or "
            "AWQ checkpoint is read from its own files without a quantization_config"
        )
    if load_in_4bit or config.get("load_in_4bit"):
        raise UnsupportedError(
            "from_pretrained(load_in_4bit=True) is not supported: bitsandbytes' 4-bit NF4/FP4 "
            "is not built; quantize='q4_k' quantises to llama.cpp's 4-bit K-quant on load, or "
            "load_in_8bit=True to LLM.int8"
        )
    eight_bit = load_in_8bit or bool(config.get("load_in_8bit"))
    if eight_bit:
        if quantize not in (None, "int8"):
            raise PlanError(
                f"from_pretrained: load_in_8bit asks for quantize='int8', got quantize="
                f"{quantize!r} too; pass one"
            )
        quantize = "int8"
    for key, neutral in (("llm_int8_skip_modules", None), ("llm_int8_has_fp16_weight", False)):
        if config.get(key, neutral) != neutral:
            raise UnsupportedError(
                f"from_pretrained(quantization_config={{{key!r}: ...}}) is not supported: "
                "LLM.int8 quantises every linear but the head, with int8 weights"
            )
    threshold = config.get("llm_int8_threshold") if eight_bit else None
    return _dtype_name(dtype), quantize, None if threshold is None else float(threshold)


def load_gguf(
    path: Checkpoint | _Path | None = None,
    *,
    n_gpu_layers: int = 0,
    split_mode: _SplitMode = "layer",
    tensor_split: Sequence[float] | None = None,
    main_gpu: int = 0,
    use_mmap: bool = True,
    use_direct_io: bool = False,
    use_mlock: bool = False,
    check_tensors: bool = False,
    vocab_only: bool = False,
    progress_callback: Any = None,
    devices: _Devices | None = None,
    runtime: RuntimeSpec | Mapping[str, Any] | None = None,
    n_ctx: int = 512,
    n_batch: int = 512,
    type_k: str | int | None = "f16",
    type_v: str | int | None = "f16",
    n_threads: int | None = None,
    compute: _Compute = "fast",
    seed: int | None = None,
    callback: _Callback | None = None,
    progress: bool = False,
    offload: _Offload | None = None,
    blocks_per_group: int = 1,
    prefetch: bool = True,
    model_path: Checkpoint | _Path | None = None,
    verbose: bool = True,
    chat_format: str | None = None,
    spm_infill: bool = False,
) -> Model:
    """llama.cpp style: ``n_gpu_layers`` (-1 all; the last N layers go to the accelerators, the
    output too when N > n_layer), ``split_mode`` (``none``, ``layer``, ``row``), ``tensor_split``,
    ``main_gpu``; ``use_mmap``, ``use_direct_io``, ``check_tensors``.
    ``progress_callback(fraction)`` is called with the fraction loaded, as in llama.cpp, and
    returning False cancels (``LoadCancelled``). ``vocab_only`` opens the metadata and tokenizer
    only and loads no tensors. ``use_mlock`` locks the memory-mapped tensors in RAM (a locked-memory
    limit that refuses is reported in ``Model.warnings``). As llama-cpp-python's ``Llama``, the file
    may be given as ``model_path=``, and ``verbose`` is accepted (nothing is printed);
    ``chat_format`` names one of llama-cpp-python's built-in chat formats (``"chatml"``,
    ``"llama-2"``, ``"llama-3"``, ``"mistral-instruct"``, ``"gemma"``, ``"zephyr"``, ...) used in
    place of the model's own chat template, whose stop string then ends chat replies, or
    ``"chat_template.NAME"``, another template the GGUF names; None keeps the model's template.
    ``spm_infill`` puts the suffix first in fill-in-the-middle prompts (``suffix=``).
    ``n_ctx=0`` is the context the model was trained with, as in llama.cpp.
    """
    kw = locals()
    if path is not None and model_path is not None:
        raise TypeError("load_gguf: got both path and model_path; pass the GGUF once")
    source = path if path is not None else model_path
    if source is None:
        raise TypeError("load_gguf: missing the GGUF to load (path, or model_path=)")
    if callback is not None and progress_callback is not None:
        raise PlanError(
            "load_gguf: got both callback and progress_callback; pass one (callback takes "
            "(bytes_done, bytes_total, tensor, device), progress_callback a fraction)"
        )
    # llama.cpp keeps the stored dtypes and quantises nothing on load.
    opened = dict(kw, dtype="auto", quantize=None)
    model = _native.Model.__new__(Model, _opened(source, vocab_only), opened)
    with _progress(kw) as kw:
        model._load("llama", kw)
    return model


def sample(
    logits: npt.NDArray[np.float32],
    history: Sequence[int] = (),
    *,
    temperature: float = 0.8,
    top_k: int = 40,
    top_p: float = 0.95,
    min_p: float = 0.05,
    typical_p: float = 1.0,
    repeat_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    mirostat_mode: int = 0,
    mirostat_tau: float = 5.0,
    mirostat_eta: float = 0.1,
    seed: int | None = None,
) -> int:
    """One token from ``logits`` (one row, float32) through the engine's sampler chain, with the
    penalties over ``history``: llama-cpp-python's ``Llama.sample`` on logits the caller holds.
    ``temperature=0`` is the argmax, lowest id on ties.
    """
    return _native._sample(logits, list(history), locals())
