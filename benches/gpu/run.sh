#!/usr/bin/env bash
# The GPU check in one call of at most five minutes: every test that needs a GPU, the CUDA
# kernel bench and the end-to-end bench, on a machine with one NVIDIA GPU and its own Python
# (torch and transformers, no internet), from the folder `make gpu-bundle` builds beside this
# checkout (release test binaries, the wheel; the reference files the tests read are laid out
# here). The A/Bs, the offload and MoE benches and the kernel profile run when STEPS names them.
#
#   benches/gpu/run.sh [--out DIR] [--bundle DIR]   on the GPU machine; results in DIR
#                                                  (default benches/results/gpu)
#   benches/gpu/run.sh --cpu [--out DIR]           every step on a machine without a GPU:
#                                                  the CUDA steps skipped by name, the benches
#                                                  on cpu with a smaller model (default out
#                                                  benches/results/gpu/cpu, which git ignores)
#   benches/gpu/run.sh --list                      the tables below, for the bundle builder
#
# Environment: STEPS (the steps to run, the others skipped by name; default tests,kernels,e2e on
# a GPU, every step with --cpu; all of them: tests,kernels,e2e,prefill_ab,graphs_ab,q8v_ab,
# offload,moe,batch,profile), RUN_BUDGET_S (the whole run's seconds, 290 by default, 1800 with --cpu:
# a step that cannot start in what is left is skipped by name), SUITES (the test suites to run,
# e.g. backend_matmul_modes,cuda; default all), WEIGHTS (the weight types of the end-to-end
# bench and the profile, e.g. bf16,q4_k, and transformers for the peer; default all), PYTHON
# (default python3, the machine's own; with --cpu, the checkout's .venv where there is one,
# since the rehearsal needs numpy and safetensors).
# WEIGHTLIFT_CUDA_GRAPHS is set to 1 for the end-to-end rows and the profile, which measure
# decode as it runs by default (each step replayed from a CUDA graph); graphs_ab sets it to 0
# for its own rows. WEIGHTLIFT_Q8V is unset for every step but q8v_ab, which sets it to narrow.
#
# The default run fits one five-minute call on an H200, by budgets sized from the last full run
# there (benches/results/gpu/: tests.md's seconds a suite, e2e.json's checkpoint and rows):
#   set-up    ~15 s  unpack, the wheel, the CUDA probes, the reference files (--cpu: ~10 s)
#   tests     ~90 s  45 s for the nine suites of that run (nvrtc_compile 24, cuda 16, the others
#                    1 s each), plus backend_prefill, forward_backend, offload_exec and the
#                    cuda suite's newer tests; each suite under SUITE_TIMEOUT_S
#   kernels   ~60 s  ~120 cases sampled for 60 ms after a warm-up, then the 480 cases of the
#                    prompt-product route table for 20 ms each (not timed alone yet); under
#                    BENCH_TIMEOUT_S
#   e2e      ~100 s  the bf16 checkpoint made with transformers (52 s on a fresh machine), then
#                    four rows of 4-9 s (load, a warm-up and 3 rounds of 32 decode tokens and
#                    two prefills) and transformers' (~15 s); rows that do not start within
#                    E2E_BUDGET_S (100) are skipped by name, and a row started last runs 20 s
#                    more at most (E2E_TAIL_S)
#   summary    ~2 s
# 15 + 90 + 60 + 100 + 20 = 285 s, within RUN_BUDGET_S = 290: past it nothing new starts
# (what is left is skipped by name, and the summary says so), each step's timeout is cut to
# what is left, and the end-to-end budget to what is left less E2E_TAIL_S, so a call never
# overruns.
# The steps the default leaves out run in calls of their own, named in STEPS, each call under
# RUN_BUDGET_S too and into a folder of its own (a run first clears every step's results in
# --out): STEPS=prefill_ab,graphs_ab,q8v_ab (two rows' prefills without cuBLAS within
# PREFILL_AB_BUDGET_S, two rows' decodes without CUDA graphs within GRAPHS_AB_BUDGET_S, the q4_k
# decode with the narrow lanes within Q8V_AB_BUDGET_S; with the set-up and the checkpoint made
# again on a fresh machine, 15 + 52 + 60 + 60 + 30 s), then STEPS=offload,moe,profile (the
# offload and MoE benches stop their rounds at OFFLOAD_BUDGET_S and MOE_BUDGET_S, the profile
# runs under PROFILE_TIMEOUT_S; the batched decode bench, STEPS=batch, stops at BATCH_BUDGET_S).
# Each step runs even when one before it failed; the exit status is 1 when any failed.
set -uo pipefail

SUITE_TIMEOUT_S=${SUITE_TIMEOUT_S:-150}
BENCH_TIMEOUT_S=${BENCH_TIMEOUT_S:-150}
E2E_BUDGET_S=${E2E_BUDGET_S:-100}
E2E_TAIL_S=${E2E_TAIL_S:-20}
E2E_TIMEOUT_S=${E2E_TIMEOUT_S:-300}
OFFLOAD_BUDGET_S=${OFFLOAD_BUDGET_S:-90}
OFFLOAD_TIMEOUT_S=${OFFLOAD_TIMEOUT_S:-200}
MOE_BUDGET_S=${MOE_BUDGET_S:-40}
MOE_TIMEOUT_S=${MOE_TIMEOUT_S:-150}
BATCH_BUDGET_S=${BATCH_BUDGET_S:-60}
BATCH_TIMEOUT_S=${BATCH_TIMEOUT_S:-150}
PROFILE_TIMEOUT_S=${PROFILE_TIMEOUT_S:-120}
PREFILL_AB_BUDGET_S=${PREFILL_AB_BUDGET_S:-60}
PREFILL_AB_TIMEOUT_S=${PREFILL_AB_TIMEOUT_S:-120}
GRAPHS_AB_BUDGET_S=${GRAPHS_AB_BUDGET_S:-60}
GRAPHS_AB_TIMEOUT_S=${GRAPHS_AB_TIMEOUT_S:-120}
Q8V_AB_BUDGET_S=${Q8V_AB_BUDGET_S:-30}
Q8V_AB_TIMEOUT_S=${Q8V_AB_TIMEOUT_S:-90}

# Every test that needs a GPU (`grep -rn '#\[ignore' crates`), by the suite that holds it:
# how the suite runs on the GPU and in --cpu mode, and what else it needs. Kernel suites run
# whole on the GPU (the CPU cases beside the CUDA ones cost little); engine suites run their
# ignored tests only (the others run in CI, and some read the demo model, which is too large
# for the bundle's 64 MiB: the ignored ones read the reference files instead). `needs`:
# `reference` = the files in REFERENCE_FILES; `2gpu` = two GPUs.
#  crate               suite                 on the GPU       --cpu  needs
GPU_TESTS='
weightlift-kernels    nvrtc_compile         all              all    -
weightlift-kernels    backends              include-ignored  all    -
weightlift-kernels    backend_copies        include-ignored  all    -
weightlift-kernels    backend_int8          include-ignored  all    -
weightlift-kernels    backend_layer_ops     include-ignored  all    -
weightlift-kernels    backend_matmul_modes  include-ignored  all    -
weightlift-kernels    backend_prefill       include-ignored  all    -
weightlift-kernels    int8                  include-ignored  all    -
weightlift-engine     cuda                  ignored          all    reference
weightlift-engine     tp_rank               ignored          skip   reference
weightlift-engine     offload_exec          ignored          skip   reference
weightlift-engine     forward_backend       ignored          skip   reference
weightlift-engine     decode_ops            ignored          skip   reference
weightlift-engine     tp_backend            ignored          skip   2gpu
'
# The bench binaries the bundle carries (benches/benches/*.rs).
BENCHES='kernels_cuda'
# The reference files those tests read, under WEIGHTLIFT_REFERENCE (a folder laid out as the
# reference pack: tiny-llama/, smollm2-135m/); laid out here from the checkout's
# tests/reference by its materialize.py with the bundle's wheel (the GGUFs are rebuilt by
# quantise-on-load and checked against llama.cpp's sha256).
REFERENCE_FILES='
tiny-llama/gguf/tiny-llama-Q8_0.gguf
tiny-llama/gguf/tiny-llama-Q4_K_M.gguf
tiny-llama/ids.json
tiny-llama/hf_logits.npy
tiny-llama/safetensors/model.safetensors
tiny-llama/safetensors/config.json
tiny-llama/safetensors/tokenizer.json
tiny-llama/safetensors/tokenizer_config.json
tiny-llama/safetensors/generation_config.json
smollm2-135m/prompts.json
'

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# The checkout: the first folder upwards holding Cargo.toml and kernels/ (this script runs from
# benches/gpu/ or from the bundle folder's copy).
ROOT=$here
while [ "$ROOT" != / ] && ! { [ -f "$ROOT/Cargo.toml" ] && [ -d "$ROOT/kernels" ]; }; do
    ROOT=$(dirname "$ROOT")
done
if [ "$ROOT" = / ]; then
    echo "run.sh: no weightlift checkout above $here" >&2
    exit 2
fi

CPU=0
OUT=
BUNDLE=$ROOT/gpu-bundle
while [ $# -gt 0 ]; do
    case $1 in
    --cpu) CPU=1 ;;
    --out) OUT=${2:?--out takes a folder}; shift ;;
    --bundle) BUNDLE=${2:?--bundle takes a folder}; shift ;;
    --list)
        echo "$GPU_TESTS" | awk 'NF {print "test", $1, $2, $3, $4, $5}'
        for b in $BENCHES; do echo "bench $b"; done
        echo "$REFERENCE_FILES" | awk 'NF {print "reference", $1}'
        exit 0
        ;;
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "run.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
if [ -z "$OUT" ]; then
    if [ $CPU = 1 ]; then OUT=$ROOT/benches/results/gpu/cpu; else OUT=$ROOT/benches/results/gpu; fi
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
# A result left by an earlier run must not pass for this one's.
rm -f "$OUT"/{summary,tests,e2e,offload_e2e,moe_offload,batch_e2e,profile,kernels_cuda,kernels_cuda_on_cpu,cuda_info,cuda_info_steps}.{md,json}
rm -f "$OUT"/prefill-no-cublas/e2e.{md,json} "$OUT"/decode-no-graphs/e2e.{md,json}
rm -f "$OUT"/decode-q8v-narrow/e2e.{md,json}
# The wide Q8 decode kernels are the default; only q8v_ab picks the narrow ones.
unset WEIGHTLIFT_Q8V
if [ -z "${PYTHON:-}" ]; then
    PYTHON=python3
    [ $CPU = 1 ] && [ -x "$ROOT/.venv/bin/python" ] && PYTHON=$ROOT/.venv/bin/python
fi
ALL_STEPS=tests,kernels,e2e,prefill_ab,graphs_ab,q8v_ab,offload,moe,batch,profile
if [ $CPU = 1 ]; then
    # Two shared cores do in minutes what the GPU does in seconds; the rehearsal runs every
    # step, the CUDA ones skipped by name.
    SUITE_TIMEOUT_S=600 BENCH_TIMEOUT_S=600 E2E_BUDGET_S=360 E2E_TIMEOUT_S=600
    RUN_BUDGET_S=${RUN_BUDGET_S:-1800}
    STEPS=${STEPS:-$ALL_STEPS}
else
    RUN_BUDGET_S=${RUN_BUDGET_S:-290}
    STEPS=${STEPS:-tests,kernels,e2e}
fi
exec > >(tee "$OUT/run.log") 2>&1
TEE=$!

FAILED=()
SUITES=${SUITES:-}
WEIGHTS=${WEIGHTS:-}
# The run's budget, counted from the script's start (bash's SECONDS): what is left of it, whether
# something needing at least $2 s of it may start (else it is skipped by name), and a timeout
# $1 cut to what is left.
left() { echo $((RUN_BUDGET_S - SECONDS)); }
in_budget() {
    local l
    l=$(left)
    [ "$l" -ge "$2" ] && return 0
    skip "the run's budget (RUN_BUDGET_S=$RUN_BUDGET_S) is spent, $l s left of the $2 s it needs: $1"
    return 1
}
capped() { local l; l=$(left); echo $(($1 < l ? $1 : l)); }
# A bench's own budget $1 cut to what is left of the run's less E2E_TAIL_S (the row or round a
# bench starts last runs on past its budget), at least 1 s.
bench_budget() {
    local b
    b=$(($(left) - E2E_TAIL_S))
    b=$(($1 < b ? $1 : b))
    echo $((b > 1 ? b : 1))
}
# A step starts when STEPS names it ($1) and at least STEP_MIN_S of the run's budget is left.
STEP_MIN_S=30
SUITE_MIN_S=10
wants() {
    case ",$STEPS," in *",$1,"*) in_budget "$2" "$STEP_MIN_S"; return ;; esac
    skip "not in STEPS ($STEPS): $2"
    return 1
}
step() { printf '\n== %s\n' "$*"; }
skip() { echo "skipped: $*"; SKIPPED+=("$*"); }
SKIPPED=()

# ---------------------------------------------------------------------------------------------
# Unpack the bundle into a scratch folder, removed at exit with everything else made here.

WORK=$(mktemp -d "${TMPDIR:-/tmp}/weightlift-gpu-run.XXXXXX")
MADE=("$WORK")
cleanup() {
    local p
    for p in "${MADE[@]}"; do rm -rf -- "$p"; done
    # let tee write the last lines before the caller reads the log
    exec >&- 2>&-
    wait "$TEE" 2>/dev/null
}
trap cleanup EXIT

step "bundle"
if [ ! -f "$BUNDLE/bundle.tar.xz" ]; then
    echo "run.sh: no $BUNDLE/bundle.tar.xz; build it with \`make gpu-bundle\` on any machine" >&2
    exit 2
fi
if ! tar -C "$WORK" -xJf "$BUNDLE/bundle.tar.xz" 2>/dev/null; then
    # tar without xz support: Python's tarfile reads it too
    "$PYTHON" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
        "$BUNDLE/bundle.tar.xz" "$WORK" || { echo "run.sh: cannot unpack the bundle" >&2; exit 2; }
fi
# shellcheck source=/dev/null
. "$WORK/manifest.env"
echo "built $BUNDLE_BUILT from commit $BUNDLE_COMMIT in $BUNDLE_BUILD_ROOT ($BUNDLE_FEATURES)"
commit=$BUNDLE_COMMIT
if head=$(git -C "$ROOT" rev-parse --short=12 HEAD 2>/dev/null) && [ "${commit%%+*}" != "$head" ]; then
    echo "note: this checkout is at $head, the bundle was built from $commit"
    commit="$commit (checkout at $head)"
fi

# ---------------------------------------------------------------------------------------------
# The machine: GPU, driver, CUDA, and the libraries the loader must find.

if [ $CPU = 0 ] && ! command -v nvidia-smi >/dev/null; then
    echo "run.sh: no nvidia-smi on this machine; use --cpu for the rehearsal without a GPU" >&2
    exit 2
fi
n_gpus=0
gpu="none"
driver="n/a"
cuda="n/a"
if [ $CPU = 0 ]; then
    n_gpus=$(nvidia-smi -L | grep -c '^GPU')
    gpu=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader -i 0 | sed 's/, / (/; s/$/)/')
    driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader -i 0)
    cuda=$(nvidia-smi | grep -o 'CUDA Version: [0-9.]*' | awk '{print $3}')
fi
# NVRTC sits in the toolkit's lib64, which is not on the loader's path there; libnccl.so.2 and
# (on a machine without the toolkit) NVRTC come with the Python's `nvidia` packages.
libs=()
[ -d /usr/local/cuda/lib64 ] && libs+=(/usr/local/cuda/lib64)
while IFS= read -r d; do libs+=("$d"); done < <("$PYTHON" - <<'EOF' 2>/dev/null
import glob, os
try:
    import nvidia
except ImportError:
    raise SystemExit
for p in nvidia.__path__:
    for lib in sorted(glob.glob(os.path.join(p, "*", "lib"))):
        if any(glob.glob(os.path.join(lib, f"lib{n}.so*")) for n in ("nccl", "nvrtc", "cublas")):
            print(lib)
EOF
)
if [ ${#libs[@]} -gt 0 ]; then
    LD_LIBRARY_PATH=$(IFS=:; echo "${libs[*]}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export LD_LIBRARY_PATH
fi
# NVRTC's version from its file name (libnvrtc.so.13.0.88 in a toolkit, libnvrtc.so.12 from pip)
nvrtc=$(for d in "${libs[@]+"${libs[@]}"}"; do ls "$d"/libnvrtc.so.* 2>/dev/null; done |
    awk '{print length, $0}' | sort -rn | head -1 | sed 's/.*libnvrtc\.so\.//')
DATE=$(date -u '+%Y-%m-%d %H:%M UTC')
if [ $CPU = 1 ]; then
    what="no GPU (--cpu rehearsal: CUDA steps skipped, benches on cpu with a smaller model)"
else
    what="$gpu, driver $driver, CUDA $cuda"
fi
HEADER="Run $DATE on $(hostname): $what; NVRTC ${nvrtc:-not found}; commit $commit; bundle built $BUNDLE_BUILT."
export WEIGHTLIFT_RUN_HEADER=$HEADER
echo "$HEADER"
echo "python: $PYTHON; loader path: ${LD_LIBRARY_PATH:-}"

# The wheel, into a folder of its own on PYTHONPATH (abi3: any Python from 3.10).
if "$PYTHON" -m pip install -q --no-deps --no-index --disable-pip-version-check \
    --target "$WORK/site" "$WORK"/wheel/*.whl; then
    export PYTHONPATH=$WORK/site${PYTHONPATH:+:$PYTHONPATH}
else
    echo "run.sh: pip could not install the wheel into $WORK/site"
    FAILED+=("wheel install")
fi
# What the package finds: `weightlift.cuda_info()` (its own search for the driver, NVRTC and
# libcublas, each a path and version or why not), and where the loader then mapped libcublasLt
# from (libcublas's own dependency, which the package does not look for: found beside it or on
# the loader path). Once without the loader path above (cuda_info.json: what a machine finds by
# itself; the steps keep the loader path, so a search that misses costs this line, not the run)
# and once with it (cuda_info_steps.json: what the steps below run with, where a missing
# libcublas means prompts on the slower kernels without cuBLAS).
CUDA_PROBE=$(
    cat <<'EOF'
import json
import os

import weightlift

info = weightlift.cuda_info()
maps = []
try:
    with open("/proc/self/maps") as f:
        maps = [line.split(maxsplit=5)[-1].strip() for line in f if len(line.split()) == 6]
except OSError:
    pass
lt = next((p for p in maps if os.path.basename(p).startswith("libcublasLt.so")), None)
info["cublasLt"] = {"path": lt} if lt else {"error": "not loaded with libcublas"}
print(json.dumps(info, default=str))
EOF
)
env -u LD_LIBRARY_PATH "$PYTHON" -c "$CUDA_PROBE" >"$OUT/cuda_info.json" 2>&1 || true
"$PYTHON" -c "$CUDA_PROBE" >"$OUT/cuda_info_steps.json" 2>&1 || true
echo "the package's own CUDA search, without LD_LIBRARY_PATH: $(cat "$OUT/cuda_info.json")"
echo "with the steps' LD_LIBRARY_PATH: $(cat "$OUT/cuda_info_steps.json")"

# ---------------------------------------------------------------------------------------------
# Test data. The binaries read it through CARGO_MANIFEST_DIR paths compiled in on the build
# machine, under BUNDLE_BUILD_ROOT. Where that folder is absent, lay it out: real folders down to
# each crate holding links to this checkout's files (a single link to the checkout would not do:
# a path that climbs out with `..` would then climb out of the checkout, not the link), and the
# reference files at `.cache/reference` inside it, unless something is there already
# (the tests also find them through WEIGHTLIFT_REFERENCE).

export WEIGHTLIFT_REFERENCE=$WORK/reference

# Makes folder $1 where it is absent, and remembers the first folder made on the way for
# removal at exit (nothing that was there before is ever removed).
make_path() {
    [ -e "$1" ] && return 0
    local top=$1
    while [ ! -e "$(dirname "$top")" ]; do top=$(dirname "$top"); done
    mkdir -p "$1" || return 1
    MADE+=("$top")
}

# Links to every entry of folder $1 (but those named in $3) inside folder $2.
link_entries() {
    local e
    for e in "$1"/* "$1"/.[!.]*; do
        [ -e "$e" ] || continue
        case " $3 " in *" $(basename "$e") "*) continue ;; esac
        ln -s "$e" "$2/"
    done
}

lay_out_build_root() {
    local b=$BUNDLE_BUILD_ROOT c
    if [ "$(cd "$b" 2>/dev/null && pwd -P)" = "$(cd "$ROOT" && pwd -P)" ]; then
        echo "test data: the binaries' build folder is this checkout"
    elif [ -e "$b" ]; then
        echo "note: $b exists and is not this checkout: the tests read the data there"
    else
        make_path "$b" || return 1
        link_entries "$ROOT" "$b" "crates"
        for c in "$ROOT"/crates/*/; do
            c=$(basename "$c")
            mkdir -p "$b/crates/$c"
            link_entries "$ROOT/crates/$c" "$b/crates/$c" ""
        done
        echo "test data: laid out $b with links to this checkout"
    fi
    if [ ! -e "$b/.cache" ]; then
        make_path "$b/.cache" && ln -s "$WEIGHTLIFT_REFERENCE" "$b/.cache/reference"
    fi
}
lay_out_build_root || FAILED+=("test data layout")

# shellcheck disable=SC2086  # the file list splits on whitespace
"$PYTHON" "$ROOT/tests/reference/materialize.py" "$WEIGHTLIFT_REFERENCE" $REFERENCE_FILES ||
    FAILED+=("reference files (materialize.py)")

# ---------------------------------------------------------------------------------------------
# 1. The tests.

step "tests"
printf 'suite\targs\tresult\tseconds\n' >"$WORK/tests.tsv"
RUN_TESTS=1
wants tests "the GPU tests" || RUN_TESTS=0
declare -A FAILS=()
run_suite() {
    local crate=$1 suite=$2 mode=$3 args=() log="$WORK/logs/$suite.log" t0 rc summary limit
    in_budget "$crate $suite" "$SUITE_MIN_S" || return 0
    limit=$(capped "$SUITE_TIMEOUT_S")
    case $mode in
    ignored) args=(--ignored) ;;
    include-ignored) args=(--include-ignored) ;;
    esac
    # The engine's GPU tests one at a time: one of them compares the driver's used memory with
    # the plan, which only holds while no other test of the process allocates on the device.
    [ "$crate" = weightlift-engine ] && args+=(--test-threads=1)
    mkdir -p "$WORK/logs"
    echo "-- $crate $suite ${args[*]}"
    t0=$(date +%s)
    (cd "$BUNDLE_BUILD_ROOT/crates/$crate" &&
        timeout "$limit" "$WORK/bin/$suite" "${args[@]}") >"$log" 2>&1
    rc=$?
    cat "$log"
    summary=$(grep '^test result:' "$log" | tail -1 | sed 's/^test result: //; s/; finished in.*//')
    [ $rc = 124 ] && summary="timed out after $limit s"
    [ -n "$summary" ] || summary="exit status $rc"
    if [ $rc != 0 ]; then
        FAILED+=("$crate $suite")
        FAILS[$suite]=$log
    fi
    printf '%s %s\t%s\t%s\t%s\n' "$crate" "$suite" "${args[*]:-(no flags)}" "$summary" \
        "$(($(date +%s) - t0))" >>"$WORK/tests.tsv"
}
while read -r crate suite gpu_mode cpu_mode needs; do
    [ -n "$crate" ] && [ $RUN_TESTS = 1 ] || continue
    name="$crate $suite"
    if [ -n "$SUITES" ] && [[ ",$SUITES," != *",$suite,"* ]]; then
        skip "not in SUITES ($SUITES): $name"
        continue
    fi
    if [ $CPU = 1 ]; then
        if [ "$cpu_mode" = skip ]; then
            skip "no GPU: $name (${gpu_mode} tests)"
            continue
        fi
        [ "$gpu_mode" = all ] || skip "no GPU: $name (its ignored CUDA tests; the others run)"
        run_suite "$crate" "$suite" "$cpu_mode"
        continue
    fi
    case $needs in
    2gpu) if [ "$n_gpus" -lt 2 ]; then
        skip "needs two GPUs, this machine has $n_gpus: $name"
        continue
    fi ;;
    esac
    run_suite "$crate" "$suite" "$gpu_mode"
done <<<"$GPU_TESTS"

{
    echo "# GPU tests"
    echo
    echo "$HEADER"
    echo
    echo "| suite | run with | result | s |"
    echo "|---|---|---|---:|"
    tail -n +2 "$WORK/tests.tsv" | awk -F'\t' '{printf "| %s | `%s` | %s | %s |\n", $1, $2, $3, $4}'
    if [ ${#SKIPPED[@]} -gt 0 ]; then
        echo
        for s in "${SKIPPED[@]}"; do echo "- skipped: $s"; done
    fi
    for suite in "${!FAILS[@]}"; do
        echo
        echo "## $suite: failures"
        echo
        echo '```'
        grep -E '^test .* FAILED$|panicked at|^---- ' "${FAILS[$suite]}" | head -40
        awk '/^failures:$/ {p = 1} p' "${FAILS[$suite]}" | head -80
        echo '```'
    done
} >"$OUT/tests.md"

# ---------------------------------------------------------------------------------------------
# 2. The CUDA kernel bench.

step "kernel bench"
rc=0
if ! wants kernels "the kernel bench"; then
    :
elif [ $CPU = 1 ]; then
    skip "no GPU: kernels_cuda on cuda:0 (its cases run on the cpu backend instead, quick)"
    WEIGHTLIFT_BENCH_QUICK=1 timeout "$(capped "$BENCH_TIMEOUT_S")" "$WORK/bin/kernels_cuda" \
        --device cpu --out "$OUT"
else
    timeout "$(capped "$BENCH_TIMEOUT_S")" "$WORK/bin/kernels_cuda" --device cuda --out "$OUT"
fi
rc=$?
[ $rc = 0 ] || FAILED+=("kernel bench (exit status $rc)")
if [ $rc = 0 ] && [[ ",$STEPS," == *,kernels,* ]] && ! ls "$OUT"/kernels_cuda*.md >/dev/null 2>&1; then
    FAILED+=("kernel bench (timed nothing)")
fi
for f in "$OUT"/kernels_cuda*.md; do
    [ -f "$f" ] && { printf '%s\n\n' "$HEADER"; cat "$f"; } >"$f.tmp" && mv "$f.tmp" "$f"
done

# ---------------------------------------------------------------------------------------------
# 3. The end-to-end bench.

step "end-to-end bench"
if wants e2e "the end-to-end bench"; then
    e2e=(--out "$OUT" --budget-s "$(bench_budget "$E2E_BUDGET_S")" --only "$WEIGHTS")
    if [ $CPU = 1 ]; then e2e+=(--cpu); else e2e+=(--device cuda:0); fi
    WEIGHTLIFT_CUDA_GRAPHS=1 PYTHONUNBUFFERED=1 timeout "$(capped "$E2E_TIMEOUT_S")" "$PYTHON" \
        "$ROOT/benches/gpu/e2e.py" "${e2e[@]}"
    rc=$?
    [ $rc = 0 ] || FAILED+=("end-to-end bench (exit status $rc)")
fi

# The A/B of the prompt products: the same prefills (512 and 2,048 tokens) without cuBLAS, on
# the kernels prompts took before (the dequantised chunks and gemm_f32, the Q8 kernels), for
# bf16 and q4_k, into prefill-no-cublas/e2e.md. The prompt attention kernel is the same in both.
step "prefill without cuBLAS (A/B)"
if [ $CPU = 1 ]; then
    skip "no GPU: the prefill A/B without cuBLAS"
elif wants prefill_ab "the prefill A/B without cuBLAS"; then
    ab_only=bf16,q4_k
    [ -n "$WEIGHTS" ] && ab_only=$WEIGHTS
    WEIGHTLIFT_CUBLAS=0 PYTHONUNBUFFERED=1 timeout "$(capped "$PREFILL_AB_TIMEOUT_S")" "$PYTHON" \
        "$ROOT/benches/gpu/e2e.py" --device cuda:0 --prefill-only --only "${ab_only/transformers/}" \
        --budget-s "$(bench_budget "$PREFILL_AB_BUDGET_S")" --out "$OUT/prefill-no-cublas" ||
        FAILED+=("prefill A/B without cuBLAS (exit status $?)")
fi

# The A/B of the decode step: the same decodes (after 64 and 2,048 positions) with every kernel
# launched from the host (WEIGHTLIFT_CUDA_GRAPHS=0), where the end-to-end rows and the profile
# replay each step from a captured CUDA graph, for bf16 and q4_k, into decode-no-graphs/e2e.md.
step "decode without CUDA graphs (A/B)"
if [ $CPU = 1 ]; then
    skip "no GPU: the decode A/B without CUDA graphs"
elif wants graphs_ab "the decode A/B without CUDA graphs"; then
    ab_only=bf16,q4_k
    [ -n "$WEIGHTS" ] && ab_only=$WEIGHTS
    WEIGHTLIFT_CUDA_GRAPHS=0 PYTHONUNBUFFERED=1 timeout "$(capped "$GRAPHS_AB_TIMEOUT_S")" "$PYTHON" \
        "$ROOT/benches/gpu/e2e.py" --device cuda:0 --decode-only --only "${ab_only/transformers/}" \
        --budget-s "$(bench_budget "$GRAPHS_AB_BUDGET_S")" --out "$OUT/decode-no-graphs" ||
        FAILED+=("decode A/B without CUDA graphs (exit status $?)")
fi

# The A/B of decode's Q4_K kernels: the q4_k decodes (after 64 and 2,048 positions, from CUDA
# graphs as the end-to-end rows) with the narrow lanes (WEIGHTLIFT_Q8V=narrow:
# q8_matvec_{q4_k,q6_k} and swiglu_q8_matvec_{q4_k,q6_k}), into decode-q8v-narrow/e2e.md; the
# end-to-end rows are the wide lanes, the default.
step "decode with the narrow Q4_K lanes (A/B)"
if [ $CPU = 1 ]; then
    skip "no GPU: the decode A/B with the narrow Q4_K lanes"
elif wants q8v_ab "the decode A/B with the narrow Q4_K lanes"; then
    WEIGHTLIFT_Q8V=narrow WEIGHTLIFT_CUDA_GRAPHS=1 PYTHONUNBUFFERED=1 timeout "$(capped "$Q8V_AB_TIMEOUT_S")" \
        "$PYTHON" "$ROOT/benches/gpu/e2e.py" --device cuda:0 --decode-only --only q4_k \
        --budget-s "$(bench_budget "$Q8V_AB_BUDGET_S")" --out "$OUT/decode-q8v-narrow" ||
        FAILED+=("decode A/B with the narrow Q4_K lanes (exit status $?)")
fi

# ---------------------------------------------------------------------------------------------
# 3b. The offload bench: 1 GiB of GPU, the rest of the same checkpoint in host RAM, against
# accelerate.

step "offload bench"
if wants offload "the offload bench"; then
    off=(--out "$OUT" --budget-s "$(bench_budget "$OFFLOAD_BUDGET_S")")
    if [ $CPU = 1 ]; then off+=(--cpu); else off+=(--device cuda:0); fi
    PYTHONUNBUFFERED=1 timeout "$(capped "$OFFLOAD_TIMEOUT_S")" "$PYTHON" "$ROOT/benches/gpu/offload_e2e.py" "${off[@]}"
    rc=$?
    [ $rc = 0 ] || FAILED+=("offload bench (exit status $rc)")
fi

# ---------------------------------------------------------------------------------------------
# 3c. The MoE bench: a Mixtral-shaped model with its experts in host RAM (n_cpu_moe) against
# weight offload (offload="sequential") and accelerate, the experts not fitting the GPU's share.

step "MoE bench"
if wants moe "the MoE bench"; then
    moe=(--out "$OUT" --budget-s "$(bench_budget "$MOE_BUDGET_S")")
    if [ $CPU = 1 ]; then moe+=(--cpu); else moe+=(--device cuda:0); fi
    PYTHONUNBUFFERED=1 timeout "$(capped "$MOE_TIMEOUT_S")" "$PYTHON" "$ROOT/benches/gpu/moe_offload.py" "${moe[@]}"
    rc=$?
    [ $rc = 0 ] || FAILED+=("MoE bench (exit status $rc)")
fi

# ---------------------------------------------------------------------------------------------
# 3d. The batched decode bench: 1 to 32 sequences stepped together (Model.forward_batch) on
# the end-to-end bench's checkpoint, what `weightlift serve --parallel N` asks of the device.

step "batched decode bench"
if wants batch "the batched decode bench"; then
    bat=(--out "$OUT" --budget-s "$(bench_budget "$BATCH_BUDGET_S")")
    if [ $CPU = 1 ]; then bat+=(--cpu); else bat+=(--device cuda:0); fi
    WEIGHTLIFT_CUDA_GRAPHS=1 PYTHONUNBUFFERED=1 timeout "$(capped "$BATCH_TIMEOUT_S")" "$PYTHON" \
        "$ROOT/benches/gpu/batch_e2e.py" "${bat[@]}"
    rc=$?
    [ $rc = 0 ] || FAILED+=("batched decode bench (exit status $rc)")
fi

# ---------------------------------------------------------------------------------------------
# 4. The kernel profile (GPU only: torch.profiler), on the end-to-end bench's checkpoint.

step "kernel profile"
if [ $CPU = 1 ]; then
    skip "no GPU: the kernel profile"
elif wants profile "the kernel profile"; then
    WEIGHTLIFT_CUDA_GRAPHS=1 PYTHONUNBUFFERED=1 timeout "$(capped "$PROFILE_TIMEOUT_S")" "$PYTHON" \
        "$ROOT/benches/gpu/kernel_profile.py" \
        --device cuda:0 --out "$OUT" --only "$WEIGHTS" || FAILED+=("kernel profile (exit status $?)")
fi

# ---------------------------------------------------------------------------------------------

step "summary"
"$PYTHON" "$ROOT/benches/gpu/summary.py" --out "$OUT" --tests "$WORK/tests.tsv" \
    --failed "$(printf '%s\n' "${FAILED[@]+"${FAILED[@]}"}")" \
    --skipped "$(printf '%s\n' "${SKIPPED[@]+"${SKIPPED[@]}"}")" || FAILED+=("summary")
echo "results: $OUT"
[ ${#FAILED[@]} -eq 0 ]
