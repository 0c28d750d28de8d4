"""``weightlift.Llama``: llama-cpp-python's ``Llama`` class over a weightlift ``Model``.

A program written for llama-cpp-python runs with ``from weightlift import Llama`` in place of
``from llama_cpp import Llama``. Each constructor keyword maps to a weightlift option, is accepted
because it changes nothing here (a performance knob of llama.cpp's own), or is refused by name
with ``UnsupportedError`` when it asks for something weightlift does not do. The methods keep
llama-cpp-python's names, arguments and return shapes; the work is the native ``Model``'s.

This module holds only that mapping: generation, sampling, tokenizers, caches and states are the
engine's, so a Rust caller gets the same behaviour without it.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import random
import sys
from collections import OrderedDict, deque
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from pathlib import PurePosixPath
from typing import Any

import numpy as np
import numpy.typing as npt

from weightlift import _native
from weightlift._api import Model, load_gguf, sample
from weightlift._errors import PlanError, UnsupportedError
from weightlift._types import Checkpoint
from weightlift._types import open as open_checkpoint

# llama.cpp's constants that llama-cpp-python programs pass as numbers.
LLAMA_DEFAULT_SEED = 0xFFFFFFFF
LLAMA_SPLIT_MODE_NONE = 0
LLAMA_SPLIT_MODE_LAYER = 1
LLAMA_SPLIT_MODE_ROW = 2
LLAMA_POOLING_TYPE_UNSPECIFIED = -1
LLAMA_POOLING_TYPE_NONE = 0
LLAMA_POOLING_TYPE_MEAN = 1
LLAMA_POOLING_TYPE_CLS = 2
LLAMA_POOLING_TYPE_LAST = 3
LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED = -1
LLAMA_ATTENTION_TYPE_UNSPECIFIED = -1

_SPLIT_MODES = {
    LLAMA_SPLIT_MODE_NONE: "none",
    LLAMA_SPLIT_MODE_LAYER: "layer",
    LLAMA_SPLIT_MODE_ROW: "row",
}

# Keywords that only tune llama.cpp's own scheduling: accepted, and they change nothing here.
_NO_EFFECT = {
    "n_ubatch": 512,
    "n_threads_batch": None,
    "flash_attn": False,
    "op_offload": None,
    "swa_full": None,
    "no_perf": False,
    "offload_kqv": True,
}

# Keywords for features weightlift does not have, with their do-nothing values.
_REFUSED = {
    "kv_overrides": (None, "metadata overrides are not built; edit the GGUF with gguf-py"),
    "rope_scaling_type": (LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED, "RoPE comes from the model"),
    "attention_type": (LLAMA_ATTENTION_TYPE_UNSPECIFIED, "attention is causal"),
    "rope_freq_base": (0.0, "RoPE comes from the model's metadata"),
    "rope_freq_scale": (0.0, "RoPE comes from the model's metadata"),
    "yarn_ext_factor": (-1.0, "YaRN comes from the model's metadata"),
    "yarn_attn_factor": (1.0, "YaRN comes from the model's metadata"),
    "yarn_beta_fast": (32.0, "YaRN comes from the model's metadata"),
    "yarn_beta_slow": (1.0, "YaRN comes from the model's metadata"),
    "yarn_orig_ctx": (0, "YaRN comes from the model's metadata"),
    "lora_base": (None, "LoRA adapters are not built; merge the adapter first"),
    "lora_path": (None, "LoRA adapters are not built; merge the adapter first"),
    "lora_scale": (1.0, "LoRA adapters are not built; merge the adapter first"),
    "numa": (False, "NUMA placement is not built"),
    "chat_handler": (None, "chat handlers are not built; the model's chat template is used"),
    "draft_model": (None, "speculative decoding is not built"),
    "tokenizer": (None, "the model's own tokenizer is used"),
    "last_n_tokens_size": (64, "the penalties look at the last 64 tokens"),
}


# llama-cpp-python names a GGUF's chat template after a built-in format when the template is,
# character for character, one of four it knows (its `guess_chat_format_from_gguf_metadata`):
# the sha256 of each such template, and the name. `tests/gen_llama_metadata.py` records what
# llama-cpp-python guesses for each, and the tests check this table against it.
_KNOWN_TEMPLATES = {
    "153280e3ff55d19da1398bdb3914ee2a51b80429bfaedde11d7d216c39db80f3": "chatml",
    "7e995b379ec01747807246483647cd99030abf331653f1119e16d7ac041a3495": "mistral-instruct",
    "26a59556925c987317ce5291811ba3b7f32ec4c647c400c6cc7e3a9993007ba7": "mistral-instruct",
    "ba03a121d097859c7b5b9cd03af99aafe95275210d2876f642ad9929a150f122": "llama-3",
}
# the engine's own name for the GGUF key, so the two cannot drift apart
_TEMPLATE_KEY = _native._CHAT_TEMPLATE_KEY


def _metadata_strings(scalars: Mapping[str, Any]) -> dict[str, str]:
    """A GGUF's metadata as llama.cpp lists it to ``llama_model_meta_val_str`` (and
    llama-cpp-python's ``Llama.metadata``) from its keys but the arrays: each value as a
    string, numbers as C++'s ``std::to_string`` writes them (floats with six decimals),
    booleans as ``true``/``false``."""
    out = {}
    for key, value in scalars.items():
        if isinstance(value, bool):
            out[key] = "true" if value else "false"
        elif isinstance(value, float):
            out[key] = f"{value:f}"
        else:
            out[key] = str(value)
    return out


def _chat_format_of(metadata: Mapping[str, str]) -> str:
    """The ``chat_format`` llama-cpp-python picks for a GGUF when none is given: a built-in
    format whose template the GGUF's is exactly, else the GGUF's own (``chat_template.default``),
    else ``llama-2``."""
    template = metadata.get(_TEMPLATE_KEY)
    if template is None:
        return "llama-2"
    digest = hashlib.sha256(template.encode("utf-8")).hexdigest()
    return _KNOWN_TEMPLATES.get(digest, "chat_template.default")


def llama_chat_format(ckpt: Checkpoint) -> str | None:
    """The ``chat_format`` llama-cpp-python's ``Llama`` (and so its server) takes for ``ckpt``
    when none is given: ``_chat_format_of`` its metadata for a GGUF; None (the checkpoint's own
    template, or none) for safetensors, which llama-cpp-python does not open."""
    if ckpt.format != "gguf":
        return None
    return _chat_format_of(_metadata_strings(ckpt._scalar_metadata()))


def _refuse(name: str, why: str) -> UnsupportedError:
    return UnsupportedError(f"Llama({name}=...) is not supported: {why}")


class LlamaState:
    """What ``Llama.save_state`` returns: the tokens held, the last logits, the seed, and the
    cache's keys and values as bytes (``llama_state``), picklable as llama-cpp-python's."""

    def __init__(
        self,
        input_ids: npt.NDArray[np.intc],
        scores: npt.NDArray[np.single],
        n_tokens: int,
        llama_state: bytes,
        llama_state_size: int,
        seed: int,
    ) -> None:
        self.input_ids = input_ids
        self.scores = scores
        self.n_tokens = n_tokens
        self.llama_state = llama_state
        self.llama_state_size = llama_state_size
        self.seed = seed


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _longest_prefix_key(
    keys: Iterable[tuple[int, ...]], key: tuple[int, ...]
) -> tuple[int, ...] | None:
    """The stored key sharing the longest non-empty prefix with ``key`` (the first of equals)."""
    best, best_len = None, 0
    for k in keys:
        n = _common_prefix(k, key)
        if n > best_len:
            best, best_len = k, n
    return best


class LlamaRAMCache:
    """llama-cpp-python's prompt cache in RAM: states saved after completions, keyed by their
    token ids; a lookup returns the state whose ids share the longest prefix with the key, and
    the least recently used states go once their bytes pass ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int = 2 << 30) -> None:
        self.capacity_bytes = capacity_bytes
        self.cache_state: OrderedDict[tuple[int, ...], LlamaState] = OrderedDict()

    @property
    def cache_size(self) -> int:
        return sum(s.llama_state_size for s in self.cache_state.values())

    def _find_longest_prefix_key(self, key: tuple[int, ...]) -> tuple[int, ...] | None:
        return _longest_prefix_key(self.cache_state, key)

    def __getitem__(self, key: Sequence[int]) -> LlamaState:
        found = self._find_longest_prefix_key(tuple(key))
        if found is None:
            raise KeyError("Key not found")
        self.cache_state.move_to_end(found)
        return self.cache_state[found]

    def __contains__(self, key: Sequence[int]) -> bool:
        return self._find_longest_prefix_key(tuple(key)) is not None

    def __setitem__(self, key: Sequence[int], value: LlamaState) -> None:
        key = tuple(key)
        self.cache_state.pop(key, None)
        self.cache_state[key] = value
        while self.cache_size > self.capacity_bytes and self.cache_state:
            self.cache_state.popitem(last=False)


LlamaCache = LlamaRAMCache


class LlamaDiskCache:
    """llama-cpp-python's prompt cache on disk: the states of :class:`LlamaRAMCache`, pickled
    into a ``diskcache`` store under ``cache_dir``, so they outlive the process. A lookup
    returns the state whose ids share the longest prefix with the key (and keeps it, where
    llama-cpp-python's removes it); the oldest states go once the store passes
    ``capacity_bytes``. Needs the ``diskcache`` package (``pip install weightlift[disk-cache]``).
    """

    def __init__(
        self, cache_dir: str = ".cache/llama_cache", capacity_bytes: int = 2 << 30
    ) -> None:
        try:
            import diskcache
        except ImportError:
            raise ImportError(
                "LlamaDiskCache needs the diskcache package, which is not installed; run "
                "`pip install weightlift[disk-cache]`, or use LlamaRAMCache"
            ) from None
        self.capacity_bytes = capacity_bytes
        self.cache = diskcache.Cache(cache_dir)

    @property
    def cache_size(self) -> int:
        return int(self.cache.volume())

    def _find_longest_prefix_key(self, key: tuple[int, ...]) -> tuple[int, ...] | None:
        return _longest_prefix_key(self.cache.iterkeys(), key)

    def __getitem__(self, key: Sequence[int]) -> LlamaState:
        found = self._find_longest_prefix_key(tuple(key))
        if found is None:
            raise KeyError("Key not found")
        state: LlamaState = self.cache[found]
        return state

    def __contains__(self, key: Sequence[int]) -> bool:
        return self._find_longest_prefix_key(tuple(key)) is not None

    def __setitem__(self, key: Sequence[int], value: LlamaState) -> None:
        key = tuple(key)
        self.cache.pop(key, None)
        self.cache[key] = value
        # diskcache iterates in insertion order: the oldest state goes first
        while self.cache_size > self.capacity_bytes and len(self.cache) > 0:
            del self.cache[next(iter(self.cache))]


class LogitsProcessorList(list):  # type: ignore[type-arg]
    """llama-cpp-python's list of logits processors, each ``(input_ids, scores) -> scores``,
    applied in order."""

    def __call__(
        self, input_ids: npt.NDArray[np.intc], scores: npt.NDArray[np.single]
    ) -> npt.NDArray[np.single]:
        for processor in self:
            scores = processor(input_ids, scores)
        return scores


class StoppingCriteriaList(list):  # type: ignore[type-arg]
    """llama-cpp-python's list of stopping criteria, each ``(input_ids, logits) -> bool``; any
    true one stops."""

    def __call__(self, input_ids: npt.NDArray[np.intc], logits: npt.NDArray[np.single]) -> bool:
        return any(criterion(input_ids, logits) for criterion in self)


def embedding_ids(model: Model, text: str) -> list[int]:
    """The token ids an embedding of ``text`` runs on: llama-cpp-python's
    ``tokenize(text.encode("utf-8"))``, BOS as the vocabulary asks and special tokens as text."""
    return model.tokenize(text, add_bos=None, special=False)


def embedding_response(vectors: Sequence[Any], n_tokens: int, model: str) -> dict[str, Any]:
    """OpenAI's embedding response, as llama-cpp-python's ``create_embedding`` builds it: one
    entry per input in order (a vector, or one per token without pooling), and ``n_tokens``
    (the inputs' tokens together) as both counts of ``usage``."""
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "embedding": e, "index": i} for i, e in enumerate(vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
    }


class Llama:
    """llama-cpp-python's ``Llama``: load ``model_path`` (a GGUF, or any checkpoint weightlift
    opens) and run completions, chats, embeddings and the low-level ``eval``/``sample`` loop."""

    def __init__(
        self,
        model_path: str,
        *,
        n_gpu_layers: int = 0,
        split_mode: int = LLAMA_SPLIT_MODE_LAYER,
        main_gpu: int = 0,
        tensor_split: Sequence[float] | None = None,
        vocab_only: bool = False,
        use_mmap: bool = True,
        use_mlock: bool = False,
        seed: int = LLAMA_DEFAULT_SEED,
        n_ctx: int = 512,
        n_batch: int = 512,
        n_threads: int | None = None,
        pooling_type: int = LLAMA_POOLING_TYPE_UNSPECIFIED,
        logits_all: bool = False,
        embedding: bool = False,
        chat_format: str | None = None,
        type_k: int | None = None,
        type_v: int | None = None,
        spm_infill: bool = False,
        verbose: bool = True,
        **kwargs: Any,
    ) -> None:
        # what __getstate__ gives back to __init__ (chat_format and seed as they are then)
        self._init_args = {k: v for k, v in locals().items() if k not in ("self", "kwargs")}
        self._init_args.update(kwargs)
        for name, value in kwargs.items():
            if name in _NO_EFFECT:
                continue
            if name in _REFUSED:
                default, why = _REFUSED[name]
                if value != default and not (default is None and not value):
                    raise _refuse(name, why)
                continue
            raise TypeError(f"Llama() got an unexpected keyword argument '{name}'")
        if split_mode not in _SPLIT_MODES:
            raise ValueError(
                f"Llama(split_mode={split_mode!r}): expected LLAMA_SPLIT_MODE_NONE (0), "
                "LLAMA_SPLIT_MODE_LAYER (1) or LLAMA_SPLIT_MODE_ROW (2)"
            )
        self.model_path = str(model_path)
        self.verbose = verbose
        self.n_batch = n_batch
        self._logits_all = logits_all
        self._embedding = embedding
        self._pooling_type = pooling_type
        self._seed = LLAMA_DEFAULT_SEED if seed is None else seed
        self.cache: LlamaRAMCache | LlamaDiskCache | None = None
        # The logits of the last `eval` (every position with logits_all, else the last one).
        self._scores: npt.NDArray[np.single] = np.zeros((0, 0), dtype=np.single)
        # One open: the spec for n_embd, and the source the model loads from.
        with open_checkpoint(self.model_path, vocab_only=vocab_only) as ckpt:
            spec = ckpt.spec
            self._n_embd = spec.hidden_size if spec is not None else 0
            # a vocabulary-only Llama holds no cache: its context is the one asked for
            trained = spec.context_length if spec is not None else 0
            self._vocab_ctx = (n_ctx or trained) if vocab_only else None
            is_gguf = ckpt.format == "gguf"
            scalars = ckpt._scalar_metadata() if is_gguf else {}
            self.metadata: dict[str, str] = _metadata_strings(scalars)
            if chat_format is None and is_gguf:
                chat_format = llama_chat_format(ckpt)
                if verbose:
                    print(f"weightlift: chat format {chat_format}", file=sys.stderr)
            self._model: Model = load_gguf(
                ckpt,
                verbose=verbose,
                chat_format=chat_format,
                spm_infill=spm_infill,
                n_gpu_layers=n_gpu_layers,
                split_mode=_SPLIT_MODES[split_mode],
                tensor_split=list(tensor_split) if tensor_split is not None else None,
                main_gpu=main_gpu,
                use_mmap=use_mmap,
                use_mlock=use_mlock,
                vocab_only=vocab_only,
                n_ctx=n_ctx,
                n_batch=n_batch,
                type_k=type_k,
                type_v=type_v,
                n_threads=n_threads,
                seed=None if self._seed == LLAMA_DEFAULT_SEED else self._seed,
            )
        if verbose:
            where = ", ".join(self._model.layer_devices[:1]) if not vocab_only else "-"
            ctx = self.n_ctx()
            print(
                f"weightlift: loaded {self.model_path} (n_ctx={ctx}, first layer on {where})",
                file=sys.stderr,
            )

    @classmethod
    def from_pretrained(
        cls,
        repo_id: str,
        filename: str,
        additional_files: Sequence[str] | None = None,
        local_dir: str | os.PathLike[str] | None = None,
        local_dir_use_symlinks: bool | str = "auto",
        cache_dir: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> Llama:
        """llama-cpp-python's: the file of Hugging Face Hub repository ``repo_id`` that
        ``filename`` (a name or a glob pattern such as ``"*q4_k_m.gguf"``) matches, and those
        ``additional_files`` match (a split GGUF's other shards), downloaded by the
        ``huggingface_hub`` package (``pip install huggingface-hub``) into its cache or
        ``local_dir``, then ``Llama(model_path=that file, **kwargs)``. A pattern that matches no
        file, or more than one, is refused with the repository's file list."""
        try:
            from huggingface_hub import HfFileSystem, hf_hub_download
            from huggingface_hub.utils import validate_repo_id
        except ImportError as e:
            raise ImportError(
                "Llama.from_pretrained needs the huggingface-hub package: "
                "pip install huggingface-hub"
            ) from e
        validate_repo_id(repo_id)
        listed = HfFileSystem().ls(repo_id, recursive=True)
        names = [f["name"] if isinstance(f, dict) else f for f in listed]
        files = [str(PurePosixPath(n).relative_to(repo_id)) for n in names]
        links = (
            {}
            if local_dir_use_symlinks == "auto"
            else {"local_dir_use_symlinks": local_dir_use_symlinks}
        )

        def download(pattern: str) -> str:
            found = [f for f in files if fnmatch.fnmatch(f, pattern)]
            if len(found) != 1:
                got = "none" if not found else f"{len(found)}: {json.dumps(found)}"
                raise ValueError(
                    f"Llama.from_pretrained: expected one file of {repo_id} to match "
                    f"{pattern!r}, got {got}; its files: {json.dumps(files)}"
                )
            path = PurePosixPath(found[0])
            folder = str(path.parent)
            return str(
                hf_hub_download(
                    repo_id=repo_id,
                    filename=path.name,
                    subfolder=None if folder == "." else folder,
                    local_dir=local_dir,
                    cache_dir=cache_dir,
                    **links,
                )
            )

        model_path = download(filename)
        for pattern in additional_files or ():
            download(pattern)
        # a split GGUF's first file opens the rest beside it
        return cls(model_path=model_path, **kwargs)

    # --- the model ---------------------------------------------------------------------------

    @property
    def model(self) -> Model:
        """The weightlift ``Model`` underneath."""
        return self._model

    @property
    def chat_format(self) -> str | None:
        """The chat format chats use, by llama-cpp-python's names: a built-in format's
        (``"chatml"``, ...), ``"chat_template.default"`` for the GGUF's own template or
        ``"chat_template.NAME"`` for another it names. Without ``chat_format=`` a GGUF gets
        llama-cpp-python's pick: the built-in format its template is exactly, else its own
        template, else ``"llama-2"``. It can be changed between calls (None: the model's own
        template), as llama-cpp-python's attribute can."""
        name = self._model.chat_format
        if name is None and _TEMPLATE_KEY in self.metadata:
            return "chat_template.default"
        return name

    @chat_format.setter
    def chat_format(self, name: str | None) -> None:
        self._model.chat_format = name

    def n_ctx(self) -> int:
        """The context: the cache's positions, or with ``vocab_only`` the ``n_ctx`` asked for
        (0: the trained context)."""
        return self._vocab_ctx if self._vocab_ctx is not None else self._model.n_ctx()

    def n_vocab(self) -> int:
        return self._model.n_vocab()

    def n_embd(self) -> int:
        return self._n_embd

    def pooling_type(self) -> int:
        """llama.cpp's ``pooling_type`` the embeddings take: ``pooling_type=``, or where that
        is unspecified the GGUF's ``{arch}.pooling_type``, else none (0)."""
        return self._model._pooling_type(self._pooling_type)

    def tokenizer(self) -> LlamaTokenizer:
        """llama-cpp-python's ``LlamaTokenizer`` over this model."""
        return LlamaTokenizer(self)

    def token_bos(self) -> int:
        return self._model.token_bos()

    def token_eos(self) -> int:
        return self._model.token_eos()

    def token_nl(self) -> int:
        ids = self._model.tokenize(b"\n", add_bos=False, special=False)
        return ids[-1] if ids else -1

    # --- text --------------------------------------------------------------------------------

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        """Token ids of UTF-8 ``text``. As llama.cpp, ``add_bos=True`` adds BOS only when the
        vocabulary asks for one; ``special=True`` parses special tokens such as ``</s>``."""
        return self._model.tokenize(text, add_bos=None if add_bos else False, special=special)

    def detokenize(
        self,
        tokens: Sequence[int],
        prev_tokens: Sequence[int] | None = None,
        special: bool = False,
    ) -> bytes:
        """The bytes of ``tokens``; with ``prev_tokens``, only the bytes ``tokens`` add after
        them."""
        if prev_tokens is None:
            return self._model.detokenize_bytes(list(tokens), special)
        prev = list(prev_tokens)
        whole = self._model.detokenize_bytes(prev + list(tokens), special)
        return whole[len(self._model.detokenize_bytes(prev, special)) :]

    # --- completions -------------------------------------------------------------------------

    def _next_seed(self, seed: int | None) -> int:
        # llama-cpp-python's rule: a given seed is used and kept; otherwise the next seed is
        # drawn from the last, so calls differ but a run is reproducible from its first seed.
        self._seed = seed if seed is not None else random.Random(self._seed).randint(0, 2**32)
        return self._seed

    def create_completion(self, prompt: str | bytes | Sequence[int], **kwargs: Any) -> Any:
        """``Model.create_completion`` with llama-cpp-python's seed rule, and its prompt cache
        when ``set_cache`` gave one: a cached state that holds more of the prompt than the model
        does is loaded first, and the state after the completion is saved."""
        kwargs["seed"] = self._next_seed(kwargs.get("seed"))
        if self.cache is None:
            return self._model.create_completion(prompt, **kwargs)
        if isinstance(prompt, str | bytes):
            text = prompt.encode() if isinstance(prompt, str) else prompt
            ids = self.tokenize(text, add_bos=True, special=True) if text else []
        else:
            ids = list(prompt)
        try:
            item = self.cache[ids]
            held = _common_prefix(self.input_ids.tolist(), ids)
            if _common_prefix(item.input_ids.tolist(), ids) > held:
                self.load_state(item)
        except KeyError:
            pass
        out = self._model.create_completion(prompt, **kwargs)
        if kwargs.get("stream"):
            return self._saved_after(out)
        self._save_to_cache()
        return out

    def _save_to_cache(self) -> None:
        if self.cache is not None:
            self.cache[self.input_ids.tolist()] = self.save_state()

    def _saved_after(self, chunks: Iterator[Any]) -> Iterator[Any]:
        yield from chunks
        self._save_to_cache()

    def set_cache(self, cache: LlamaRAMCache | LlamaDiskCache | None) -> None:
        """Use ``cache`` (a ``LlamaRAMCache`` or ``LlamaDiskCache``, or anything with their
        mapping methods) as the prompt cache of ``create_completion``; None stops."""
        self.cache = cache

    def __call__(self, prompt: str | bytes | Sequence[int], *args: Any, **kwargs: Any) -> Any:
        names = ("suffix", "max_tokens", "temperature", "top_p", "min_p", "typical_p")
        if len(args) > len(names):
            raise TypeError(f"Llama.__call__ takes at most {len(names) + 1} positional arguments")
        kwargs.update(zip(names, args, strict=False))
        return self.create_completion(prompt, **kwargs)

    def create_chat_completion(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> Any:
        kwargs["seed"] = self._next_seed(kwargs.get("seed"))
        return self._model.create_chat_completion(messages, **kwargs)

    def create_chat_completion_openai_v1(self, *args: Any, **kwargs: Any) -> Any:
        """``create_chat_completion`` as the ``openai`` package's types: a ``ChatCompletion``,
        or with ``stream=True`` an iterator of ``ChatCompletionChunk``."""
        try:
            from openai.types.chat import ChatCompletion, ChatCompletionChunk
        except ImportError as e:
            raise ImportError(
                "create_chat_completion_openai_v1 needs the openai package: pip install openai"
            ) from e
        if kwargs.get("stream", False):
            chunks = self.create_chat_completion(*args, **kwargs)
            return (ChatCompletionChunk(**chunk) for chunk in chunks)
        return ChatCompletion(**self.create_chat_completion(*args, **kwargs))

    def set_seed(self, seed: int) -> None:
        self._seed = seed

    # --- the low-level loop ------------------------------------------------------------------

    @property
    def n_tokens(self) -> int:
        """Tokens the model's cache holds."""
        cache = self._model.cache
        return cache.seq_len if cache is not None else 0

    @property
    def input_ids(self) -> npt.NDArray[np.intc]:
        """The ids of the tokens held."""
        cache = self._model.cache
        return np.asarray(cache.tokens if cache is not None else [], dtype=np.intc)

    @property
    def scores(self) -> npt.NDArray[np.single]:
        """The logits of the last ``eval`` (every position with ``logits_all``)."""
        return self._scores

    @property
    def eval_tokens(self) -> deque[int]:
        """The ids of the tokens held, in a deque of at most ``n_ctx()``."""
        return deque(self.input_ids.tolist(), maxlen=self.n_ctx())

    @property
    def eval_logits(self) -> deque[list[float]]:
        """The rows of ``scores`` in a deque: the last row, or with ``logits_all`` each row of
        the last ``eval`` (llama-cpp-python keeps the rows of every ``eval`` since a reset)."""
        rows = self._scores.tolist()
        return deque(rows, maxlen=self.n_ctx() if self._logits_all else 1)

    @staticmethod
    def logits_to_logprobs(logits: npt.ArrayLike, axis: int = -1) -> npt.NDArray[np.single]:
        """The log-softmax of ``logits`` along ``axis``, in float32 (``-inf`` logits give
        ``-inf``; a row of only ``-inf`` gives NaN, as llama-cpp-python's)."""
        x = np.asarray(logits, dtype=np.single)
        top = np.amax(x, axis=axis, keepdims=True)
        top[~np.isfinite(top)] = 0
        shifted = x - top
        with np.errstate(divide="ignore"):
            return shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))

    @staticmethod
    def longest_token_prefix(a: Sequence[int], b: Sequence[int]) -> int:
        """How many leading ids ``a`` and ``b`` share."""
        return _common_prefix(a, b)

    def reset(self) -> None:
        """Forget every token held."""
        cache = self._model.cache
        if cache is not None:
            cache.reset()
        self._scores = np.zeros((0, 0), dtype=np.single)

    def eval(self, tokens: Sequence[int]) -> None:
        """Run ``tokens`` after those held, keeping their logits for ``sample``."""
        tokens = list(tokens)
        if not tokens:
            return
        logits = self._model.forward(
            tokens, cache=self._model.cache, logits="all" if self._logits_all else "last"
        )
        self._scores = logits

    def sample(
        self,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        typical_p: float = 1.0,
        temp: float = 0.80,
        repeat_penalty: float = 1.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        tfs_z: float = 1.0,
        mirostat_mode: int = 0,
        mirostat_eta: float = 0.1,
        mirostat_tau: float = 5.0,
        penalize_nl: bool = True,
        logits_processor: Any = None,
        grammar: Any = None,
        idx: int | None = None,
    ) -> int:
        """A token from the logits of position ``idx`` (the last evaluated by default)."""
        if tfs_z != 1.0:
            raise UnsupportedError(
                "Llama.sample(tfs_z=...) is not supported: llama.cpp removed tail-free "
                "sampling; use 1.0"
            )
        if len(self._scores) == 0:
            raise ValueError("Llama.sample: nothing evaluated yet; call eval(tokens) first")
        n = self.n_tokens
        if idx is None:
            row = self._scores[-1]
        else:
            first = n - len(self._scores)
            if not first <= idx < n:
                raise ValueError(
                    f"Llama.sample(idx={idx}): expected a position with logits, "
                    f"{first}..{n - 1} (pass logits_all=True to keep every position's)"
                )
            row = self._scores[idx - first]
        row = np.array(row, dtype=np.single)
        history = list(self.input_ids[: idx + 1] if idx is not None else self.input_ids)
        if logits_processor is not None:
            row = np.asarray(
                logits_processor(np.asarray(history, dtype=np.intc), row), dtype=np.single
            )
        if grammar is not None:
            # As llama-cpp-python's sample(): a sampler made for this call, so the grammar
            # starts from its root (generate and create_completion keep its state instead).
            row = self.model.grammar_mask(grammar, row)
        return sample(
            row,
            history,
            temperature=temp,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            typical_p=typical_p,
            repeat_penalty=repeat_penalty,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            mirostat_mode=mirostat_mode,
            mirostat_tau=mirostat_tau,
            mirostat_eta=mirostat_eta,
            seed=self._next_seed(None),
        )

    def generate(
        self,
        tokens: Sequence[int],
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        typical_p: float = 1.0,
        temp: float = 0.80,
        repeat_penalty: float = 1.0,
        reset: bool = True,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        tfs_z: float = 1.0,
        mirostat_mode: int = 0,
        mirostat_tau: float = 5.0,
        mirostat_eta: float = 0.1,
        penalize_nl: bool = True,
        logits_processor: Any = None,
        stopping_criteria: Any = None,
        grammar: Any = None,
    ) -> Generator[int, Sequence[int] | None, None]:
        """Tokens after ``tokens``, one per ``next()``, without end (the caller stops). With
        ``reset`` the longest prefix of ``tokens`` already held is reused."""
        tokens = list(tokens)
        if reset:
            # At least one token runs, so there are logits to sample.
            common = _common_prefix(self.input_ids.tolist(), tokens)
            common = min(common, len(tokens) - 1) if tokens else 0
            common = self._rewind(common)
            tokens = tokens[common:]
        while True:
            self.eval(tokens)
            token = self.sample(
                top_k=top_k,
                top_p=top_p,
                min_p=min_p,
                typical_p=typical_p,
                temp=temp,
                repeat_penalty=repeat_penalty,
                frequency_penalty=frequency_penalty,
                presence_penalty=presence_penalty,
                tfs_z=tfs_z,
                mirostat_mode=mirostat_mode,
                mirostat_tau=mirostat_tau,
                mirostat_eta=mirostat_eta,
                logits_processor=logits_processor,
                grammar=grammar,
            )
            if stopping_criteria is not None and stopping_criteria(
                self.input_ids, self._scores[-1]
            ):
                return
            more = yield token
            tokens = [token, *(more or [])]

    def _rewind(self, n: int) -> int:
        """Keep the first ``n`` tokens held and drop the rest; the tokens kept. A sliding-window
        layer's cache keeps only its last rows: where they no longer hold the window the next
        token attends to, nothing is kept and the tokens run again from position 0."""
        cache = self._model.cache
        if cache is None:
            return n
        if not cache._held_under(self._model):
            # rows of another compute mode: what the current one computes differs
            cache.reset()
            return 0
        n = min(n, cache.seq_len)
        try:
            cache.truncate(n)
        except PlanError:
            cache.reset()
            return 0
        return n

    # --- state -------------------------------------------------------------------------------

    def save_state(self) -> LlamaState:
        """The tokens held with their keys and values, the last logits and the seed."""
        cache = self._model.cache
        blob = cache.save_state() if cache is not None else b""
        return LlamaState(
            input_ids=self.input_ids.copy(),
            scores=self._scores.copy(),
            n_tokens=self.n_tokens,
            llama_state=blob,
            llama_state_size=len(blob),
            seed=self._seed,
        )

    def load_state(self, state: LlamaState) -> None:
        """Hold exactly what ``state`` held."""
        if not isinstance(state, LlamaState):
            raise TypeError(
                "Llama.load_state: expected the LlamaState that save_state returned, "
                f"got {type(state).__name__}"
            )
        cache = self._model.cache
        if cache is None:
            raise ValueError("Llama.load_state: this Llama was made with vocab_only=True")
        cache.load_state(state.llama_state)
        self._scores = state.scores.copy()
        self._seed = state.seed

    # --- embeddings --------------------------------------------------------------------------

    def embed(
        self,
        input: str | list[str],
        normalize: bool = False,
        truncate: bool = True,
        return_count: bool = False,
    ) -> Any:
        """Embeddings of ``input`` (a string, or a list of them): with the model's pooling (or
        ``pooling_type``) one vector per input, with no pooling one vector per token."""
        if not self._embedding:
            raise RuntimeError(
                "Llama model must be created with embedding=True to call this method"
            )
        inputs = [input] if isinstance(input, str) else list(input)
        data: list[Any] = []
        total = 0
        for text in inputs:
            ids = embedding_ids(self._model, text)
            if truncate:
                ids = ids[: self.n_batch]
            elif len(ids) > self.n_batch:
                raise ValueError(
                    f"Requested tokens ({len(ids)}) exceed batch size of {self.n_batch}"
                )
            total += len(ids)
            data.append(self._model.embed(ids, pooling=self._pooling_type, normalize=normalize))
        output = data[0] if isinstance(input, str) else data
        return (output, total) if return_count else output

    def create_embedding(self, input: str | list[str], model: str | None = None) -> Any:
        """OpenAI's embedding response for ``input``."""
        embeds, total = self.embed(input, return_count=True)
        if isinstance(input, str):
            embeds = [embeds]
        return embedding_response(embeds, total, model if model is not None else self.model_path)

    # --- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Free the model and its cache; later calls raise ``ClosedError``."""
        self._model.close()

    def __del__(self) -> None:
        """As llama-cpp-python's: ``close()`` (code that frees a model with ``llm.__del__()``
        frees it here too); a ``Llama`` whose construction failed has nothing to free."""
        model = self.__dict__.get("_model")
        if model is not None:
            model.close()

    def __enter__(self) -> Llama:
        return self

    def __exit__(self, *_args: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        """The constructor's arguments, with the seed and chat format in use: as
        llama-cpp-python's, a pickled ``Llama`` loads its model again when unpickled, with an
        empty cache (``save_state`` keeps the cache's rows)."""
        return {**self._init_args, "seed": self._seed, "chat_format": self.chat_format}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]


class LlamaTokenizer:
    """llama-cpp-python's ``LlamaTokenizer`` (``Llama.tokenizer()``): its ``tokenize`` parses
    special tokens by default, where ``Llama.tokenize`` does not."""

    def __init__(self, llama: Llama) -> None:
        self._llama = llama

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = True) -> list[int]:
        return self._llama.tokenize(text, add_bos=add_bos, special=special)

    def detokenize(
        self,
        tokens: Sequence[int],
        prev_tokens: Sequence[int] | None = None,
        special: bool = False,
    ) -> bytes:
        """The bytes of ``tokens``; as llama-cpp-python's, ``prev_tokens`` changes nothing."""
        return self._llama.detokenize(tokens, special=special)

    def encode(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]:
        return self.tokenize(text.encode("utf-8", errors="ignore"), add_bos, special)

    def decode(self, tokens: Sequence[int]) -> str:
        """The text of ``tokens``, bytes that are not UTF-8 dropped."""
        return self.detokenize(tokens).decode("utf-8", errors="ignore")

    @classmethod
    def from_ggml_file(cls, path: str) -> LlamaTokenizer:
        """The tokenizer of a GGUF, opened without its weights."""
        return cls(Llama(model_path=path, vocab_only=True))
