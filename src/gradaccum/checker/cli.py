"""``python -m gradaccum.checker``: the checker's command line (exit 0 no bug, 1 a bug, 2 a usage error)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from .pipeline import check
from .report import CODES


class _UsageError(Exception):
    pass


def _load_target(target: str) -> Callable[[], Any]:
    if ":" not in target:
        raise _UsageError(f"give the target as module:function (or path/to/file.py:function), got {target!r}")
    module_name, func_name = target.rsplit(":", 1)
    try:
        if module_name.endswith(".py"):
            path = os.path.abspath(module_name)
            if not os.path.exists(path):
                raise _UsageError(f"no file {module_name}")
            spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
            if spec is None or spec.loader is None:  # not for a .py path; caught below as "cannot import"
                raise ImportError(f"no module spec for {path}")
            module = importlib.util.module_from_spec(spec)
            # as `python path/to/file.py` would: the file's own folder first, so that it imports its neighbours
            sys.path.insert(0, os.path.dirname(path))
            spec.loader.exec_module(module)
        else:
            sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except _UsageError:
        raise
    except Exception as err:
        raise _UsageError(f"cannot import {module_name}: {type(err).__name__}: {err}") from err
    func = getattr(module, func_name, None)
    if not callable(func):
        raise _UsageError(f"{module_name} has no function {func_name}")
    return func


def _made(func: Callable[[], Any]) -> tuple[Any, ...]:
    try:
        made = func()
    except Exception as err:
        raise _UsageError(f"{func.__name__}() raised {type(err).__name__}: {err}") from err
    if not isinstance(made, (tuple, list)) or len(made) not in (4, 5):
        raise _UsageError(
            f"{func.__name__}() must return (model, loss_fn, x, y) or (model, loss_fn, x, y, step), "
            f"got {type(made).__name__}" + (f" of length {len(made)}" if isinstance(made, (tuple, list)) else "")
        )
    return tuple(made)


#: The demo's command: the book layer's own entry point (its data and models are the book's).
DEMO_COMMAND = "python -m gradaccum.book.check_demo"

#: The command's name in its usage line and messages (``python -m gradaccum.check`` runs it under its own name).
PROG = "python -m gradaccum.checker"


def _parser(prog: str = PROG) -> argparse.ArgumentParser:
    import gradaccum.checker as package

    parser = argparse.ArgumentParser(
        prog=prog, description=package.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "target",
        nargs="?",
        help="module:function (or file.py:function) returning (model, loss_fn, x, y) or (model, loss_fn, x, y, step)",
    )
    parser.add_argument("-k", type=int, default=4, help="accumulation steps K (default 4)")
    parser.add_argument("--clip", type=float, help="the threshold your loop clips the gradient norm to")
    parser.add_argument(
        "--tolerance",
        type=float,
        help="relative error that counts as equal (default 1e-9 for "
        "float64 parameters, 1e-4 for float32, 8 epsilons of bf16 or fp16 parameters)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds make() and the replayed randomness (default 0)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--no-partial", action="store_true", help="do not check a partial last window")
    parser.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="CODE",
        help="a finding you expect and accept (repeatable), e.g. --allow batch_coupled_layer for a "
        "BatchNorm model under plain accumulation: still reported, not a failure",
    )
    # the demo is the book layer's (the core never imports it): --demo only says where it went
    parser.add_argument("--demo", action="store_true", help=f"moved: run {DEMO_COMMAND}")
    return parser


def _usage_problem(args: argparse.Namespace) -> str | None:
    """The first thing wrong with the parsed command line, in words, or None."""
    if args.k < 1:
        return f"-k must be >= 1, got {args.k}"
    for name in ("clip", "tolerance"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            return f"--{name} must be a positive number, got {value}"
    if args.seed < 0:
        return f"--seed must be >= 0, got {args.seed}"
    unknown = sorted(set(args.allow) - set(CODES))
    if unknown:
        return f"--allow: unknown finding code(s) {unknown}; the codes are {sorted(CODES)}"
    if args.demo:
        return (
            f"--demo moved to the book layer: run {DEMO_COMMAND} [-k K] [--json] "
            "(it needs pip install 'gradaccum[book]')"
        )
    if not args.target:
        return f"give module:function (the demo: {DEMO_COMMAND})"
    return None


def _usage_json(message: str) -> int:
    """With --json, a usage error is still JSON on stdout (exit status 2); the message also goes to stderr."""
    print(json.dumps({"ok": False, "usage_error": message, "findings": []}, indent=2))
    return 2


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """The command line; returns the exit status (0 no bug, 1 bug found, 2 usage error). ``prog``: the command's
    name in its messages."""
    parser = _parser(prog)
    raw = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        if "--json" in raw and exit_.code == 2:
            return _usage_json("invalid command line (argparse's message is on stderr)")
        raise
    problem = _usage_problem(args)
    if problem is not None:
        if args.json:
            print(f"{prog}: error: {problem}", file=sys.stderr)
            return _usage_json(problem)
        parser.error(problem)
    try:
        torch.manual_seed(args.seed)
        model, loss_fn, x, y, *rest = _made(_load_target(args.target))
        report = check(
            model,
            loss_fn,
            x,
            y,
            args.k,
            step=rest[0] if rest else None,
            clip=args.clip,
            tolerance=args.tolerance,
            seed=args.seed,
            partial=not args.no_partial,
            allow=args.allow,
        )
    except (_UsageError, ValueError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return _usage_json(str(err)) if args.json else 2
    print(json.dumps(report.to_dict(), indent=2) if args.json else report)
    return 0 if report.ok else 1
