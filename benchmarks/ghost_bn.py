"""Benchmark for chapter 2: what Ghost BatchNorm and full-batch statistics cost.

1. Forward + backward of one normalization layer, relative to one ``nn.BatchNorm2d`` (or ``nn.BatchNorm1d``) call
   on the whole batch, for three shapes: :class:`gradaccum.ghost_bn.GhostBatchNorm` as it comes ("auto", with the
   implementation it resolved to) and with each implementation forced (``impl="group"``, ``"loop"``, ``"fold"``,
   ``"compile"``); a Python loop of ``nn.BatchNorm`` over the ghost batches; hand-written mean/var ops.
2. One optimizer step of SmallCNN on a 64-image batch, relative to plain accumulation: the full batch, Ghost
   BatchNorm via ``ghostify`` (one running-statistics update per step), full-batch statistics (constants), the
   exact scheme, and the exact scheme with ``cache=True`` (where ``full_batch_stats_backward`` has it).

Usage: python benchmarks/ghost_bn.py [--device cpu|cuda] [--threads N] [--no-compile] [--quick]
Each table is timed interleaved (every round calls each row once, in turn, so that a machine getting busier or
quieter affects all rows alike; each round starts one row later, so that every row follows every other equally
often), 40 rounds, then the median per row (CUDA timings synchronize). ``--quick`` times two rounds
after one warm-up and skips torch.compile: it checks that the benchmark runs (the tests use it), not how fast
anything is. ``--json PATH`` writes the tables; chapter 2 reads the run recorded with
``--threads 1 --json src/gradaccum/book/ghost_bn_cpu.json`` (the book's 2-core CPU). The step table also counts
the ``model(x)`` calls of one step (the cached exact scheme calls the model once, to learn whether its forward
draws random numbers, and then runs the torch.fx stages it traced).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from gradaccum import ghost_bn, ghost_bn_compiled
from gradaccum.book.ch02_ghost_batchnorm import step_functions
from gradaccum.book.data import load_digits_split
from gradaccum.ghost_bn import GhostBatchNorm, LoopGhostBatchNorm, auto_impl
from gradaccum.timing import interleaved_medians

#: (shape, virtual batch size) of the layer tables: a large batch of feature maps, the book's small CNN, features.
LAYER_SHAPES = [((256, 64, 16, 16), 32), ((64, 16, 8, 8), 4), ((4096, 256), 32)]


class ManualGhost(nn.Module):
    """Hand-written mean/var over a (G, v, C, positions) view (no running statistics)."""

    def __init__(self, c: int, v: int, eps: float = 1e-5):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(c)), nn.Parameter(torch.zeros(c))
        self.v, self.eps = v, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c = x.shape[:2]
        g = x.reshape(n // self.v, self.v, c, -1)
        mean = g.mean((1, 3), keepdim=True)
        var = g.var((1, 3), keepdim=True, correction=0)
        out = (g - mean) * torch.rsqrt(var + self.eps) * self.weight.view(1, 1, c, 1) + self.bias.view(1, 1, c, 1)
        return out.reshape(x.shape)


def measure(fns: dict[str, Callable[[], object]], device: torch.device, quick: bool) -> dict[str, float]:
    return interleaved_medians(fns, device, repeat=2 if quick else 40, warmup=1, rotate=True)


def layer_table(device: torch.device, compile_: bool, quick: bool, shape: tuple[int, ...], v: int) -> dict:
    x = torch.randn(*shape, device=device, requires_grad=True)
    grad = torch.randn_like(x)
    c, dims = shape[1], len(shape) // 2
    resolved = auto_impl(x, v)
    modules: dict[str, nn.Module] = {
        f"nn.BatchNorm{dims}d (whole batch)": (nn.BatchNorm2d if dims == 2 else nn.BatchNorm1d)(c),
        f"GhostBatchNorm default (auto: {resolved})": GhostBatchNorm(c, v, dims=dims),
        **{f"GhostBatchNorm impl={impl!r}": GhostBatchNorm(c, v, dims=dims, impl=impl)
           for impl in ghost_bn.IMPLS[1:] if impl != "compile" or compile_},
        f"loop of nn.BatchNorm{dims}d": LoopGhostBatchNorm(c, v, dims=dims),
        "hand-written mean/var": ManualGhost(c, v),
    }
    fns = {}
    for name, module in modules.items():
        module.to(device).train()

        def step(m: nn.Module = module) -> None:
            x.grad = None
            m(x).backward(grad)

        fns[name] = step
    if compile_:
        fns["GhostBatchNorm impl='compile'"]()  # compile now, outside the timed rounds
        if ghost_bn_compiled._compile_failed:
            print("torch.compile failed here (see the warning): its row is left out", file=sys.stderr)
            del fns["GhostBatchNorm impl='compile'"]
    title = f"one layer, forward + backward, batch {'×'.join(map(str, shape))}, v={v}"
    return {"title": title, "shape": list(shape), "v": v, "auto_impl": resolved,
            **rows(measure(fns, device, quick))}


#: The step table's rows: chapter 2's methods (:func:`gradaccum.book.ch02_ghost_batchnorm.step_functions`), named
#: as the recorded JSON names them.
STEP_ROWS = {"plain accumulation": "plain accumulation (K={k})", "full batch": "full batch (K=1)",
             "ghost BN, 1 update/step": "ghost BN via ghostify (v={v}, 1 update/step)",
             "full-batch stats": "full-batch stats, constants (K={k})",
             "exact full-batch stats": "exact full-batch stats (K={k})", "exact, cached": "exact, cached (K={k})"}


def step_table(device: torch.device, quick: bool, k: int = 16) -> dict:
    split = load_digits_split(dtype=torch.float32, device=device)
    steps, counts = step_functions(split.x_train[:64], split.y_train[:64], k, list(STEP_ROWS), torch.float32)
    fns, forward_calls, peak = {}, {}, {}
    for method, step in steps.items():
        name = STEP_ROWS[method].format(k=k, v=64 // k)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        step()
        forward_calls[name] = counts[method][0]
        if device.type == "cuda":
            peak[name] = torch.cuda.max_memory_allocated(device)
        fns[name] = step
    table = {"title": "one optimizer step of SmallCNN on 64 images", **rows(measure(fns, device, quick))}
    for row in table["rows"]:
        row["forward_calls"] = forward_calls[row["name"]]
        if peak:
            row["peak_memory_bytes"] = peak[row["name"]]
    return table


def rows(seconds: dict[str, float]) -> dict:
    """The table's rows (name, median seconds, ratio to the first row, the baseline)."""
    baseline = next(iter(seconds))
    return {"baseline": baseline, "rows": [{"name": name, "seconds": s, "ratio": s / seconds[baseline]}
                                           for name, s in seconds.items()]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--quick", action="store_true", help="2 timed rounds, no torch.compile: a smoke test")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the tables to PATH as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device: {name}; torch {torch.__version__}; {args.threads} thread(s)")
    compile_ = not (args.no_compile or args.quick)
    tables = [layer_table(device, compile_, args.quick, shape, v) for shape, v in LAYER_SHAPES]
    tables.append(step_table(device, args.quick))
    for table in tables:
        print(f"\n{table['title']}")
        for row in table["rows"]:
            calls = f"  {row['forward_calls']:3d} forward calls" if "forward_calls" in row else ""
            print(f"  {row['name']:<46} {row['seconds'] * 1e3:9.3f} ms  {row['ratio']:6.2f}×{calls}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = {"device": name, "torch": torch.__version__, "threads": args.threads, "quick": args.quick,
                  "tables": tables}
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
