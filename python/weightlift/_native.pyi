"""Type stubs for the native module (checked against the build by mypy.stubtest)."""

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Final, Literal, final

import numpy as np
import numpy.typing as npt

__all__ = [
    "__version__",
    "open",
    "Checkpoint",
    "TensorInfo",
    "ModelSpec",
    "plan",
    "fit",
    "devices",
    "parse_devices",
    "CacheSpec",
    "RuntimeSpec",
    "Device",
    "DeviceUsage",
    "Placement",
    "Plan",
    "tensor",
    "use_devices",
    "cuda_info",
    "from_pretrained",
    "load_gguf",
    "sample",
    "DeviceTensor",
    "Model",
    "Cache",
    "Batch",
    "CompletionStream",
    "LlamaGrammar",
    "TPContext",
    "TPGroupMember",
    "BROADCAST_KV",
    "BROADCAST_ID",
    "BROADCAST_VC",
    "BROADCAST_RS",
    "BROADCAST_Q",
]

__version__: str

def open(
    path: str | os.PathLike[str], *, check_tensors: bool = False, vocab_only: bool = False
) -> Checkpoint: ...

@final
class Checkpoint:
    @property
    def format(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def closed(self) -> bool: ...
    @property
    def files(self) -> list[str]: ...
    @property
    def metadata(self) -> dict[str, Any]: ...
    @property
    def spec(self) -> ModelSpec | None: ...
    @property
    def spec_error(self) -> str | None: ...
    @property
    def warnings(self) -> list[str]: ...
    @property
    def tensors(self) -> list[TensorInfo]: ...
    @property
    def tokenizer(self) -> dict[str, Any]: ...
    @property
    def config(self) -> dict[str, Any] | None: ...
    @property
    def n_params(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    def raw(self, name: str) -> npt.NDArray[Any]: ...
    def dequantize(
        self, name: str, out: npt.NDArray[np.float32] | None = None
    ) -> npt.NDArray[np.float32]: ...
    def close(self) -> None: ...
    def __enter__(self) -> Checkpoint: ...
    def __exit__(self, *_args: object) -> bool: ...
    def __len__(self) -> int: ...
    def __contains__(self, key: str, /) -> bool: ...
    def __getitem__(self, key: str, /) -> TensorInfo: ...
    def __iter__(self) -> Iterator[str]: ...

@final
class TensorInfo:
    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def file(self) -> str: ...
    @property
    def offset(self) -> int: ...
    @property
    def layer(self) -> int | None: ...
    @property
    def role(self) -> str | None: ...
    @property
    def n_elements(self) -> int: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __ne__(self, value: object, /) -> bool: ...

@final
class ModelSpec:
    @property
    def architecture(self) -> str: ...
    @property
    def n_layers(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def n_heads(self) -> int: ...
    @property
    def n_kv_heads(self) -> list[int]: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def context_length(self) -> int: ...
    @property
    def rope_theta(self) -> float: ...
    @property
    def rope_dim(self) -> int: ...
    @property
    def rms_norm_eps(self) -> float: ...
    @property
    def tie_word_embeddings(self) -> bool: ...
    @property
    def attention_bias(self) -> bool: ...
    def to_dict(self) -> dict[str, Any]: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __ne__(self, value: object, /) -> bool: ...

_Sizes = int | str | Sequence[int | str] | Mapping[str | int, int | str] | None
_Strategy = Literal[
    "autosplit",
    "auto",
    "sequential",
    "balanced",
    "balanced_low_0",
    "layers",
    "n_gpu_layers",
    "tensor_parallel",
    "tp",
    "map",
    "device_map",
]
_SplitMode = Literal["none", "layer", "row"]
_DeviceMap = (
    Literal["auto", "balanced", "balanced_low_0", "sequential"] | str | Mapping[str, str | int]
)
_Overrides = str | Sequence[str] | Mapping[str, str | int]
_Devices = str | Sequence[str]
_Compute = Literal["fast", "exact"]
_Quantize = Literal["int8", "q8_0", "q4_k", "q6_k"]
_FitTarget = Literal[
    "max_seq_len",
    "ctx",
    "context",
    "batch_size",
    "batch",
    "n_gpu_layers",
    "ngl",
    "n_cpu_moe",
    "ncmoe",
]

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
    offload: Literal["sequential", "group"] | None = None,
    blocks_per_group: int = 1,
    prefetch: bool = True,
    world: str | None = None,
    n_cpu_moe: int | None = None,
) -> Plan:
    """Plan where every tensor and every layer's KV cache goes, before a byte is read.

    A balanced split can be asked for two ways, each giving the maps of one library:

    - ``device_map="auto" | "balanced" | "balanced_low_0" | "sequential"`` gives what
      transformers 5's ``from_pretrained(device_map=...)`` gives (and what
      ``weightlift.from_pretrained`` loads): every GPU but the last is capped at its share of
      the model plus 1.25 x the larger of the largest decoder layer and the largest module
      (usually the embedding), and with no ``max_memory`` at all the cpu gets 90% of its RAM;
    - ``strategy="balanced" | "balanced_low_0" | "sequential"`` without a preset gives
      accelerate's ``infer_auto_device_map(get_balanced_memory(...))``: the share plus 1.25 x
      the larger of the first decoder layer and the mean module.

    Unlike either library, each device is also charged the KV cache and scratch placed on it,
    and the cpu the two upload staging buffers (at most 4 MiB each); with no cache,
    ``runtime=RuntimeSpec(0, 0, 0)`` and the cpu's budget 8 MiB larger, the maps are theirs.

    Architectures the engine does not run (anything but llama, mistral, qwen2, qwen3 and phi3) are
    planned with a warning; a head with no tensor of its own is tied to the embedding whatever the
    architecture; sliding-window layers (GGUF ``{arch}.attention.sliding_window``, config.json
    ``sliding_window`` with transformers' per-layer rules) keep llama.cpp's SWA cache, the
    window plus one input chunk padded to 256 tokens, for architectures the engine does not
    run. With ``allow_disk`` (or ``disk`` listed), a cpu too small for its share streams part
    of it from disk instead of failing: the embedding under ``autosplit``, the embedding and
    then its last layers under ``layers``.
    """

def fit(
    source: Checkpoint | str | os.PathLike[str] | Mapping[str, Any] | ModelSpec,
    *,
    devices: _Devices | None = None,
    target: Literal[
        "max_seq_len",
        "ctx",
        "context",
        "batch_size",
        "batch",
        "n_gpu_layers",
        "ngl",
        "n_cpu_moe",
        "ncmoe",
    ] = "max_seq_len",
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
    offload: Literal["sequential", "group"] | None = None,
    blocks_per_group: int = 1,
    prefetch: bool = True,
    n_cpu_moe: int | None = None,
) -> int: ...
def devices() -> list[Device]: ...
def parse_devices(spec: str | Sequence[str]) -> list[Device]: ...

@final
class CacheSpec:
    def __new__(
        cls, max_seq_len: int, batch_size: int = 1, dtype: str = "fp16", offload: bool = False
    ) -> CacheSpec: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def offload(self) -> bool: ...
    def nbytes(self, spec: ModelSpec) -> int: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __ne__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class RuntimeSpec:
    def __new__(
        cls,
        max_input_len: int = 2048,
        max_attention_size: int = 4194304,
        max_dq_size: int = 536870912,
        low_mem: bool = False,
    ) -> RuntimeSpec: ...
    @property
    def max_input_len(self) -> int: ...
    @property
    def max_attention_size(self) -> int: ...
    @property
    def max_dq_size(self) -> int: ...
    @property
    def low_mem(self) -> bool: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __ne__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class Device:
    @property
    def name(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def capacity(self) -> int | None: ...
    @property
    def reserve(self) -> int: ...
    @property
    def overhead(self) -> int: ...
    @property
    def overhead_parts(self) -> list[tuple[str, int, str]]: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __ne__(self, value: object, /) -> bool: ...

@final
class DeviceUsage:
    @property
    def name(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def capacity(self) -> int | None: ...
    @property
    def weights(self) -> int: ...
    @property
    def kv(self) -> int: ...
    @property
    def scratch(self) -> int: ...
    @property
    def overhead(self) -> int: ...
    @property
    def overhead_parts(self) -> list[tuple[str, int, str]]: ...
    @property
    def reserve(self) -> int: ...
    @property
    def free(self) -> int | None: ...
    @property
    def used(self) -> int: ...
    @property
    def layers(self) -> list[tuple[int, int]]: ...
    @property
    def holds(self) -> list[str]: ...
    @property
    def implicit(self) -> bool: ...

@final
class Placement:
    @property
    def name(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def layer(self) -> int | None: ...
    @property
    def shards(self) -> list[tuple[str, int, int, int]] | None: ...

@final
class Plan:
    @property
    def strategy(self) -> str: ...
    @property
    def architecture(self) -> str: ...
    @property
    def n_layers(self) -> int: ...
    @property
    def quantize(self) -> str | None: ...
    @property
    def cache(self) -> CacheSpec | None: ...
    @property
    def runtime(self) -> RuntimeSpec: ...
    def device_of(self, name: str) -> str:
        """The device of a tensor; a tensor split across devices (row split, tensor
        parallelism) gives every slice's device in order, joined by commas, as
        ``Model.device_of`` does."""
    @property
    def layer_devices(self) -> list[str]: ...
    @property
    def embed_device(self) -> str: ...
    @property
    def head_device(self) -> str: ...
    @property
    def tied_output_copy(self) -> str | None: ...
    @property
    def tensors(self) -> list[Placement]: ...
    @property
    def devices(self) -> list[DeviceUsage]: ...
    @property
    def host(self) -> dict[str, int]: ...
    @property
    def warnings(self) -> list[str]: ...
    def tp_split(self, kind: str) -> list[tuple[int, int, int]]: ...
    def to_json(self) -> str: ...
    @staticmethod
    def from_json(text: str) -> Plan: ...
    def explain(self) -> str: ...
    def to_svg(self) -> str: ...
    def save_svg(self, path: str | os.PathLike[str]) -> None: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __ne__(self, value: object, /) -> bool: ...

# ----------------------------------------------------------------------------------------------
# The engine: device tensors, Model, Cache, TPContext and the convenience loaders.

BROADCAST_KV: Final = 0
BROADCAST_ID: Final = 1
BROADCAST_VC: Final = 2
BROADCAST_RS: Final = 3
BROADCAST_Q: Final = 4

_Path = str | os.PathLike[str]
_Size = int | str
# callback(bytes_done, bytes_total, tensor_name, device) -> False cancels.
_Callback = Callable[[int, int, str, str], bool | None]

def use_devices(spec: str) -> list[tuple[str, int | None]]: ...
def sample(
    logits: npt.NDArray[np.float32],
    history: Sequence[int] = ...,
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
) -> int: ...
def cuda_info() -> dict[str, Any]: ...
def tensor(array: npt.ArrayLike, device: str) -> DeviceTensor: ...

@final
class DeviceTensor:
    @property
    def device(self) -> str: ...
    @property
    def shape(self) -> list[int]: ...
    @property
    def dtype(self) -> str: ...
    @property
    def nbytes(self) -> int: ...
    def numpy(self) -> npt.NDArray[Any]: ...
    def to(self, device: str) -> DeviceTensor: ...
    def free(self) -> None: ...

@final
class LlamaGrammar:
    """A parsed GBNF grammar (root rule `root`), as llama-cpp-python's `LlamaGrammar`."""

    @staticmethod
    def from_string(grammar: str, verbose: bool = True) -> LlamaGrammar: ...
    @staticmethod
    def from_file(file: _Path, verbose: bool = True) -> LlamaGrammar: ...
    @staticmethod
    def from_json_schema(json_schema: str, verbose: bool = True) -> LlamaGrammar: ...
    @property
    def text(self) -> str: ...

@final
class Batch:
    """Generations stepped together on one model, each in a slot that keeps its prefix."""

    def __new__(cls, model: Model, parallel: int = 1) -> Batch: ...
    @property
    def parallel(self) -> int: ...
    @property
    def running(self) -> int: ...
    @property
    def n_ctx(self) -> int: ...
    def step(self) -> list[tuple[int, str, Any, dict[str, float] | None]]: ...
    def cancel(self, id: int) -> bool: ...

@final
class CompletionStream:
    """A generation streamed as text pieces (`generate`) or response chunks (`create_*`)."""

    def __iter__(self) -> CompletionStream: ...
    def __next__(self) -> Any: ...
    @property
    def finish_reason(self) -> str | None: ...

@final
class Model:
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
    ) -> Model: ...
    def forward(
        self, ids: Sequence[int], *, cache: Cache | None = None, logits: str = "last"
    ) -> npt.NDArray[np.float32]: ...
    def forward_batch(
        self, seqs: Sequence[tuple[Cache, Sequence[int]]]
    ) -> npt.NDArray[np.float32]: ...
    def embed(
        self, ids: Sequence[int], *, pooling: int | str | None = None, normalize: bool = False
    ) -> list[float] | list[list[float]]: ...
    @property
    def compute(self) -> str: ...
    @compute.setter
    def compute(self, value: str) -> None: ...
    @property
    def n_threads(self) -> int: ...
    @property
    def int8_threshold(self) -> float: ...
    @int8_threshold.setter
    def int8_threshold(self, value: float) -> None: ...
    def tokenize(
        self, text: str | bytes, add_bos: bool | None = None, special: bool = False
    ) -> list[int]: ...
    def detokenize(self, ids: Sequence[int], special: bool = False) -> str: ...
    def detokenize_bytes(self, ids: Sequence[int], special: bool = False) -> bytes: ...
    def grammar_mask(
        self, grammar: str | LlamaGrammar, logits: npt.NDArray[np.float32]
    ) -> npt.NDArray[np.float32]: ...
    def generate(
        self,
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
        repetition_penalty: float | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        num_return_sequences: int = 1,
    ) -> str | list[str] | CompletionStream: ...
    def create_completion(
        self,
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
        batch: Batch | None = None,
    ) -> dict[str, Any] | CompletionStream | int: ...
    def __call__(
        self, prompt: str | bytes | Sequence[int], *args: Any, **kwargs: Any
    ) -> dict[str, Any] | CompletionStream: ...
    def create_chat_completion(
        self,
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
        batch: Batch | None = None,
    ) -> dict[str, Any] | CompletionStream | int: ...
    @property
    def timings(self) -> dict[str, float] | None: ...
    def n_ctx(self) -> int: ...
    def n_vocab(self) -> int: ...
    def token_bos(self) -> int: ...
    def token_eos(self) -> int: ...
    def load(
        self,
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
        offload: Literal["sequential", "group"] | None = None,
        blocks_per_group: int = 1,
        prefetch: bool = True,
        n_cpu_moe: int | None = None,
    ) -> None: ...
    def load_autosplit(
        self,
        cache: Cache | None = None,
        reserve_vram: _Sizes = None,
        *,
        progress: bool = False,
        callback: _Callback | None = None,
        offload: Literal["sequential", "group"] | None = None,
        blocks_per_group: int = 1,
        prefetch: bool = True,
    ) -> None: ...
    def load_tp(
        self,
        gpu_split: Sequence[float] | None = None,
        expect_cache_tokens: int = 0,
        expect_cache_base: str | None = None,
        *,
        progress: bool = False,
        callback: _Callback | None = None,
        world: str | None = None,
        rank: int | None = None,
    ) -> None: ...
    def unload(self) -> None: ...
    @property
    def loaded(self) -> bool: ...
    @property
    def plan(self) -> Plan | None: ...
    @property
    def tp(self) -> TPContext | None: ...
    def plan_json(self) -> str | None: ...
    def memory(self) -> dict[str, int]: ...
    def device_usage(self) -> dict[str, int]: ...
    def peak_memory(self) -> dict[str, int]: ...
    def transfer_stats(self) -> dict[str, float]: ...
    @property
    def devices(self) -> str: ...
    @property
    def locked_bytes(self) -> int: ...
    @property
    def warnings(self) -> list[str]: ...
    def device_of(self, name: str) -> str: ...
    @property
    def layer_devices(self) -> list[str]: ...
    def tensor(self, name: str, dequantize: bool = False) -> npt.NDArray[Any]: ...
    def tensor_info(self, name: str) -> TensorInfo: ...
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...
    def __enter__(self) -> Model: ...
    def __exit__(self, *_args: object) -> bool: ...
    @property
    def cache(self) -> Cache | None: ...

@final
class Cache:
    def __new__(
        cls,
        model: Model,
        *,
        max_seq_len: int | None = None,
        batch_size: int = 1,
        dtype: str = "fp16",
        lazy: bool = True,
        offload: bool = False,
    ) -> Cache: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def offload(self) -> bool: ...
    @property
    def allocated(self) -> bool: ...
    @property
    def seq_len(self) -> int: ...
    def reset(self) -> None: ...
    @property
    def tokens(self) -> list[int]: ...
    def save_state(self) -> bytes: ...
    def truncate(self, n: int) -> None: ...
    def load_state(self, state: bytes) -> None: ...
    def memory(self) -> dict[str, int]: ...
    def expected_memory(self) -> dict[str, int]: ...
    def device_of(self, layer: int) -> str: ...
    def write(self, layer: int, pos: int, k: npt.ArrayLike, v: npt.ArrayLike) -> None: ...
    def read(
        self, layer: int, start: int, end: int
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]: ...
    def fetch(self, layer: int) -> str: ...
    def free(self) -> None: ...

_Split = list[tuple[int, int, int]]
# (device_index, offset, rows, cols)
_ScratchSlices = list[tuple[int, int, int, int]]

@final
class TPGroupMember:
    @property
    def rank(self) -> int: ...

@final
class TPContext:
    def __new__(
        cls,
        model: Model,
        gpu_split: Sequence[float] | None = None,
        expect_cache_tokens: int = 0,
        expect_cache_base: str | None = None,
    ) -> TPContext: ...
    @property
    def kv_split(self) -> _Split: ...
    @property
    def id_split(self) -> _Split: ...
    @property
    def vc_split(self) -> _Split: ...
    @property
    def rs_split(self) -> _Split: ...
    @property
    def q_split(self) -> _Split: ...
    @property
    def peer_copies(self) -> bool: ...
    @peer_copies.setter
    def peer_copies(self, on: bool) -> None: ...
    @property
    def rank(self) -> int | None: ...
    @property
    def transport(self) -> str: ...
    @staticmethod
    def thread_group(world_size: int) -> list[TPGroupMember]: ...
    def join(self, member: TPGroupMember) -> None: ...
    def join_nccl(self, wait: float = 300.0) -> tuple[int, int]: ...
    def get_split(self, broadcast_type: int) -> _Split: ...
    def get_devs(self, broadcast_type: int) -> list[int]: ...
    def all_devices(self) -> list[int]: ...
    def device_name(self, i: int) -> str: ...
    def finalize(self) -> None: ...
    def unload(self) -> None: ...
    def broadcast(
        self, buffer: int, tensor: DeviceTensor, broadcast_type: int, dim: int = 1
    ) -> list[DeviceTensor]: ...
    def gather(
        self, buffer: int, inputs: Sequence[DeviceTensor], broadcast_type: int, dim: int = 1
    ) -> npt.NDArray[Any]: ...
    def allgather(
        self,
        buffer: int,
        inputs: Sequence[DeviceTensor],
        broadcast_type_g: int,
        broadcast_type_b: int,
        dim: int = 1,
    ) -> list[DeviceTensor]: ...
    def add_residual(
        self,
        target: Sequence[DeviceTensor],
        source: Sequence[DeviceTensor],
        broadcast_type: int,
        dim: int = 1,
    ) -> None: ...
    def wait_streams(self) -> None: ...
    def get_sin_cos(self) -> tuple[list[DeviceTensor], list[DeviceTensor]]: ...
    def begin_scratch_alloc_tp(self) -> None: ...
    def reserve_scratch(self, scratch: Sequence[int]) -> None: ...
    def get_scratch_slice_tp(
        self, rows: int, dtype: str, broadcast_type: int, dim: int = 1
    ) -> _ScratchSlices: ...
    def get_scratch_slice_tp_bc(
        self, rows: int, dtype: str, broadcast_type: int, dim: int = 1
    ) -> _ScratchSlices: ...

def from_pretrained(
    path: _Path,
    *,
    device_map: _DeviceMap | None = "auto",
    max_memory: _Sizes = None,
    dtype: str = "auto",
    devices: _Devices | None = None,
    runtime: RuntimeSpec | Mapping[str, Any] | None = None,
    progress: bool = False,
    callback: _Callback | None = None,
    compute: _Compute = "fast",
    n_threads: int | None = None,
    quantize: _Quantize | None = None,
    offload: Literal["sequential", "group"] | None = None,
    blocks_per_group: int = 1,
    prefetch: bool = True,
) -> Model:
    """Open, plan with ``device_map`` and ``max_memory``, and load, as transformers 5's
    ``from_pretrained`` does: its presets cap each GPU but the last at its share of the model
    plus 1.25 x the larger of the largest decoder layer and the largest module (not
    accelerate's first layer and mean module, which ``plan(strategy="balanced")`` gives), and
    with no ``max_memory`` the cpu gets 90% of its RAM. Each device's budget also pays for the
    KV cache and scratch placed there, and the cpu for the upload staging buffers."""

def load_gguf(
    path: _Path | None = None,
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
    progress_callback: Callable[[float], bool | None] | None = None,
    devices: _Devices | None = None,
    runtime: RuntimeSpec | Mapping[str, Any] | None = None,
    n_ctx: int = 512,
    n_batch: int = 512,
    type_k: str | int = "f16",
    type_v: str | int = "f16",
    n_threads: int | None = None,
    compute: _Compute = "fast",
    seed: int | None = None,
    callback: _Callback | None = None,
    progress: bool = False,
    offload: Literal["sequential", "group"] | None = None,
    blocks_per_group: int = 1,
    prefetch: bool = True,
    model_path: _Path | None = None,
    verbose: bool = True,
    chat_format: str | None = None,
    spm_infill: bool = False,
) -> Model: ...
