#!/usr/bin/env bash
# The GPU check of issue 31, for a person with one CUDA GPU: about 8 minutes.
#
#   scripts/gpu_check.sh [OUT_DIR]          # default: runs/gpu-check-<UTC date and time>
#
# 1. the GPU suite (tests/gpu/, `pytest -m gpu`): every layout in a world of one over NCCL, worlds
#    of 2-4 ranks on one GPU over gloo with host-staged collectives, offload, 8-bit Adam,
#    checkpoints and generate on CUDA, fp32 and bf16 equivalence with one process;
# 2. `python -m shardwise.bench.gpu`: GPT 1.3B then 350M in bf16, each case against the plain
#    PyTorch loop (or DDP / FSDP2) in the same process, alternately; MFU, tokens/s, peak
#    max_memory_allocated against the memory ledger; one JSON per run in OUT_DIR/bench/rows/.
#
# Needs: torch with CUDA, pytest, pytest-timeout (pytest-xdist used when present), and this
# checkout importable (an installed shardwise, or run from the checkout's root). Environment:
# SUITE_S (default 200) and BENCH_S (default 330) bound each part in seconds; runs that would
# start after a part's budget are listed as skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-runs/gpu-check-$(date -u +%Y%m%d-%H%M%S)}"
SUITE_S="${SUITE_S:-200}"
BENCH_S="${BENCH_S:-330}"
mkdir -p "$OUT_DIR"
python3 -c "import shardwise" 2>/dev/null || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PYTORCH_NVML_BASED_CUDA_CHECK=1
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device (torch.cuda.is_available() is False); nothing to check" >&2
    exit 2
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
} | tee "$OUT_DIR/machine.txt"

echo "== 1/2 GPU suite (pytest -m gpu, at most ${SUITE_S} s)"
XDIST=()
python3 -c "import xdist" 2>/dev/null && XDIST=(-n 4)
timeout "$SUITE_S" python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider "${XDIST[@]}" \
    --junitxml="$OUT_DIR/suite.xml" 2>&1 | tee "$OUT_DIR/suite.log"
SUITE_RC=${PIPESTATUS[0]}
echo "gpu_check: suite exit code $SUITE_RC" | tee -a "$OUT_DIR/suite.log"

echo "== 2/2 bench (python -m shardwise.bench.gpu, at most ${BENCH_S} s)"
# 1.3B first (every case; the compiled case as two alternating pairs), then 350M
timeout $((BENCH_S - 70)) python3 -m shardwise.bench.gpu --out "$OUT_DIR/bench-1.3b" --sizes 1.3b \
    --cases compiled,eager,checkpointing,adamw8bit,zero1-offload,zero3-nccl,ddp-nccl \
    --steps 10 --reps 2 --reps-for compiled --budget-s $((BENCH_S - 110)) 2>&1 | tee "$OUT_DIR/bench.log"
BENCH_RC=${PIPESTATUS[0]}
timeout 70 python3 -m shardwise.bench.gpu --out "$OUT_DIR/bench-350m" --sizes 350m \
    --cases compiled,eager --steps 10 --budget-s 40 2>&1 | tee -a "$OUT_DIR/bench.log"
BENCH_RC=$(( BENCH_RC | PIPESTATUS[0] ))
echo "gpu_check: bench exit code $BENCH_RC; results in $OUT_DIR" | tee -a "$OUT_DIR/bench.log"
[ "$SUITE_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ]
