"""Train the digits CNN with DDP and gradient accumulation, with and without no_sync, under torchrun.

The same training function as chapter 5 (`gradaccum.distributed.train_ddp`), on whatever torchrun gives it:
NCCL and one GPU per process when CUDA is available, gloo on the CPU otherwise.

    torchrun --nproc_per_node=2 scripts/ddp_train.py --k 4 --b 8 --steps 5      # 2 CPU processes
    torchrun --nproc_per_node=8 scripts/ddp_train.py --k 8                      # one node, 8 GPUs
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 scripts/ddp_train.py

Prints, on rank 0, the backend, the time of each run and the largest difference between the parameters reached
with and without no_sync (0 up to rounding).
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from gradaccum.distributed import train_ddp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=4, help="accumulation steps K")
    parser.add_argument("--b", type=int, default=8, help="micro-batch size per process")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=60))
    try:
        train_ddp(args.k, args.b, 1, True, device)  # warm-up: data loading, first allocations, first collectives
        results = {}
        for no_sync in (False, True):
            start = time.perf_counter()
            results[no_sync] = train_ddp(args.k, args.b, args.steps, no_sync, device)
            results[no_sync, "s"] = time.perf_counter() - start
        if dist.get_rank() == 0:
            diff = float((results[False] - results[True]).abs().max())
            name = torch.cuda.get_device_name(device) if cuda else "CPU"
            print(f"backend {dist.get_backend()} on {name}, world size {dist.get_world_size()}, K={args.k}, "
                  f"b={args.b}, {args.steps} steps")
            print(f"  sync every micro-batch: {results[False, 's']:.3f} s   no_sync: {results[True, 's']:.3f} s")
            print(f"  max |params(sync) - params(no_sync)| = {diff:.2e}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
