"""MoE bench: a Mixtral-shaped bf16 model whose experts do not fit the GPU's budget, decoded
with its experts in host RAM and computed there (`n_cpu_moe`, llama.cpp's `--n-cpu-moe`)
against weight offload (`offload="sequential"`, each layer's matrices copied to the GPU as it
runs) and against accelerate, on the same GPU in the same run.

The model (MOE_SHAPE, about 1.3 GiB of bf16, nine tenths of it experts) is made once with
transformers' random initialisation and reused. Every row gets GPU_BYTES of the GPU and the
rest in host RAM (CUDA_GPU_BYTES on a GPU, since weightlift's plan also charges the GPU its
CUDA context, kernel modules and cuBLAS workspace, about 584 MiB on an H200, where
accelerate's `max_memory` counts tensors alone), batch 1, greedy, bf16 weights as stored:

  weightlift, experts in host RAM   n_cpu_moe = every layer: attention, norms, router, embedding
                                    and head on the GPU; each token's routed experts computed on
                                    the host from host RAM (no expert byte crosses the link)
  weightlift, sequential            every layer's matrices streamed to the GPU as it runs
  weightlift, offload=None          the layers that do not fit computed on the host
  accelerate                        transformers' `device_map="auto"` with `max_memory`

Each row: decode tok/s over DECODE_TOKENS tokens after a PROMPT-token prompt (median of
REPEATS, after one untimed warm-up) and, for weightlift, the bytes its last decode step copied.
The issue's target is the first row faster than the second. `--cpu` rehearses on a `virtual:`
device with the repository's tiny Mixtral fixture, without the peer. `--link RATE` measures the
same model and rows on a machine without a GPU: a `virtual:` device whose link to the host is
throttled to RATE (`virtual:4GiB@16GB/s`) stands for the GPU, so each streamed byte costs what
it would over that link; the device's compute is the host's, and there is no peer.

    python benches/gpu/moe_offload.py --device cuda:0 --out benches/results/gpu
    python benches/gpu/moe_offload.py --link 16GB/s --out benches/results

Writes moe_offload.md and moe_offload.json in --out, and prints the table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e  # noqa: E402  (the budget, the transformers check and the report helpers are shared)
import offload_e2e  # noqa: E402  (the rows' measurement is the offload bench's)
from offload_e2e import DECODE_TOKENS, PROMPT, REPEATS  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "data" / "tiny-mixtral"

GPU_BYTES = "512MiB"
CUDA_GPU_BYTES = "1GiB"
SEED = 0

# Mixtral's layout at a size that is quick to make: 8 experts of which 2 run a token, experts
# 1024 × 2816 (so the experts are ~1.1 GiB of the ~1.3 GiB, and only the dense part fits
# GPU_BYTES).
MOE_SHAPE = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1e6,
    "tie_word_embeddings": False,
    "router_jitter_noise": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# weightlift's rows: label, Model.load keyword arguments. The first places as llama.cpp does
# (every layer on the GPU, `-ngl 99 --n-cpu-moe N` with N every layer: set in main) and needs
# no budget, since what stays on the GPU is the dense part; the report shows what its plan
# charges the GPU. The others get GPU_BYTES through accelerate's `max_memory`.
OURS: list[tuple[str, dict[str, Any]]] = [
    ("weightlift, experts in host RAM (n_cpu_moe)", {"n_gpu_layers": 99, "n_cpu_moe": None}),
    ("weightlift, sequential", {"offload": "sequential"}),
    ("weightlift, offload=None", {}),
]
PEER = "accelerate (transformers bf16, device_map=auto)"


def checkpoint(root: Path) -> tuple[Path, dict[str, Any]]:
    """The bf16 Mixtral of MOE_SHAPE, made once in `root` with transformers and reused."""
    import torch
    import transformers

    key = {"shape": MOE_SHAPE, "seed": SEED, "transformers": transformers.__version__}
    folder = root / f"mixtral-h{MOE_SHAPE['hidden_size']}-l{MOE_SHAPE['num_hidden_layers']}"
    stamp = folder / "moe-stamp.json"
    info: dict[str, Any] = {"path": str(folder), "made_with": "transformers"}
    if stamp.is_file() and json.loads(stamp.read_text()) == key:
        info["seconds_to_make"] = None
    else:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        e2e.say(f"making the MoE checkpoint with transformers in {folder}")
        t0 = time.perf_counter()
        torch.manual_seed(SEED)
        before = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # initialise in bf16: half the memory and time
        try:
            model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**MOE_SHAPE))
        finally:
            torch.set_default_dtype(before)
        model.to(torch.bfloat16).save_pretrained(folder)
        info["seconds_to_make"] = time.perf_counter() - t0
        stamp.write_text(json.dumps(key) + "\n")
    info["bytes"] = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    return folder, info


def fixture() -> tuple[Path, dict[str, Any]]:
    """The rehearsal's model: the repository's tiny Mixtral (f16 safetensors)."""
    info = {"path": str(FIXTURE), "made_with": "tests/gen_mixtral.py"}
    info["bytes"] = sum(p.stat().st_size for p in FIXTURE.glob("*.safetensors"))
    return FIXTURE, info


def size(n: int) -> str:
    """Bytes in MiB, or KiB below one (the rehearsal's model is tiny)."""
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def markdown(res: dict[str, Any]) -> str:
    lines = [
        "# MoE: experts in host RAM against weight offload",
        "",
        f"{res['machine']}; {res['checkpoint']['bytes'] / 2**30:.2f} GiB Mixtral-shaped "
        f"checkpoint ({res['checkpoint']['made_with']}), {GPU_BYTES} for the GPU, "
        f"{DECODE_TOKENS} decode tokens after {PROMPT}, median of {REPEATS}.",
        "",
        "| engine | decode, tok/s | copied per token | GPU planned | placement |",
        "|---|---:|---:|---:|---|",
    ]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['label']} | {r['error']} | | | |")
            continue
        copied = r.get("copy_bytes_per_token")
        copied_s = "" if copied is None else size(copied)
        planned = r.get("gpu_planned_bytes")
        planned_s = "" if planned is None else size(planned)
        where = r.get("layers_on") or r.get("modules_on") or {}
        lines.append(
            f"| {r['label']} | {e2e.fmt(r.get('decode_tok_s'))} | {copied_s} | {planned_s} "
            f"| {where} |"
        )
    rate = {r["label"]: r.get("decode_tok_s") for r in res["rows"] if "error" not in r}
    experts, sequential = rate.get(OURS[0][0]), rate.get(OURS[1][0])
    lines.append("")
    if experts and sequential:
        lines.append(
            f'- experts in host RAM: **{experts / sequential:.2f}x** offload="sequential" '
            "(the target: above 1)"
        )
    peer = rate.get(PEER)
    if experts and peer:
        lines.append(f"- experts in host RAM: **{experts / peer:.2f}x** accelerate")
    for s in res["skipped"]:
        lines.append(f"- skipped: {s}")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--cpu", action="store_true", help="the rehearsal: a virtual device")
    ap.add_argument(
        "--link", metavar="RATE", help="no GPU: a virtual device with its link throttled to RATE"
    )
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, default=120.0)
    a = ap.parse_args()
    if a.cpu and a.link:
        ap.error("--cpu rehearses on the tiny fixture; --link measures the bench's model")
    global GPU_BYTES
    budget = e2e.Budget(a.budget_s)
    device = a.device
    devices = (f"{device},cpu", device)
    if a.cpu:
        path, info = fixture()
        # a virtual device stands for the GPU, the budget one and a half times the fixture's
        # bytes (the tiny model's scratch is a good part of it: the rehearsal checks that the
        # rows run, not what they measure)
        GPU_BYTES = f"{info['bytes'] * 3 // 2 // 2**10}KiB"
        device = "virtual:0"
        devices = (f"virtual:{info['bytes'] * 4 // 2**10}KiB,cpu", device)
    elif a.link and (why := e2e.has_transformers()) is not None:
        print(f"moe_offload: the checkpoint needs transformers: {why}", file=sys.stderr)
        return 2
    elif a.link:
        path, info = checkpoint(e2e.checkpoint_root())
        device = "virtual:0"
        devices = (f"virtual:4GiB@{a.link},cpu", device)
    elif (why := e2e.has_transformers()) is not None:
        print(f"moe_offload: the checkpoint needs transformers: {why}", file=sys.stderr)
        return 2
    else:
        path, info = checkpoint(e2e.checkpoint_root())
        GPU_BYTES = CUDA_GPU_BYTES
    config = json.loads((path / "config.json").read_text())
    n_layers, vocab = config["num_hidden_layers"], config["vocab_size"]
    ids = [(7 + 13 * i) % vocab for i in range(PROMPT)]
    rows = []
    for label, kw in OURS:
        kw = {k: (n_layers if k == "n_cpu_moe" else v) for k, v in kw.items()}
        e2e.say(f"{label} ...")
        share = None if "n_cpu_moe" in kw else GPU_BYTES
        rows.append(offload_e2e.bench_ours(label, kw, path, devices, ids, budget, share))
    if a.cpu or a.link:
        budget.skipped.append(f"{PEER}: no GPU on this machine")
    else:
        e2e.say(f"{PEER} ...")
        rows.append(
            offload_e2e.bench_peer(
                path, device, ids, budget, GPU_BYTES, "MixtralForCausalLM", label=PEER
            )
        )
    if a.link:
        device = f"{device} ({devices[0].split(',')[0]}, standing for the GPU)"
    return offload_e2e.report(a.out, "moe_offload", markdown, device, info, rows, budget)


if __name__ == "__main__":
    raise SystemExit(main())
