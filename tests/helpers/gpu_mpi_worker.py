"""Worker: ``mpiexec -n 2`` ranks sharing one GPU train the small GPT of gpu_mpi_scenario.py on CUDA parameters.

Usage (by tests/test_gpu_mpi.py): python tests/helpers/gpu_mpi_worker.py OUT_DIR DEVICE CUDA_GRAPHS (1 or 0)
[ITERATIONS DURING_BACKWARD (1 or 0)]
"""

import sys
from pathlib import Path

import torch

import gossip
from helpers.gpu_mpi_scenario import train_small_gpt


def main() -> None:
    out_dir, device, cuda_graphs = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
    iterations = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    during_backward = sys.argv[5] == "1" if len(sys.argv) > 5 else True
    torch.set_num_threads(1)
    comm = gossip.init("mpi", timeout=60.0, mpi_device=device)
    result = train_small_gpt(comm, cuda_graphs, iterations, during_backward)
    result["comm_device"] = str(comm.device)
    comm.close()
    torch.save(result, out_dir / f"rank{comm.rank}.pt")


if __name__ == "__main__":
    main()
