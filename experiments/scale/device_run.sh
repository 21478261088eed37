#!/usr/bin/env bash
# Issue 60's runs on a lent GPU, in one call of the device tool (its timeout 600 s):
#
#   bash experiments/scale/device_run.sh     # writes into $OUT (the device tool's folder), else /tmp/scale_device
#
# gpu.txt: the GPU and torch. gpu_tier.txt: the engine on CUDA (`pytest -m gpu tests/test_scale_engine.py`: every
# rank's bytes equal the simulator's, the losses follow it). runs.txt, summary.csv, steps.csv: the configurations
# of RUNS, seed by seed (SEEDS), each started only while `--budget` predicts it to end before TOTAL seconds (540 by
# default) from the script's start; a run the timeout cuts leaves its curve so far in steps.csv (not in summary.csv).
# Then on this machine: `python -m experiments.scale.report --results <folder>`.
# DEVICE, SWEEPS and ARGS (more arguments of `python -m experiments.scale`) let it run elsewhere, e.g. tiny on a CPU.
set -u
out=${OUT:-/tmp/scale_device}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv > "$out/gpu.txt" 2>&1
python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())" >> "$out/gpu.txt"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_scale_engine.py > "$out/gpu_tier.txt" 2>&1
echo "engine on cuda: exit $?" | tee -a "$out/gpu_tier.txt"
runs=${RUNS:-n1024-b1-ddp n1024-b1-pipeline n256-b4-ddp n256-b4-pipeline n64-b16-ddp n64-b16-pipeline}
budget=$(( ${TOTAL:-540} - SECONDS ))
# shellcheck disable=SC2086 # RUNS, SWEEPS, SEEDS and ARGS are lists
timeout $(( budget > 0 ? budget + 30 : 30 )) python3 -m experiments.scale --device "${DEVICE:-cuda}" --sweep ${SWEEPS:-strong weak} \
    --seeds ${SEEDS:-0 1 2} ${ARGS:-} --budget "$budget" --only $runs --out "$out" > "$out/runs.txt" 2>&1
echo "runs: exit $?" | tee -a "$out/runs.txt"
cat "$out/gpu.txt"
tail -n 3 "$out/gpu_tier.txt"
tr '\r' '\n' < "$out/runs.txt" | grep -v "step/s\|s/step" | tail -n 30
