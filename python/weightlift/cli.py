"""The ``weightlift`` command: ``devices``, ``inspect``, ``plan``, ``fit``, ``load``, ``run`` and
``serve``.

Every subcommand prints a readable table by default and one JSON object with ``--json``. A bad
file or a request that cannot be met prints one line, ``weightlift: error: <message>``, on
stderr and exits 2; there is never a traceback for those. Ctrl-C exits 130 with one line (a load
frees everything it allocated first).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import weightlift
from weightlift._llama import llama_chat_format
from weightlift.server import GRACEFUL_SECONDS

EXIT_ERROR = 2


def _human(n: float) -> str:
    """Bytes in binary units, e.g. ``98.2 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _count(n: int) -> str:
    """A parameter count in words, e.g. ``134.5 M``."""
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return str(n)


def _summary(ckpt: weightlift.Checkpoint, with_tensors: bool) -> dict[str, Any]:
    """Everything ``inspect`` reports, as plain data."""
    tensors = ckpt.tensors
    types: dict[str, dict[str, int]] = {}
    layers: dict[int, int] = {}
    outside = 0
    for t in tensors:
        row = types.setdefault(t.dtype, {"count": 0, "bytes": 0})
        row["count"] += 1
        row["bytes"] += t.nbytes
        if t.layer is None:
            outside += t.nbytes
        else:
            layers[t.layer] = layers.get(t.layer, 0) + t.nbytes
    spec = ckpt.spec
    out: dict[str, Any] = {
        "path": ckpt.path,
        "format": ckpt.format,
        "files": ckpt.files,
        "architecture": spec.architecture if spec else None,
        "spec": spec.to_dict() if spec else None,
        "spec_error": ckpt.spec_error,
        "n_tensors": len(tensors),
        "n_params": ckpt.n_params,
        "nbytes": ckpt.nbytes,
        "types": dict(sorted(types.items(), key=lambda kv: -kv[1]["bytes"])),
        "layer_bytes": [layers[i] for i in sorted(layers)],
        "non_layer_bytes": outside,
        "tokenizer": ckpt.tokenizer,
        "warnings": list(ckpt.warnings),
    }
    # What the layers do beyond the spec; a corrupted key is a warning here (loading refuses it)
    for key in ("experts", "sliding_window", "rope_scaling"):
        try:
            out[key] = getattr(ckpt, key)
        except weightlift.WeightliftError as e:
            out[key] = None
            out["warnings"].append(f"{key.replace('_', ' ')}: {e}")
    if with_tensors:
        out["tensors"] = [
            {
                "name": t.name,
                "dtype": t.dtype,
                "shape": list(t.shape),
                "nbytes": t.nbytes,
                "file": t.file,
                "offset": t.offset,
                "layer": t.layer,
                "role": t.role,
            }
            for t in tensors
        ]
    return out


def _layer_runs(sizes: list[int]) -> list[tuple[int, int, int]]:
    """Consecutive layers with equal byte counts, as (first, last, bytes)."""
    runs: list[tuple[int, int, int]] = []
    for i, size in enumerate(sizes):
        if runs and runs[-1][2] == size and runs[-1][1] == i - 1:
            runs[-1] = (runs[-1][0], i, size)
        else:
            runs.append((i, i, size))
    return runs


def _ranges(items: list[int]) -> str:
    """Ascending integers as runs, e.g. ``0-4, 6-10``."""
    runs: list[list[int]] = []
    for i in items:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def _layer_lines(s: dict[str, Any]) -> list[str]:
    """``inspect``'s lines for the experts, the sliding window and the RoPE scaling."""
    lines = []
    moe = s.get("experts")
    if moe:
        dense = moe.get("dense_layers") or []
        lines.append(
            f"experts       {moe['n_experts']} a layer, {moe['n_used']} a token, "
            f"ffn {moe['expert_ffn']}, chosen weights "
            f"{'renormalised' if moe['norm_topk_prob'] else 'as scored'}"
            + (f", dense layers {_ranges(dense)}" if dense else "")
        )
    window = s.get("sliding_window")
    if window:
        n_layers = s["spec"]["n_layers"] if s.get("spec") else len(window["layers"])
        lines.append(
            f"attention     a window of {window['window']} tokens on layers "
            f"{_ranges(window['layers'])} ({len(window['layers'])} of {n_layers}), "
            "the others over everything"
        )
    rope = s.get("rope_scaling")
    if rope:
        parts = [rope["kind"]]
        if rope["factor"] is not None:
            parts.append(f"×{rope['factor']:g}")
        if rope["original_context"] is not None:
            parts.append(f"from {rope['original_context']:g} positions")
        if rope["layers"] == "full_attention":
            parts.append("on the full-attention layers")
        lines.append(f"rope scaling  {' '.join(parts)} ({rope['from']})")
    return lines


def _print_inspect(s: dict[str, Any], with_tensors: bool) -> None:
    w = sys.stdout.write
    w(f"path          {s['path']}\n")
    n_files = len(s["files"])
    w(f"format        {s['format']} ({n_files} file{'s' if n_files != 1 else ''})\n")
    spec = s["spec"]
    if spec:
        kv = sorted(set(spec["n_kv_heads"]))
        kv_text = "/".join(str(k) for k in kv)
        w(
            f"architecture  {spec['architecture']}: {spec['n_layers']} layers, "
            f"hidden {spec['hidden_size']}, ffn {spec['intermediate_size']}, "
            f"heads {spec['n_heads']} (kv {kv_text}, head_dim {spec['head_dim']}), "
            f"vocab {spec['vocab_size']}, context {spec['context_length']}"
            f"{', tied embeddings' if spec['tie_word_embeddings'] else ''}\n"
        )
    else:
        w(f"architecture  unknown ({s['spec_error']})\n")
    for line in _layer_lines(s):
        w(line + "\n")
    w(f"parameters    {_count(s['n_params'])} ({s['n_params']:,})\n")
    w(f"bytes         {_human(s['nbytes'])} ({s['nbytes']:,}) in {s['n_tensors']} tensors\n")
    check = s.get("check")
    if check:
        w(
            f"check         NaN/Inf scan of {check['tensors']} tensors ({_human(check['bytes'])}) "
            f"in {check['seconds']:.2f} s: every float value and quantisation scale is finite\n"
        )
    w("types\n")
    for name, row in s["types"].items():
        w(f"  {name:<8} {row['count']:>6} tensors  {_human(row['bytes']):>11}\n")
    sizes = s["layer_bytes"]
    if sizes:
        w(f"layers        {len(sizes)} blocks\n")
        for first, last, size in _layer_runs(sizes):
            label = f"{first}" if first == last else f"{first}-{last}"
            each = " each" if first != last else ""
            w(f"  blk {label:<9} {_human(size):>11}{each}\n")
        w(f"  outside      {_human(s['non_layer_bytes']):>11}\n")
    tok = s["tokenizer"]
    parts = [tok["model"] or "unknown"]
    if tok["pre"]:
        parts.append(f"pre {tok['pre']}")
    if tok["n_tokens"] is not None:
        parts.append(f"{tok['n_tokens']} tokens")
    if tok["n_merges"] is not None:
        parts.append(f"{tok['n_merges']} merges")
    if tok["bos_token_id"] is not None:
        parts.append(f"bos {tok['bos_token_id']}")
    if tok["eos_token_id"] is not None:
        parts.append(f"eos {tok['eos_token_id']}")
    if tok["has_tokenizer_json"]:
        parts.append("tokenizer.json present")
    w(f"tokenizer     {', '.join(parts)}\n")
    for warning in s["warnings"]:
        w(f"warning       {warning}\n")
    if with_tensors:
        w("tensors\n")
        for t in s["tensors"]:
            shape = "x".join(str(d) for d in t["shape"])
            w(f"  {t['name']:<40} {t['dtype']:<8} {shape:<16} {t['nbytes']:>12,}\n")


def _cmd_inspect(args: argparse.Namespace) -> int:
    import time

    start = time.perf_counter()
    # A non-finite value makes open() raise a FormatError naming the tensor and the index.
    with weightlift.open(args.path, check_tensors=args.check_tensors) as ckpt:
        seconds = time.perf_counter() - start
        summary = _summary(ckpt, args.tensors)
    if args.check_tensors:
        summary["check"] = {
            "tensors": summary["n_tensors"],
            "bytes": summary["nbytes"],
            "seconds": seconds,
            "non_finite": 0,
        }
    if args.json:
        json.dump(summary, sys.stdout)
        sys.stdout.write("\n")
    else:
        _print_inspect(summary, args.tensors)
    return 0


DEFAULT_CTX = 4096  # cache length when --cache is given without --ctx


def _sizes(text: str | None) -> list[str] | dict[str, str] | None:
    """``--reserve 256MiB,64MiB`` (device order) or ``--reserve cuda:0=1GiB,cpu=4GiB``."""
    if text is None:
        return None
    items = [t.strip() for t in text.split(",") if t.strip()]
    if items and all("=" in t for t in items):
        return dict(t.split("=", 1) for t in items)  # type: ignore[misc]
    if any("=" in t for t in items):
        raise weightlift.PlanError(
            f"invalid size list '{text}': expected SIZE,SIZE,... or DEVICE=SIZE,..., not a mix"
        )
    return items


def _cache_spec(args: argparse.Namespace, *, default: bool = False) -> Any:
    """The KV cache the flags ask for (``default``: one even when no cache flag is given)."""
    if not (
        default
        or args.ctx is not None
        or args.cache is not None
        or args.batch is not None
        or args.cache_offload
    ):
        return None
    # What is not given keeps CacheSpec's own default (batch 1, fp16).
    kw: dict[str, Any] = {"offload": args.cache_offload}
    if args.batch is not None:
        kw["batch_size"] = args.batch
    if args.cache:
        kw["dtype"] = args.cache
    return weightlift.CacheSpec(args.ctx if args.ctx is not None else DEFAULT_CTX, **kw)


def _runtime(args: argparse.Namespace) -> Any:
    if args.max_input_len is None and not args.low_mem:
        return None
    # What is not given keeps RuntimeSpec's own default (exllamav2's).
    kw: dict[str, Any] = {"low_mem": args.low_mem}
    if args.max_input_len:
        kw["max_input_len"] = args.max_input_len
    return weightlift.RuntimeSpec(**kw)


def _placement(args: argparse.Namespace) -> dict[str, Any]:
    """The placement flags, as the keywords ``plan``, ``fit`` and ``Model.load`` share: only
    what was given, so that the library infers the strategy the same way for all three."""
    kw: dict[str, Any] = {
        "strategy": args.strategy,
        "reserve": _sizes(args.reserve),
        "max_memory": _sizes(args.max_memory),
        "n_gpu_layers": args.n_gpu_layers,
        "split_mode": args.split_mode,
        "main_gpu": args.main_gpu,
        "overrides": args.override,
        "allow_disk": args.allow_disk,
        "n_cpu_moe": args.n_cpu_moe,
    }
    if args.tensor_split is not None:
        kw["tensor_split"] = [float(x) for x in args.tensor_split.split(",") if x.strip()]
    return {k: v for k, v in kw.items() if v is not None}


def _plan_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kw = {
        "devices": args.devices,
        "dtype": args.dtype,
        "cache": _cache_spec(args),
        "runtime": _runtime(args),
        "weight_dtype": args.weight_dtype,
        "quantize": args.quantize,
        **_placement(args),
    }
    if getattr(args, "world", None) is not None:
        kw["world"] = args.world
    return kw


def _rank(args: argparse.Namespace) -> int | None:
    """The rank a ``--world`` load takes: ``--rank``, else torchrun's ``RANK``, else None (one
    process over every device of ``--devices``)."""
    if args.rank is not None:
        return int(args.rank)
    raw = os.environ.get("RANK")
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise weightlift.PlanError(
            f"environment variable RANK: expected an integer (torchrun sets it), got {raw!r}"
        ) from None


def _cmd_plan(args: argparse.Namespace) -> int:
    p = weightlift.plan(args.path, **_plan_kwargs(args))
    if args.svg:
        p.save_svg(args.svg)
    if args.json:
        sys.stdout.write(p.to_json())
        sys.stdout.write("\n")
    else:
        sys.stdout.write(p.explain())
        if args.svg:
            sys.stdout.write(f"chart written to {args.svg}\n")
    return 0


def _cmd_fit(args: argparse.Namespace) -> int:
    kw = _plan_kwargs(args)
    value = weightlift.fit(args.path, target=args.target, **kw)
    if args.json:
        json.dump({"target": args.target, "value": value}, sys.stdout)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(f"{args.target} {value}\n")
    return 0


def _cmd_devices(args: argparse.Namespace) -> int:
    info = weightlift.cuda_info()
    devices = weightlift.devices()
    if args.json:
        info["plan"] = [
            {
                "name": d.name,
                "kind": d.kind,
                "capacity": d.capacity,
                "overhead": d.overhead,
                "overhead_parts": d.overhead_parts,
            }
            for d in devices
        ]
        json.dump(info, sys.stdout)
        sys.stdout.write("\n")
        return 0
    driver = info["driver"]
    if "error" in driver:
        sys.stdout.write(f"driver   none: {driver['error']}\n")
    else:
        sys.stdout.write(f"driver   {driver['path']} (CUDA {driver['cuda_version']})\n")
    for lib in ("nvrtc", "cublas"):
        found = info[lib]
        if "error" in found:
            sys.stdout.write(f"{lib:<8} none: {found['error']}\n")
        else:
            sys.stdout.write(f"{lib:<8} {found['path']} ({found['version']})\n")
    gpus = {g["name"]: g for g in info["devices"]}
    if not gpus:
        sys.stdout.write("no cuda devices\n")
    for d in devices:
        if d.capacity is None:
            line = f"{d.name:<8} unbounded"
        else:
            line = f"{d.name:<8} {_human(d.capacity)} available"
        g = gpus.get(d.name)
        if g is not None:
            context = "not measured" if g["context"] is None else _human(g["context"])
            line = (
                f"{d.name:<8} {g['model']}, {g['capability']}, {_human(g['free'])} free of "
                f"{_human(g['total'])}; one context takes {context}; the plan charges "
                f"{_human(d.overhead)} of overhead"
            )
        sys.stdout.write(line + "\n")
    return 0


class _ProgressBar:
    """The load's progress callback, drawing a tqdm bar (bytes, GB/s, ETA) on stderr.

    ``enabled=None`` draws it only when stderr is a terminal, as tqdm's ``disable=None`` does.
    """

    def __init__(self, enabled: bool | None) -> None:
        self.disable = None if enabled is None else not enabled
        self.bar: Any = None
        self.done = 0

    def __call__(self, bytes_done: int, bytes_total: int, tensor: str, device: str) -> bool:
        if self.bar is None:
            from tqdm import tqdm  # type: ignore[import-untyped]

            self.bar = tqdm(
                total=bytes_total,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc="loading",
                disable=self.disable,
                file=sys.stderr,
                dynamic_ncols=True,
            )
        self.bar.set_postfix_str(device, refresh=False)
        self.bar.update(bytes_done - self.done)
        self.done = bytes_done
        return True

    def close(self, ok: bool) -> None:
        """Leave the finished bar on screen; wipe an interrupted one before the error line."""
        if self.bar is not None:
            self.bar.leave = ok
            self.bar.close()
            self.bar = None


def _memory_rows(
    plan: weightlift.Plan, held: dict[str, int], rank: int | None = None
) -> dict[str, dict[str, int]]:
    """Per device: the plan's weights, kv and scratch, their sum, and what is actually held.
    A rank's process (``rank``) holds only its rank's stand-in, on its own accelerator, named
    by that one."""
    rows: dict[str, dict[str, int]] = {}
    devices = plan.devices
    if rank is not None:
        accel = [d for d in devices if d.kind in ("cuda", "virtual")]
        stand_in = accel[rank].name
        own = next((n for n in held if n.startswith(("cuda", "virtual"))), stand_in)
        held = {stand_in if n == own else n: v for n, v in held.items()}
        devices = [accel[rank], *(d for d in devices if d.kind not in ("cuda", "virtual"))]
    for d in devices:
        planned = d.weights + d.kv + d.scratch
        rows[d.name] = {
            "weights": d.weights,
            "kv": d.kv,
            "scratch": d.scratch,
            "planned": planned,
            "held": held.get(d.name, 0),
        }
    for name, n in held.items():
        if name not in rows:
            rows[name] = {"weights": 0, "kv": 0, "scratch": 0, "planned": 0, "held": n}
    return rows


def _diff(planned: int, held: int) -> str:
    if planned == 0:
        return "+0.00%" if held == 0 else "n/a"
    return f"{(held - planned) / planned * 100:+.2f}%"


def _print_memory(rows: dict[str, dict[str, int]]) -> None:
    w = sys.stdout.write
    mib = 1024 * 1024
    w("memory after load (MiB): planned = weights + kv + scratch from the plan, ")
    w("held = Model.memory()\n")
    cols = ("weights", "kv", "scratch", "planned", "held")
    w(f"{'device':<12}" + "".join(f"{c:>10}" for c in cols) + f"{'diff':>10}\n")
    total = dict.fromkeys(cols, 0)
    for name, row in rows.items():
        w(f"{name:<12}" + "".join(f"{row[c] / mib:>10.2f}" for c in cols))
        w(f"{_diff(row['planned'], row['held']):>10}\n")
        for c in cols:
            total[c] += row[c]
    w(f"{'total':<12}" + "".join(f"{total[c] / mib:>10.2f}" for c in cols))
    w(f"{_diff(total['planned'], total['held']):>10}\n")


def _load_model(
    args: argparse.Namespace,
    *,
    default_cache: bool = False,
    llama_chat: bool = False,
    **model_kw: Any,
) -> tuple[weightlift.Model, _ProgressBar, float]:
    """Load ``args.path`` with the placement flags shared by ``load`` and ``run``; returns the
    model, its progress bar (bytes read) and the seconds the load took. ``llama_chat``: without
    ``--chat-format``, chats take the format llama-cpp-python's ``Llama`` would pick."""
    import time

    devices = args.devices
    world = getattr(args, "world", None)
    if devices is None and world is not None and "LOCAL_RANK" in os.environ:
        # A rank started by torchrun drives the GPU its local rank names.
        devices = f"cuda:{os.environ['LOCAL_RANK']},cpu"
    ckpt = weightlift.open(args.path)
    model = weightlift.Model(
        ckpt,
        devices=devices,
        dtype=args.dtype,
        runtime=_runtime(args),
        quantize=args.quantize,
        **model_kw,
    )
    chat_format = getattr(args, "chat_format", None)
    if chat_format is None and llama_chat:
        # the server answers as llama-cpp-python's does, whose Llama picks a format by this rule
        # (a GGUF without a chat template chats in llama-2's)
        chat_format = llama_chat_format(ckpt)
        if chat_format is not None and not chat_format.startswith("chat_template."):
            sys.stderr.write(f"weightlift: chat format {chat_format} (--chat-format to change)\n")
    if chat_format is not None:  # an unknown name fails here, before the load
        model.chat_format = chat_format
    bar = _ProgressBar(args.progress)
    start = time.perf_counter()
    try:
        if world is not None:
            _load_world(args, model, bar)
        else:
            model.load(
                callback=bar,
                cache=_cache_spec(args, default=default_cache),
                use_mmap=not args.no_mmap,
                use_direct_io=args.direct_io,
                check_tensors=args.check_tensors,
                **_placement(args),
            )
    except BaseException:
        bar.close(ok=False)
        raise
    bar.close(ok=True)
    return model, bar, time.perf_counter() - start


def _load_world(args: argparse.Namespace, model: weightlift.Model, bar: _ProgressBar) -> None:
    """``--world``: exllamav2's ``load_tp`` over the run's ranks, this process holding only its
    rank's share when it has one (``--rank`` or ``RANK``)."""
    given = {k for k, v in _placement(args).items() if v not in (False, [])} - {"strategy"}
    if given or args.strategy not in (None, "tensor_parallel"):
        flags = ", ".join(sorted(given | ({"strategy"} if args.strategy else set())))
        raise weightlift.PlanError(
            f"--world: expected only the cache flags beside it (the split is tensor_parallel's), "
            f"got {flags}"
        )
    model.load_tp(
        expect_cache_tokens=args.ctx if args.ctx is not None else DEFAULT_CTX,
        expect_cache_base=args.cache,
        callback=bar,
        world=args.world,
        rank=_rank(args),
    )


def _cmd_load(args: argparse.Namespace) -> int:
    model, bar, seconds = _load_model(args)
    plan = model.plan
    if plan is None:
        raise weightlift.WeightliftError("the load finished without a plan")
    tp = model.tp
    rows = _memory_rows(plan, model.memory(), tp.rank if tp is not None else None)
    if args.json:
        doc = {
            "plan": json.loads(plan.to_json()),
            "memory": rows,
            "bytes": bar.done,
            "seconds": seconds,
            "warnings": model.warnings,
        }
        json.dump(doc, sys.stdout)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(plan.explain())
        sys.stdout.write("\n")
        _print_memory(rows)
        rate = bar.done / seconds / 1e9 if seconds > 0 else 0.0
        sys.stdout.write(f"loaded {_human(bar.done)} in {seconds:.2f} s ({rate:.2f} GB/s)\n")
        for warning in model.warnings:
            sys.stdout.write(f"warning: {warning}\n")
    model.unload()
    return 0


def _print_timings(load_seconds: float | None, t: dict[str, float] | None) -> None:
    """llama.cpp's closing lines: load, prompt eval and eval times with tokens per second."""
    w = sys.stderr.write
    w("\n")
    if load_seconds is not None:
        w(f"load time        = {load_seconds * 1e3:10.2f} ms\n")
    if t is None:
        return
    for name, tokens, ms, unit in (
        ("prompt eval time", t["prompt_tokens"], t["prompt_ms"], "tokens"),
        ("eval time       ", t["eval_tokens"], t["eval_ms"], "runs  "),
    ):
        per = ms / tokens if tokens else 0.0
        rate = 1e3 * tokens / ms if ms > 0 else 0.0
        w(
            f"{name} = {ms:10.2f} ms / {int(tokens):5d} {unit} "
            f"({per:8.2f} ms per token, {rate:8.2f} tokens per second)\n"
        )
    if t["reused_tokens"]:
        w(f"reused prompt    = {int(t['reused_tokens']):5d} tokens from the cache\n")


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "temperature": args.temp,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "repeat_penalty": args.repeat_penalty,
        "mirostat_mode": args.mirostat,
        "mirostat_tau": args.mirostat_ent,
        "mirostat_eta": args.mirostat_lr,
        "grammar": _grammar(args),
        "seed": args.seed,
        "stop": args.stop,
        "max_tokens": args.n_predict if args.n_predict > 0 else None,
    }


def _grammar(args: argparse.Namespace) -> Any:
    """``--grammar`` text or ``--grammar-file``, parsed once (llama.cpp's flags)."""
    if args.grammar is not None and args.grammar_file is not None:
        raise weightlift.PlanError("run: expected --grammar or --grammar-file, not both")
    if args.grammar_file is not None:
        return weightlift.LlamaGrammar.from_file(args.grammar_file)
    if args.grammar is not None:
        return weightlift.LlamaGrammar.from_string(args.grammar)
    return None


def _stream(chunks: Any, key: str) -> str:
    """Print streamed chunks as they come and return their text; Ctrl-C ends the reply, not
    the program."""
    pieces: list[str] = []
    try:
        for chunk in chunks:
            choice = chunk["choices"][0]
            text = choice["delta"].get("content", "") if key == "delta" else choice["text"]
            pieces.append(text)
            sys.stdout.write(text)
            sys.stdout.flush()
    except KeyboardInterrupt:
        sys.stdout.write("\n[interrupted]")
    sys.stdout.write("\n")
    return "".join(pieces)


def _cmd_run(args: argparse.Namespace) -> int:
    if args.max_input_len is None:
        args.max_input_len = DEFAULT_BATCH
    model, _, seconds = _load_model(
        args, default_cache=True, compute=args.compute, n_threads=args.threads
    )
    sampling = _sampling(args)
    tp = model.tp
    if tp is not None and tp.rank is not None:
        # Every rank runs the same generation; only rank 0 prints it.
        if args.chat and args.prompt is None:
            raise weightlift.PlanError(
                "run --world: expected a prompt (-p): the ranks of a run cannot share a terminal"
            )
        if args.seed is None:
            sampling["seed"] = 0
        tp.join_nccl()
        if tp.rank != 0:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115
    if not args.chat:
        if args.prompt is None:
            raise weightlift.PlanError("run: expected a prompt (-p PROMPT), or --chat")
        # the call checks its arguments before the prompt is echoed
        chunks = model.create_completion(args.prompt, stream=True, **sampling)
        sys.stdout.write(args.prompt)
        _stream(chunks, "text")
        _print_timings(seconds, model.timings)
        return 0
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    # The ranks of a world cannot share stdin, so they answer the -p message only.
    world = tp is not None and tp.rank is not None
    for user in _user_turns(args.prompt, more=not world):
        messages.append({"role": "user", "content": user})
        reply = _stream(model.create_chat_completion(messages, stream=True, **sampling), "delta")
        messages.append({"role": "assistant", "content": reply})
        _print_timings(seconds if len(messages) <= 3 else None, model.timings)
    return 0


CHAT_EXIT = "/exit"


def _user_turns(first: str | None, *, more: bool) -> Iterator[str]:
    """The user's messages of ``run --chat``: ``first`` (``-p``), then, when ``more``, one per
    line of stdin until end of input or ``/exit``, as llama-cli's conversation mode reads them.

    On a terminal each line is asked for after a ``> `` marker; from a pipe or a file the lines
    are read as they come with no marker, so a chat can be scripted. Blank lines are skipped.
    """
    if first is not None:
        yield first
    # sys.stdin is None when the process was started with stdin closed.
    if not more or sys.stdin is None:
        return
    terminal = sys.stdin.isatty()
    if terminal:
        try:  # once loaded, input() edits the line and keeps a history, as llama-cli's does
            import readline  # noqa: F401
        except ImportError:  # not built on every platform
            pass
    while True:
        if terminal:
            try:
                line = input("> ")
            except EOFError:  # Ctrl-D: end the prompt's line before leaving
                sys.stdout.write("\n")
                return
        else:
            line = sys.stdin.readline()
            if not line:
                return
        text = line.strip()
        if text == CHAT_EXIT:
            return
        if text:
            yield line.rstrip("\r\n")


DEFAULT_BATCH = 512  # run's max_input_len when not given: llama-cpp-python's n_batch
DEFAULT_QUEUE = 16  # serve's waiting requests
API_KEY_ENV = "WEIGHTLIFT_API_KEY"  # serve's key, where --api-key is not given


def _cmd_serve(args: argparse.Namespace) -> int:
    import socket

    from weightlift import server

    if args.parallel < 1:
        raise weightlift.PlanError(f"serve: --parallel: expected 1 or more, got {args.parallel}")
    if args.batch is not None and args.batch != args.parallel:
        raise weightlift.PlanError(
            f"serve: --batch {args.batch} and --parallel {args.parallel} disagree: the cache holds "
            "one sequence per slot; give --parallel alone"
        )
    # the plan counts a cache of --ctx positions per slot, and with --embedding one more for
    # the embeddings, and the load makes them: an embedding then runs in memory the plan holds
    args.batch = args.parallel + (1 if args.embedding else 0)
    if args.queue < 0:
        raise weightlift.PlanError(f"serve: --queue: expected 0 or more, got {args.queue}")
    if not 0 <= args.port <= 65535:
        raise weightlift.PlanError(
            f"serve: --port: expected 0 (any free port) to 65535, got {args.port}"
        )
    if not args.timeout_graceful_shutdown >= 0:
        raise weightlift.PlanError(
            "serve: --timeout-graceful-shutdown: expected 0 or more seconds, got "
            f"{args.timeout_graceful_shutdown}"
        )
    if args.api_key is not None and not args.api_key.strip():
        raise weightlift.PlanError(
            "serve: --api-key: expected a key, got an empty one (leave it out to serve without)"
        )
    # an empty variable is an unset one, as shells and container files often leave it
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    server.require()
    # Bind before the load, so a port in use fails at once.
    sock = socket.create_server((args.host, args.port))
    with sock:
        if args.max_input_len is None:
            args.max_input_len = DEFAULT_BATCH
        model, _, seconds = _load_model(
            args,
            default_cache=True,
            llama_chat=True,
            compute=args.compute,
            n_threads=args.threads,
        )
        alias = args.model_alias or os.path.basename(os.path.normpath(args.path))
        host, port = sock.getsockname()[:2]
        sys.stderr.write(
            f"weightlift: serving {alias} on http://{host}:{port}/v1 (loaded in {seconds:.2f} s; "
            f"{args.parallel} generation(s) at once, {args.queue} may wait)\n"
        )
        sys.stderr.flush()
        server.serve(
            model,
            sock,
            alias=alias,
            parallel=args.parallel,
            queue=args.queue,
            embedding=args.embedding,
            graceful_seconds=args.timeout_graceful_shutdown,
            api_key=api_key,
        )
    return 0


def _plan_options(
    p: argparse.ArgumentParser, *, load: bool = False, world: bool = True, as_json: bool = True
) -> None:
    p.add_argument("path", help="a checkpoint (file, folder, index.json) or an HF config.json")
    p.add_argument(
        "--devices",
        help='device spec, e.g. "virtual:2x8GiB,cpu" or "cuda:0:24GiB,cpu:64GiB,disk" '
        "(default: this machine's devices, every CUDA GPU then cpu, as `weightlift devices` "
        "lists them" + ("; with --world under torchrun: cuda:$LOCAL_RANK,cpu)" if load else ")"),
    )
    p.add_argument(
        "--strategy",
        help="autosplit (default), sequential, balanced, balanced_low_0, layers, "
        "tensor_parallel or map; the llama.cpp flags and --override imply layers",
    )
    if world:
        p.add_argument(
            "--world",
            help="the ranks of a multi-process tensor-parallel run, host:gpus[,host:gpus...] in "
            "torchrun's order (implies tensor_parallel)",
        )
    if load and world:
        p.add_argument(
            "--rank",
            type=int,
            help="with --world: the rank this process loads on its one device (default: $RANK; "
            "unset: one process over every device). run joins the others over NCCL, samples "
            "with seed 0 unless --seed, and prints on rank 0 only",
        )
    p.add_argument("--ctx", type=int, help=f"KV cache length (default {DEFAULT_CTX} with --cache)")
    p.add_argument(
        "--batch", type=int, help="sequences the KV cache holds, each of --ctx (default 1)"
    )
    p.add_argument("--cache", help="KV cache dtype: fp16, bf16, fp8, q8, q6 or q4")
    p.add_argument(
        "--cache-offload",
        action="store_true",
        help="keep the KV cache in host RAM, with two prefetch slots per layer device",
    )
    p.add_argument("--dtype", default="auto", help="convert float weights: auto, float16, ...")
    p.add_argument(
        "--quantize",
        choices=["int8", "q8_0", "q4_k", "q6_k"],
        help="quantise a float checkpoint's linears on load (LLM.int8 or a ggml type)",
    )
    if not load:
        p.add_argument(
            "--weight-dtype",
            help="weights of a config-only plan: bfloat16, float16, q8_0, q4_k_m, ...",
        )
    p.add_argument(
        "--reserve",
        help="per-device reserve: 256MiB,64MiB (accelerator order) or cuda:0=256MiB,...",
    )
    p.add_argument("--max-memory", help="per-device caps, same syntax as --reserve")
    p.add_argument("--n-gpu-layers", "-ngl", type=int, help="llama.cpp n_gpu_layers (-1: all)")
    p.add_argument("--split-mode", "-sm", help="llama.cpp split mode: none, layer or row")
    p.add_argument("--tensor-split", "-ts", help="llama.cpp tensor split, e.g. 3,1")
    p.add_argument("--main-gpu", "-mg", type=int, help="llama.cpp main GPU index (default 0)")
    p.add_argument(
        "--override", "-ot", action="append", help="llama.cpp tensor override REGEX=DEVICE"
    )
    p.add_argument("--max-input-len", type=int, help="runtime max_input_len (default 2048)")
    p.add_argument("--low-mem", action="store_true", help="exllamav2 low_mem scratch sizes")
    p.add_argument("--allow-disk", action="store_true", help="let weights stay on disk")
    p.add_argument(
        "--n-cpu-moe",
        type=int,
        metavar="N",
        help="keep the experts of the first N layers of a mixture-of-experts model in host RAM "
        "(llama.cpp's --n-cpu-moe)",
    )
    if as_json:
        p.add_argument("--json", action="store_true", help="print JSON")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="weightlift",
        description="Open, plan and load large language models on small machines.",
    )
    p.add_argument("--version", action="version", version=f"weightlift {weightlift.__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    dv = sub.add_parser(
        "devices",
        help="what this machine offers: the CUDA driver, NVRTC, each GPU and the host",
    )
    dv.add_argument("--json", action="store_true", help="print one JSON object")
    dv.set_defaults(func=_cmd_devices)

    ins = sub.add_parser("inspect", help="describe a GGUF or safetensors checkpoint")
    ins.add_argument("path", help="a .gguf file, a .safetensors file, a folder or an index.json")
    ins.add_argument("--json", action="store_true", help="print one JSON object")
    ins.add_argument("--tensors", action="store_true", help="list every tensor")
    ins.add_argument(
        "--check-tensors", action="store_true", help="scan float data and scales for NaN/Inf"
    )
    ins.set_defaults(func=_cmd_inspect)

    pl = sub.add_parser("plan", help="place a model on devices, by arithmetic")
    _plan_options(pl)
    pl.add_argument("--svg", help="also draw the plan as an SVG chart into this file")
    pl.set_defaults(func=_cmd_plan)

    ft = sub.add_parser(
        "fit",
        help="the largest context, batch or n_gpu_layers that fits, or the fewest n_cpu_moe",
    )
    _plan_options(ft, world=False)
    ft.add_argument(
        "--target",
        default="max_seq_len",
        choices=["max_seq_len", "batch_size", "n_gpu_layers", "n_cpu_moe"],
        help="what to maximise (default max_seq_len), or n_cpu_moe: the fewest layers whose "
        "experts stay in host RAM for the rest to fit",
    )
    ft.set_defaults(func=_cmd_fit)

    ld = sub.add_parser(
        "load",
        help="load a model onto devices, then show the plan against the memory held",
    )
    _load_flags(ld)
    ld.set_defaults(func=_cmd_load)

    rn = sub.add_parser(
        "run",
        help="load a model, then generate text from a prompt or chat with it",
    )
    _load_flags(rn)
    rn.add_argument("-p", "--prompt", help="the prompt (with --chat: the first user message)")
    rn.add_argument(
        "-n", "--n-predict", type=int, default=128, help="tokens to generate (<= 0: until full)"
    )
    rn.add_argument("--temp", type=float, default=0.8, help="temperature (0: greedy)")
    rn.add_argument("--top-k", type=int, default=40, help="top-k (<= 0: off)")
    rn.add_argument("--top-p", type=float, default=0.95, help="top-p (1: off)")
    rn.add_argument("--min-p", type=float, default=0.05, help="min-p (0: off)")
    rn.add_argument("--repeat-penalty", type=float, default=1.0, help="repeat penalty (1: off)")
    rn.add_argument(
        "--mirostat",
        type=int,
        default=0,
        choices=(0, 1, 2),
        help="Mirostat sampling in place of top-k/p, min-p and temperature (0: off, 1, 2)",
    )
    rn.add_argument(
        "--mirostat-lr", type=float, default=0.1, help="Mirostat learning rate, eta (0.1)"
    )
    rn.add_argument(
        "--mirostat-ent", type=float, default=5.0, help="Mirostat target entropy, tau (5.0)"
    )
    rn.add_argument("--grammar", help="GBNF grammar the output must follow")
    rn.add_argument("--grammar-file", help="file with a GBNF grammar the output must follow")
    rn.add_argument("--seed", type=int, help="sampling seed (default and -1: random)")
    rn.add_argument("--stop", action="append", help="stop string (repeatable)")
    _engine_flags(rn)
    rn.add_argument(
        "--chat",
        action="store_true",
        help="chat through the model's chat template: -p is the first message, then each line "
        f"of stdin a turn (asked for with > on a terminal) until end of input or {CHAT_EXIT}",
    )
    rn.add_argument("--system", help="with --chat: a system message")
    rn.set_defaults(func=_cmd_run)

    sv = sub.add_parser(
        "serve",
        help="load a model, then serve it over HTTP with OpenAI's API",
        description="Load a model, then serve it with OpenAI's API: POST /v1/completions and "
        "/v1/chat/completions (stream: true as server-sent events), POST /v1/embeddings (with "
        "--embedding), GET /v1/models and /health, and llama-cpp-python's /extras/tokenize, "
        "/extras/tokenize/count and /extras/detokenize. "
        "--parallel generations run at once, batched into one forward call a token, each in a "
        "slot that keeps its cache (a prompt prefix another slot holds is copied, not run "
        "again); the other requests wait in a queue, first come first served, and get 503 "
        "beyond it. SIGINT or SIGTERM lets the running requests finish (for up to "
        "--timeout-graceful-shutdown seconds; those still running then are cancelled), then "
        "exits 0. Needs `pip install weightlift[server]`.",
    )
    _load_flags(sv, serve=True)
    _engine_flags(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    sv.add_argument("--port", type=int, default=8000, help="port (8000; 0: any free one)")
    sv.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="generations at once (1): each gets a slot, a KV cache of --ctx positions, all "
        "of them in the plan (as --batch N is in `weightlift plan`)",
    )
    sv.add_argument(
        "--queue",
        type=int,
        default=DEFAULT_QUEUE,
        help=f"requests that may wait for the model ({DEFAULT_QUEUE}); more get 503",
    )
    sv.add_argument(
        "--embedding",
        action="store_true",
        help="serve POST /v1/embeddings too (llama-cpp-python's --embedding, llama.cpp's "
        "--embeddings): the plan counts one more cache of --ctx positions for them",
    )
    sv.add_argument("--model-alias", help="the model's name in the API (default: the file name)")
    sv.add_argument(
        "--api-key",
        help="require this key (Authorization: Bearer KEY, as OpenAI's client sends it) on "
        f"every endpoint but /health; default ${API_KEY_ENV}, which keeps it out of the "
        "process list",
    )
    sv.add_argument(
        "--timeout-graceful-shutdown",
        type=float,
        default=GRACEFUL_SECONDS,
        metavar="SECONDS",
        help="after SIGINT or SIGTERM, how long running requests may finish before they are "
        f"cancelled ({GRACEFUL_SECONDS:g}; uvicorn's option of that name)",
    )
    sv.set_defaults(func=_cmd_serve)
    return p


def _engine_flags(p: argparse.ArgumentParser) -> None:
    """The generation flags ``run`` and ``serve`` share."""
    p.add_argument("-t", "--threads", type=int, help="threads (default: physical cores)")
    p.add_argument("--compute", default="fast", help="fast (as llama.cpp) or exact (f32)")
    p.add_argument(
        "--chat-format",
        help="format chats with this built-in format (llama-cpp-python's chat_format: chatml, "
        "llama-3, mistral-instruct, ...) in place of the model's chat template; serve, without "
        "it, takes llama-cpp-python's pick (llama-2 for a GGUF without a template)",
    )


def _load_flags(p: argparse.ArgumentParser, *, serve: bool = False) -> None:
    """The placement and reading flags of ``load``, shared with ``run`` and ``serve`` (which
    has no ``--world`` and no ``--json``)."""
    _plan_options(p, load=True, world=not serve, as_json=not serve)
    p.add_argument(
        "--no-mmap", action="store_true", help="read CPU tensors into owned memory (use_mmap=False)"
    )
    p.add_argument(
        "--direct-io", action="store_true", help="read with O_DIRECT (buffered where refused)"
    )
    p.add_argument(
        "--check-tensors", action="store_true", help="scan the weights for NaN/Inf while loading"
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="draw a progress bar on stderr (default: when stderr is a terminal)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``weightlift`` command; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        status: int = args.func(args)
    except (weightlift.WeightliftError, OSError, ValueError, ImportError) as e:
        if isinstance(e, BrokenPipeError):
            return 0
        sys.stderr.write(f"weightlift: error: {_one_line(e)}\n")
        return EXIT_ERROR
    except KeyboardInterrupt:
        sys.stderr.write("weightlift: interrupted\n")
        return 130
    return status


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
