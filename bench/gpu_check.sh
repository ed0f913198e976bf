#!/usr/bin/env bash
# One-shot GPU check for tritonkv: the `gpu`-marked tests (kernels; vLLM's CUDA caches from
# tests/data/cuda_geometry.json: FlashMLA / Triton MLA pages, a gated-delta-net hybrid's state
# pages over FlashAttention's; CUDA tensors on every transport), the connector's worker sides
# on one GPU (two processes, as vLLM drives them), a reduced benchmark (do_bench + autotune) and
# a profiler count of kernel launches, in under 8 minutes, into at most 10 files in OUTDIR:
#   gpu_check.log  everything printed (versions, nvidia-smi, test summary, tables, goal summary)
#   pytest.log     the gpu tests' output
#   workers.log    the worker sides' gpu tests: a producer and a consumer process on one GPU
#                  (socket and gloo, FlashAttention-shaped bf16 caches, sync-debug mode "error"
#                  around the connector's calls, a CUDA graph reading the loaded blocks, injected
#                  allocation failures), and both sides in one process with the KV buffer on
#                  the host and on the device (tests/vllm_connector/test_two_workers.py,
#                  test_gpu_step.py), the hidden states' path (test_hidden_gpu_step.py);
#                  --dry-run: their CPU variants
#   bench.csv      the reduced benchmark, schema of bench/common.py (COLUMNS)
#   tokens.png     tokens sweep: GB/s and fraction of copy, per op and case
#   seqs.png       seqs sweep: ms and speed-up over the loop
#   autotune.json  the winning Triton config per op and case
#   profile.txt    kernels seen by torch.profiler for one pack_kv over 32 layers (expect one copy)
#   host_overhead.txt  host time per small call (plain and prepared layers) and its cProfile
#   hidden.txt     hidden-state extraction in process: tritonkv's one pack of a step's requests
#                  (and the connector's whole path) vs ExampleHiddenStatesConnector's per-request
#                  copies, tokens/s and ratios (bench/hidden_extract.py)
#   (gpu_check.log also gets bench/bench_staging.py's lines: CUDA tensors over gloo and socket,
#   staged in pieces vs copied whole first vs host tensors, and bench/bench_umac.py's: the keyed
#   payload hash vs the keyless digest vs a plain copy of a 4096-token packed KV)
#
# Usage: bench/gpu_check.sh [--dry-run] OUTDIR
#   Needs one NVIDIA GPU, torch, triton and NumPy; no network, no vllm (matplotlib/pandas/pytest/
#   safetensors optional: without them the PNGs / tables / tests / file-way tests are skipped and
#   the log says so).
#   --dry-run: run every step on the CPU with tiny sizes (checks the script, not the GPU).
#   PYTHON=/path/to/python selects the interpreter (default: python3). Without pytest there, run
#   `make gpu-deps` on a machine with a package index and bring .gpu_deps/ along. The committed
#   results of an H200 are in bench/results/h200/ (run with that folder as OUTDIR).
set -euo pipefail

DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then
    DRY=1
    shift
fi
OUTDIR=${1:?usage: bench/gpu_check.sh [--dry-run] OUTDIR}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
TOTAL_S=470      # hard limit for the whole script (< 8 min: the device run is 10 min at most)
TESTS_S=180      # the gpu tests (compiling kernels takes most of this time)
WORKERS_S=180    # the worker sides' gpu tests (two processes start CUDA and compile each)
HOST_S=40        # host time per call (bench/host_overhead.py: the table, prepared and plain)
STAGING_S=25     # CUDA tensors over gloo and socket (bench/bench_staging.py: 3 rounds of 256 MiB)
HIDDEN_S=35      # hidden-state extraction in process (bench/hidden_extract.py, ~25 s timed)
UMAC_S=35        # the keyed payload hash vs digest vs copy (bench/bench_umac.py, 4096 tokens, 12 rows)
BENCH_S=140      # the reduced benchmark and launch count (what they had before the workers' step)
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)

main() {
cd "$REPO"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
# pytest from `make gpu-deps`, for a GPU machine without it (appended: an installed one wins)
[[ -d "$REPO/.gpu_deps" ]] && export PYTHONPATH="$PYTHONPATH:$REPO/.gpu_deps"
export MPLBACKEND=Agg
unset TRITONKV_KERNELS TRITON_INTERPRET

echo "== tritonkv gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) dry_run=$DRY"
echo "command: bench/gpu_check.sh $([[ $DRY == 1 ]] && echo '--dry-run ')$OUTDIR"
echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
else
    echo "nvidia-smi: not found"
fi
"$PY" - <<'EOF'
import sys, torch, triton
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}")
print(f"cuda available: {torch.cuda.is_available()}"
      + (f", device: {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))
for mod in ("numpy", "pytest", "pytest_timeout", "safetensors", "pandas", "matplotlib"):
    try:
        __import__(mod)
        print(f"{mod}: yes")
    except ImportError:
        print(f"{mod}: missing")
EOF
if [[ $DRY == 0 ]] && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "no CUDA GPU visible: run with --dry-run to check the script on a CPU"
    exit 2
fi

# pytest_step NAME LOG LIMIT_S MUST_PASS PYTEST_ARGS...: one pytest run into OUTDIR/LOG under
# LIMIT_S, one verdict line, status=1 on a failure (MUST_PASS 1: and when none passed).
pytest_step() {
    local name=$1 log=$2 limit=$3 must_pass=$4 rc=0
    shift 4
    if ! "$PY" -c "import pytest" 2>/dev/null; then
        echo "pytest missing: $name NOT run (put pytest on PYTHONPATH)" | tee "$OUTDIR/$log"
        [[ $DRY == 1 ]] || status=1
        return 0
    fi
    # One launch config per kernel key (TRITONKV_AUTOTUNE=0): the tests check correctness, and
    # tuning each of their keys would not fit the limit; the benchmark below autotunes.
    TRITONKV_AUTOTUNE=0 timeout -k 5 "$limit" "$PY" -m pytest -v -p no:cacheprovider "$@" \
        >"$OUTDIR/$log" 2>&1 || rc=$?
    tail -n 15 "$OUTDIR/$log"
    if [[ $rc == 124 || $rc == 137 ]]; then
        echo "$name: TIMED OUT after ${limit} s ($log names the tests that ran)"
        status=1
    elif [[ $rc != 0 ]]; then
        echo "$name: FAILED (exit $rc)"
        status=1
    elif [[ $must_pass == 1 ]] && ! grep -q " passed" "$OUTDIR/$log"; then
        echo "$name: FAILED (none passed: all skipped?)"
        status=1
    else
        echo "$name: passed"
    fi
}

status=0
echo
echo "== 1/5 gpu tests (limit ${TESTS_S} s)"
# (in a dry run every one of them is skipped: nothing must pass)
pytest_step "gpu tests" pytest.log "$TESTS_S" "$((1 - DRY))" -m gpu \
    tests/kernels/test_gpu.py tests/kernels/test_autotune.py tests/kernels/test_state.py \
    tests/kernels/test_umac.py tests/kernels/test_kv_nh.py tests/transport/test_pipe_gpu.py \
    tests/vllm_connector/test_cuda_geometry.py

echo
echo "== 2/5 worker sides on one GPU (limit ${WORKERS_S} s)"
# a dry run runs the same checks on the CPU: the sides' GPU path on stand-in streams
pytest_step "worker sides" workers.log "$WORKERS_S" 1 -m "$([[ $DRY == 1 ]] && echo 'not gpu' || echo gpu)" \
    tests/vllm_connector/test_two_workers.py tests/vllm_connector/test_gpu_step.py \
    tests/vllm_connector/test_hidden_gpu_step.py

echo
echo "== 3/5 host time per call (limit ${HOST_S} s), staging (limit ${STAGING_S} s), keyed hash (limit ${UMAC_S} s)"
rc=0
dry_flag=()
[[ $DRY == 1 ]] && dry_flag=(--dry-run)
TRITONKV_AUTOTUNE=0 timeout -k 5 "$HOST_S" "$PY" -m bench.host_overhead --out "$OUTDIR/host_overhead.txt" \
    --top 12 ${dry_flag[@]+"${dry_flag[@]}"} >/dev/null 2>&1 || rc=$?
if [[ $rc != 0 ]]; then
    echo "host overhead: exit $rc$([[ $rc == 124 || $rc == 137 ]] && echo ' (timed out)')"
    status=1
else
    grep -E "^==|us/call" "$OUTDIR/host_overhead.txt" | head -n 40 || true
fi
rc=0
staging_out=$(mktemp)
timeout -k 5 "$STAGING_S" "$PY" -m bench.bench_staging --mib 256 --rounds 3 \
    ${dry_flag[@]+"${dry_flag[@]}"} >"$staging_out" 2>&1 || rc=$?
grep -E "^(staging|bench_staging)" "$staging_out" || true
if [[ $rc != 0 ]]; then
    tail -n 5 "$staging_out"
    echo "staging: exit $rc$([[ $rc == 124 || $rc == 137 ]] && echo ' (timed out)')"
    status=1
fi
rm -f "$staging_out"
rc=0
umac_out=$(mktemp)
timeout -k 5 "$UMAC_S" "$PY" -m bench.bench_umac --tokens 4096 --quick \
    ${dry_flag[@]+"${dry_flag[@]}"} >"$umac_out" 2>&1 || rc=$?
grep -E "^bench_umac" "$umac_out" || true
if [[ $rc != 0 ]]; then
    tail -n 5 "$umac_out"
    echo "umac: exit $rc$([[ $rc == 124 || $rc == 137 ]] && echo ' (timed out)')"
    status=1
fi
rm -f "$umac_out"

echo
echo "== 4/5 hidden-state extraction in process (limit ${HIDDEN_S} s)"
rc=0
TRITONKV_AUTOTUNE=0 timeout -k 5 "$HIDDEN_S" "$PY" -m bench.hidden_extract --out "$OUTDIR/hidden.txt" \
    --budget-s 1.5 ${dry_flag[@]+"${dry_flag[@]}"} >/dev/null 2>&1 || rc=$?
if [[ $rc != 0 ]]; then
    echo "hidden extraction: exit $rc$([[ $rc == 124 || $rc == 137 ]] && echo ' (timed out)')"
    status=1
else
    cat "$OUTDIR/hidden.txt"
fi

left=$((TOTAL_S - SECONDS))
(( left > BENCH_S )) && left=$BENCH_S
echo
echo "== 5/5 reduced benchmark + launch count (limit ${left} s; nothing new starts after $((left - 50)) s)"
rc=0
timeout -k 5 "$left" "$PY" -m bench.bench_kv --suite gpu-check --outdir "$OUTDIR" \
    --deadline-s "$((left - 50))" ${dry_flag[@]+"${dry_flag[@]}"} || rc=$?
if [[ $rc != 0 ]]; then
    echo "benchmark: exit $rc$([[ $rc == 124 || $rc == 137 ]] && echo ' (timed out)')"
    status=1
fi

echo
nfiles=$(find "$OUTDIR" -maxdepth 1 -type f | wc -l)
echo "== done in ${SECONDS} s; ${nfiles} files in $OUTDIR (exit $status):"
ls -1 "$OUTDIR"
return $status
}

# Everything printed also goes to gpu_check.log; the script's exit status is main's.
main 2>&1 | tee "$OUTDIR/gpu_check.log"
exit "${PIPESTATUS[0]}"
