#!/usr/bin/env bash
# What a session lent a GPU runs first, in one call: the GPU tier, the per-step costs on the GPU, and the exposed
# communication on the machine's CPU cores.
#
#   bash benchmarks/device_check.sh            # writes into $OUT (the device tool's folder), else /tmp/device_check
#
# gpu_tier.txt: `pytest -m gpu tests/` (the scaled-sign codec's torch bit path and ChocoSign on CUDA, momentum
# tracking on CUDA against the CPU, NCCL, CUDA graphs, ...); gpu_step.md / .json: benchmarks/gpu_step.py on GPT-2
# small (forward + backward, the optimizers with MomentumTrackingAdamW, PowerGossip, exact and sign trackers' own
# computation); overlap_16core_t{1,3}.json / .md: benchmarks/overlap.py, 4 Gloo ranks on the machine's CPU cores
# with 1 and 3 torch threads a rank, the default pipeline's step beside the compute-only AdamW step and DDP's in
# paired rounds (issue 59's item 5, the default's step at most 1.1x the compute-only one: on the project's 2 cores
# 4 ranks share them, and nothing of the default's own work can run beside backward). Each part has its own time
# limit (540 s in all, under the device tool's 600 s a call), so that one hang leaves the others' results.
set -u
out=${OUT:-/tmp/device_check}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())" >> "$out/gpu.txt"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ > "$out/gpu_tier.txt" 2>&1
echo "gpu tier: exit $?" | tee -a "$out/gpu_tier.txt"
timeout 150 python3 benchmarks/gpu_step.py --json "$out/gpu_step.json" > "$out/gpu_step.md" 2>&1
echo "gpu_step: exit $?" | tee -a "$out/gpu_step.md"
for threads in 1 3; do
    report="$out/overlap_16core_t$threads"
    timeout 120 python3 benchmarks/overlap.py --nprocs 4 --threads "$threads" --model gpt --batch 16 --steps 20 \
        --warmup 3 --comm-repeats 2 --methods default,ddp --rounds 3 --out "$report.json" > "$report.md" 2>&1
    echo "overlap, $threads threads a rank: exit $?" | tee -a "$report.md"
done
tail -n 3 "$out/gpu_tier.txt"
cat "$out/gpu_step.md" "$out"/overlap_16core_t*.md
