"""Benchmark for chapter 2: what Ghost BatchNorm and full-batch statistics cost.

1. Forward + backward of one normalization layer over a batch of feature maps, relative to one
   ``nn.BatchNorm2d`` call on the whole batch: a Python loop of ``nn.BatchNorm2d`` over the ghost batches;
   :class:`gradaccum.ghost_bn.GhostBatchNorm` (ghost batches folded into the channel dimension); hand-written
   mean/var ops; and ``torch.compile`` of the fold (when the platform can compile).
2. One optimizer step of SmallCNN on a 64-image batch, relative to plain accumulation: full-batch statistics
   (constants) and the exact scheme.

Usage: python benchmarks/ghost_bn.py [--device cpu|cuda] [--threads N] [--no-compile] [--quick]
Prints a table; median of repeated timings after warm-up (CUDA timings synchronize). ``--quick`` times each row
twice after one warm-up and skips torch.compile: it checks that the benchmark runs (the tests use it), not how
fast anything is.
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch
from torch import nn

from gradaccum.accumulate import accumulate_backward
from gradaccum.book.data import load_digits_split
from gradaccum.book.models import make_cnn
from gradaccum.fullbatch_bn import full_batch_stats_backward
from gradaccum.ghost_bn import GhostBatchNorm, LoopGhostBatchNorm
from gradaccum.timing import median_time

#: Set by --quick: two timed calls after one warm-up, whatever the caller asks for.
QUICK = False


def timed(fn, device: torch.device, repeat: int = 30, warmup: int = 5) -> float:
    if QUICK:
        repeat, warmup = 2, 1
    return median_time(fn, device, repeat=repeat, warmup=warmup)


class ManualGhost(nn.Module):
    """Hand-written mean/var over a (G, v, C, H, W) view (no running statistics)."""

    def __init__(self, c: int, v: int, eps: float = 1e-5):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(c)), nn.Parameter(torch.zeros(c))
        self.v, self.eps = v, eps

    def forward(self, x):
        n, c, h, w = x.shape
        g = x.view(n // self.v, self.v, c, h, w)
        mean = g.mean((1, 3, 4), keepdim=True)
        var = g.var((1, 3, 4), keepdim=True, correction=0)
        out = (g - mean) * torch.rsqrt(var + self.eps)
        return (out.view(n, c, h, w) * self.weight.view(1, c, 1, 1) + self.bias.view(1, c, 1, 1))


def layer_table(device: torch.device, compile_: bool, shape=(256, 64, 16, 16), v: int = 32) -> list[tuple[str, float]]:
    x = torch.randn(*shape, device=device, requires_grad=True)
    grad = torch.randn_like(x)
    c = shape[1]
    variants: dict[str, nn.Module] = {
        "nn.BatchNorm2d (whole batch)": nn.BatchNorm2d(c),
        f"loop of nn.BatchNorm2d (v={v})": LoopGhostBatchNorm(c, v),
        f"GhostBatchNorm fold (v={v})": GhostBatchNorm(c, v),
        f"hand-written mean/var (v={v})": ManualGhost(c, v),
    }
    if compile_:
        try:
            compiled = torch.compile(GhostBatchNorm(c, v).to(device))
            compiled(x).backward(grad)  # compile now, fail here if the platform cannot
            variants[f"torch.compile(GhostBatchNorm) (v={v})"] = compiled
        except Exception as err:  # noqa: BLE001 - report and go on without it
            print(f"torch.compile unavailable here: {type(err).__name__}: {str(err)[:120]}", file=sys.stderr)
    rows = []
    for name, module in variants.items():
        module.to(device).train()

        def step(m=module):
            x.grad = None
            m(x).backward(grad)

        rows.append((name, timed(step, device)))
    return rows


def step_table(device: torch.device, k: int = 16) -> list[tuple[str, float]]:
    split = load_digits_split(dtype=torch.float32, device=device)
    x, y = split.x_train[:64], split.y_train[:64]
    loss_fn = nn.CrossEntropyLoss()
    rows = []
    for name, fn in [
        (f"plain accumulation (K={k})", accumulate_backward),
        (f"full-batch stats, constants (K={k})", full_batch_stats_backward),
        (f"exact full-batch stats (K={k})", functools.partial(full_batch_stats_backward, exact=True)),
    ]:
        model = make_cnn("batch", dtype=torch.float32, device=device).train()

        def step(m=model, f=fn):
            m.zero_grad(set_to_none=True)
            f(m, loss_fn, x, y, k)

        rows.append((name, timed(step, device, repeat=20)))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--quick", action="store_true", help="2 timed calls per row, no torch.compile: a smoke test")
    args = parser.parse_args(argv)
    global QUICK
    QUICK = args.quick
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {args.threads} thread(s)"
    print(f"device: {name}; torch {torch.__version__}")
    compile_ = not (args.no_compile or args.quick)
    for title, rows in (("one layer, forward + backward, batch 256×64×16×16", layer_table(device, compile_)),
                        ("one optimizer step of SmallCNN on 64 images", step_table(device))):
        print(f"\n{title}")
        base = rows[0][1]
        for label, seconds in rows:
            print(f"  {label:<44} {seconds * 1e3:9.3f} ms  {seconds / base:6.2f}×")
    return 0


if __name__ == "__main__":
    sys.exit(main())
