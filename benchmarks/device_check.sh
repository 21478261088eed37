#!/usr/bin/env bash
# What a session lent a GPU runs first, in one call: the GPU tier, then the per-step costs on the GPU.
#
#   bash benchmarks/device_check.sh            # writes into $OUT (the device tool's folder), else /tmp/device_check
#
# gpu_tier.txt: `pytest -m gpu tests/` (the scaled-sign codec's torch bit path and ChocoSign on CUDA, momentum
# tracking on CUDA against the CPU, NCCL, CUDA graphs, ...); gpu_step.md / .json: benchmarks/gpu_step.py on GPT-2
# small (forward + backward, the optimizers with MomentumTrackingAdamW, PowerGossip, exact and sign trackers' own
# computation). Each part has its own time limit so that one hang leaves the other's result.
set -u
out=${OUT:-/tmp/device_check}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())" >> "$out/gpu.txt"
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ > "$out/gpu_tier.txt" 2>&1
echo "gpu tier: exit $?" | tee -a "$out/gpu_tier.txt"
timeout 240 python3 benchmarks/gpu_step.py --json "$out/gpu_step.json" > "$out/gpu_step.md" 2>&1
echo "gpu_step: exit $?" | tee -a "$out/gpu_step.md"
tail -n 3 "$out/gpu_tier.txt"
cat "$out/gpu_step.md"
