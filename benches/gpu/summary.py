"""The short summary at the end of benches/gpu/run.sh: the tests' results, the kernel bench's
matrix-vector products against the device copy, and the end-to-end rows, from the files the
steps wrote in --out. Prints it and writes summary.md beside them."""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
from pathlib import Path
from typing import Any


def tests(tsv: Path) -> list[str]:
    if not tsv.is_file():
        return ["- no test results"]
    rows = [line.split("\t") for line in tsv.read_text().splitlines()[1:] if line.strip()]
    out = []
    for suite, args, result, secs in rows:
        ok = result.startswith("ok.")
        out.append(f"- {'ok  ' if ok else 'FAIL'} {suite} {args}: {result} ({secs} s)")
    return out


def kernels(folder: Path) -> list[str]:
    out = []
    for path in sorted(folder.glob("kernels_cuda*.json")):
        res = json.loads(path.read_text())
        copy = res["copy_gb_per_s"]
        # matvec_{type}_f32_{mode}_{rows}x{cols}: the share of the copy per type and mode,
        # the median and range over the shapes
        by: dict[str, list[float]] = {}
        unsupported = []
        for r in res["rows"]:
            m = re.fullmatch(r"matvec_(\w+?)_f32_(exact|q8)_(\d+)x(\d+)", r["kernel"])
            if not m:
                continue
            key = f"{m[1]} {m[2]}"
            if r["gb_per_s"] is None:
                unsupported.append(key)
                continue
            by.setdefault(key, []).append(100 * r["gb_per_s"] / copy)
        out.append(
            f"- {path.stem}: device copy {copy:,.0f} GB/s; matvec % of copy over the shapes:"
        )
        for key, pct in by.items():
            out.append(
                f"  - {key}: median {statistics.median(pct):.0f} % "
                f"({min(pct):.0f}-{max(pct):.0f} %)"
            )
        for key in dict.fromkeys(unsupported):
            out.append(f"  - {key}: did not run (see the table)")
        out.extend(crossovers(res))
    return out or ["- no kernel bench results"]


def crossovers(res: dict[str, Any]) -> list[str]:
    """The route table's crossovers: per type and mode, the prompt length from which cuBLAS
    wins for good (a suggested CUBLAS_MIN_TOKENS), where cuBLAS ran; and from which the int8
    tensor-core kernels do below it (a suggested MMQ_MIN_TOKENS_BY_TYPE entry), where they ran."""
    every = res.get("cublas_crossovers", [])
    out = []
    ran = [x for x in every if x["cublas_ran"]]
    if ran:
        now = res.get("cublas_min_tokens_now", "?")
        out.append(
            f"  - prompt products: cuBLAS wins for good from (tokens; now {now} for every type):"
        )
        for x in ran:
            n = x["min_tokens"]
            out.append(f"    - {x['type']} {x['mode']}: {n if n is not None else 'never'}")
    mma = [x for x in every if x.get("mma_ran")]
    if mma:
        out.append("  - prompt products: int8 tensor cores win for good from (tokens; now never):")
        for x in mma:
            n = x["mma_min_tokens"]
            out.append(f"    - {x['type']} {x['mode']}: {n if n is not None else 'never'}")
    return out


def bench_lines(folder: Path, name: str, what: str) -> list[str]:
    """A bench's own markdown (`name`.md) without its title."""
    path = folder / f"{name}.md"
    if not path.is_file():
        return [f"- no {what} results"]
    return path.read_text().strip().splitlines()[2:]


def e2e(folder: Path) -> list[str]:
    path = folder / "e2e.json"
    if not path.is_file():
        return ["- no end-to-end results"]
    res = json.loads(path.read_text())
    out = [f"- {res['device']}, {res['shape_name']}:"]
    for r in res["rows"]:
        name = r["label"] if r["engine"] == "transformers" else f"weightlift {r['label']}"
        if "error" in r:
            out.append(f"  - {name}: failed: {r['error'][:200]}")
            continue
        m: dict[str, Any] = r.get("median", {})

        def f(k: str, m: dict[str, Any] = m) -> str:
            v = m.get(k)
            return "—" if v is None else f"{v:,.1f}"

        parts = r.get("load_parts_s", {})
        weights = parts.get("weights", parts.get("to_device"))
        rate = (
            f" (weights {weights:.3f} s, {res['checkpoint']['bytes'] / weights / 1e9:.1f} GB/s)"
            if weights
            else ""
        )
        out.append(
            f"  - {name}: decode {f('decode_short')} tok/s @64, {f('decode_long')} @2048; "
            f"prefill {f('prefill_512')} / {f('prefill_2048')} ms (512 / 2048); "
            f"load {r.get('load_s', 0):.2f} s{rate}"
        )
    base = res.get("copy_baselines", {})
    if base:
        rates = ", ".join(f"{k} {v:.1f}" for k, v in base.items())
        out.append(f"  - copy baselines, GB/s: {rates}")
    out += [f"  - skipped: {s}" for s in res.get("skipped", [])]
    return out


def cuda_libs(path: Path) -> list[str]:
    """What one of run.sh's CUDA probes found (`cuda_info()` and the libcublasLt the loader
    mapped): the driver, NVRTC, libcublas and libcublasLt, each a path (and version) or why
    not. Without libcublas, prompts take the slower kernels without cuBLAS."""
    if not path.is_file():
        return ["- not probed"]
    try:
        info = json.loads(path.read_text())
    except ValueError:
        return [f"- the probe failed: {path.read_text().strip()[-300:]}"]
    out = []
    for lib, key in (
        ("driver", "cuda_version"),
        ("nvrtc", "version"),
        ("cublas", "version"),
        ("cublasLt", None),
    ):
        got = info.get(lib) or {"error": "not in the probe's report"}
        if "error" in got:
            out.append(f"- {lib}: not found: {got['error']}")
        elif key is None:
            out.append(f"- {lib}: {got.get('path', '?')}")
        else:
            out.append(f"- {lib}: {got.get('path', '?')} (version {got.get(key, '?')})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tests", type=Path, required=True)
    ap.add_argument("--failed", default="")
    ap.add_argument("--skipped", default="")
    a = ap.parse_args()
    failed = [x for x in a.failed.splitlines() if x.strip()]
    skipped = [x for x in a.skipped.splitlines() if x.strip()]
    lines = [
        "# GPU check: summary",
        "",
        os.environ.get("WEIGHTLIFT_RUN_HEADER", ""),
        "",
        "## CUDA libraries the package found by itself (no LD_LIBRARY_PATH)",
        "",
        *cuda_libs(a.out / "cuda_info.json"),
        "",
        "## CUDA libraries the steps ran with (run.sh's LD_LIBRARY_PATH)",
        "",
        *cuda_libs(a.out / "cuda_info_steps.json"),
        "",
        "## Tests",
        "",
        *tests(a.tests),
        *[f"- skipped: {s}" for s in skipped],
        "",
        "## Kernel bench",
        "",
        *kernels(a.out),
        "",
        "## End to end",
        "",
        *e2e(a.out),
        "",
        "## Prefill without cuBLAS (WEIGHTLIFT_CUBLAS=0, the A/B of the rows above)",
        "",
        *e2e(a.out / "prefill-no-cublas"),
        "",
        "## Decode without CUDA graphs (WEIGHTLIFT_CUDA_GRAPHS=0, the A/B of the rows above)",
        "",
        *e2e(a.out / "decode-no-graphs"),
        "",
        "## Decode with the narrow Q4_K lanes (WEIGHTLIFT_Q8V=narrow, the A/B of the q4_k rows)",
        "",
        *e2e(a.out / "decode-q8v-narrow"),
        "",
        "## Offload",
        "",
        *bench_lines(a.out, "offload_e2e", "offload"),
        "",
        "## MoE: experts in host RAM",
        "",
        *bench_lines(a.out, "moe_offload", "MoE"),
        "",
        "## Batched decode",
        "",
        *bench_lines(a.out, "batch_e2e", "batched decode"),
        "",
        "## Verdict",
        "",
        f"- failed: {', '.join(failed)}" if failed else "- every step that ran passed",
    ]
    text = "\n".join(lines) + "\n"
    (a.out / "summary.md").write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
