"""Train the digits CNN with DDP and gradient accumulation, with and without no_sync, under torchrun.

The same training function as chapter 5 (`gradaccum.book.ddp_workers.train_ddp`), on whatever torchrun gives it:
NCCL and one GPU per process when CUDA is available, gloo on the CPU otherwise.

    torchrun --nproc_per_node=2 scripts/ddp_train.py --k 4 --b 8 --steps 5      # 2 CPU processes
    torchrun --nproc_per_node=8 scripts/ddp_train.py --k 8                      # one node, 8 GPUs
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 scripts/ddp_train.py

Every rank trains on K·b·steps digits of its own, and there are 1,221 training digits. Without --b the
micro-batch size is the largest b <= 8 that fits (2 ranks, K = 4, 5 steps: b = 8; 8 ranks, K = 8: b = 3;
16 ranks, K = 4: b = 3); a --b that does not fit is refused with the largest one that does.

Prints, on rank 0, the backend, the time of each run and the largest difference between the parameters reached
with and without no_sync (0 up to rounding).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from gradaccum.book.ddp_workers import train_ddp
from gradaccum.distributed import micro_batch_that_fits

#: The micro-batch size used when --b is not given and it fits.
DEFAULT_B = 8


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--k", type=int, default=4, help="accumulation steps K (default 4)")
    p.add_argument("--b", type=int, default=None,
                   help=f"micro-batch size per process (default: the largest b <= {DEFAULT_B} that fits)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps (default 5)")
    return p


def choose_b(args: argparse.Namespace, n_images: int, world_size: int) -> int:
    """The micro-batch size: --b if every rank's K·b·steps images fit, else the largest b <= 8 that fits.

    Raises ValueError (with what to do instead) when --b is too large or not even b = 1 fits.
    """
    fits = micro_batch_that_fits(n_images, world_size, args.k, args.steps, cap=max(DEFAULT_B, args.b or 1))
    if args.b is None:
        return min(fits, DEFAULT_B)
    if args.b < 1:
        raise ValueError(f"--b must be >= 1, got {args.b}.")
    if args.b > fits:
        raise ValueError(f"--b {args.b} does not fit: {world_size} ranks × K={args.k} × {args.steps} steps × b "
                         f"must be at most the {n_images} training images; use --b {fits} or less (or omit --b).")
    return args.b


def training_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """The training digits on every rank: rank 0 loads them and broadcasts them, so that the other ranks need not
    import scikit-learn (about as much CPU time as importing torch)."""
    box: list[object] = [None]
    if dist.get_rank() == 0:
        from gradaccum.book.data import load_digits_split

        digits = load_digits_split()
        box = [(digits.x_train, digits.y_train)]
    dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[return-value]


def main() -> None:
    cli = parser()
    args = cli.parse_args()
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=60))
    data = training_digits()
    try:
        b = choose_b(args, data[0].shape[0], dist.get_world_size())
    except ValueError as err:  # every rank gets here; rank 0 says why
        dist.destroy_process_group()
        if int(os.environ.get("RANK", 0)) == 0:
            cli.error(str(err))
        sys.exit(2)
    try:
        train_ddp(args.k, b, 1, True, device, data)  # warm-up: first allocations, first collectives
        results = {}
        for no_sync in (False, True):
            start = time.perf_counter()
            results[no_sync] = train_ddp(args.k, b, args.steps, no_sync, device, data)
            results[no_sync, "s"] = time.perf_counter() - start
        if dist.get_rank() == 0:
            diff = float((results[False] - results[True]).abs().max())
            name = torch.cuda.get_device_name(device) if cuda else "CPU"
            chosen = "" if args.b is not None else f" (the largest b <= {DEFAULT_B} that fits)"
            print(f"backend {dist.get_backend()} on {name}, world size {dist.get_world_size()}, K={args.k}, "
                  f"b={b}{chosen}, {args.steps} steps")
            print(f"  sync every micro-batch: {results[False, 's']:.3f} s   no_sync: {results[True, 's']:.3f} s")
            print(f"  max |params(sync) - params(no_sync)| = {diff:.2e}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
