#!/usr/bin/env bash
# Builds the GPU bundle (`make gpu-bundle` calls this): on any machine, GPU or not, a folder
# (default gpu-bundle/ in the checkout, which git ignores) that the GPU machine receives beside
# the checkout, and that benches/gpu/run.sh runs there:
#   bundle.tar.xz   the release test binaries and bench binaries run.sh lists, built with the
#                   `gpu-bundle` profile (release, stripped); the wheel (`--features cuda,nccl`,
#                   the same profile); manifest.env (the
#                   commit, the build folder the binaries' data paths start from, the date)
#   run.sh          a copy of benches/gpu/run.sh
# It fails when the bundle and the checkout (without .git, target, .venv, .cache and the bundle
# folder itself) come to more than LIMIT_MIB together: what the GPU machine is sent has to fit.
#
# The reference files the tests read are not in it: run.sh lays them out there from the
# checkout's tests/reference (which travels anyway) with the bundle's wheel.
#
# Environment: MATURIN (default maturin), PYTHON (python3),
# GPU_BUNDLE_DIR (the output folder).
set -euo pipefail

LIMIT_MIB=64
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
OUT=${GPU_BUNDLE_DIR:-$ROOT/gpu-bundle}
STAGE=$ROOT/target/gpu-bundle/stage
MATURIN=${MATURIN:-maturin}
PYTHON=${PYTHON:-python3}
FEATURES=weightlift-kernels/cuda,weightlift-engine/cuda,weightlift-engine/nccl,weightlift-benches/cuda
WHEEL_FEATURES=cuda,nccl

rm -rf "$STAGE"
mkdir -p "$STAGE/bin" "$STAGE/wheel"
list=$(benches/gpu/run.sh --list)
suites=$(awk '$1 == "test" {print $3}' <<<"$list")
benches=$(awk '$1 == "bench" {print $2}' <<<"$list")

echo "== test and bench binaries (profile gpu-bundle)"
targets=()
for s in $suites; do targets+=(--test "$s"); done
for b in $benches; do targets+=(--bench "$b"); done
cargo test --profile gpu-bundle --no-run --message-format=json-render-diagnostics \
    -p weightlift-kernels -p weightlift-engine -p weightlift-benches --features "$FEATURES" \
    "${targets[@]}" >"$STAGE/cargo-messages.json"
# Each wanted target's executable, from cargo's messages (their file names carry a hash).
"$PYTHON" - "$STAGE/cargo-messages.json" "$STAGE/bin" $suites $benches <<'EOF'
import json, shutil, sys
messages, dest, wanted = sys.argv[1], sys.argv[2], set(sys.argv[3:])
found = {}
for line in open(messages):
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        name = m["target"]["name"]
        if name in wanted:
            found[name] = m["executable"]
missing = wanted - set(found)
if missing:
    sys.exit(f"bundle: cargo built no executable for {sorted(missing)}")
for name, exe in sorted(found.items()):
    shutil.copy2(exe, f"{dest}/{name}")
EOF
rm "$STAGE/cargo-messages.json"

echo "== wheel (--features $WHEEL_FEATURES, profile gpu-bundle)"
"$MATURIN" build --profile gpu-bundle --features "$WHEEL_FEATURES" --out "$STAGE/wheel"


commit=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
if [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
    commit="$commit+uncommitted"
fi
cat >"$STAGE/manifest.env" <<EOF
BUNDLE_COMMIT='$commit'
BUNDLE_BUILT='$(date -u '+%Y-%m-%d %H:%M UTC')'
BUNDLE_BUILD_ROOT='$ROOT'
BUNDLE_FEATURES='test binaries: $FEATURES; wheel: $WHEEL_FEATURES'
EOF

echo "== compress"
rm -rf "$OUT"
mkdir -p "$OUT"
tar -C "$STAGE" -cf - . | xz -T0 -9 >"$OUT/bundle.tar.xz"
cp benches/gpu/run.sh "$OUT/run.sh"

# What travels: the bundle, and the files of the checkout git tracks or would track (what the
# GPU machine is sent of a working tree; ignored build outputs stay behind).
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
bundle_bytes=$(du -sb "$OUT" | cut -f1)
rel_out=$(realpath --relative-to="$ROOT" "$OUT")
checkout_bytes=$(git ls-files -z --cached --others --exclude-standard |
    xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
total=$((bundle_bytes + checkout_bytes))
echo "bundle: $(du -sh "$STAGE/bin" | cut -f1) of binaries, $(du -sh "$STAGE/wheel" | cut -f1) wheel before compression"
echo "size: bundle $(mib "$bundle_bytes") + checkout $(mib "$checkout_bytes") = $(mib "$total") (limit $LIMIT_MIB MiB)"
if [ "$total" -gt $((LIMIT_MIB << 20)) ]; then
    echo "bundle: over the $LIMIT_MIB MiB the GPU machine accepts" >&2
    exit 1
fi
echo "ready: send the checkout with $rel_out, then run $rel_out/run.sh --out DIR there"
