"""Reading the frames the call recorder sees: which code a callable runs first, the closure an optimizer's
``step`` was given, and whether a seeding call is the reader's own (not one from gradaccum's tools or torch's
save-and-restore of the random state, and not one that leaves every generator as it was). :mod:`.recorder`
uses them to tell the reader's calls from the machinery's."""

from __future__ import annotations

import functools
import inspect
import os
import random
import sys
from typing import Any

import torch

_SEED_NAMES = {"manual_seed", "seed", "set_rng_state", "manual_seed_all"}
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # gradaccum/
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _closure_argument(frame: Any) -> Any:
    """The closure an optimizer's ``step`` was called with: the ``closure`` argument, else its first positional
    argument after ``self``, else the first of ``*args``; None when there is none."""
    loc = frame.f_locals
    if callable(loc.get("closure")):
        return loc["closure"]
    code = frame.f_code
    names = code.co_varnames
    if code.co_argcount > 1 and callable(loc.get(names[1])):
        return loc[names[1]]
    if code.co_flags & inspect.CO_VARARGS:
        extra = loc.get(names[code.co_argcount + code.co_kwonlyargcount], ())
        if extra and callable(extra[0]):
            return extra[0]
    return None


def _code_of(fn: Any) -> Any:
    """The code object a call of ``fn`` runs first (through partials, bound methods and callable objects)."""
    for _ in range(8):
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif inspect.ismethod(fn):
            fn = fn.__func__
        elif fn is not None and not inspect.isfunction(fn) and callable(fn):
            fn = type(fn).__call__
        else:
            break
    return getattr(fn, "__code__", None)


def _from_the_toolkit(frame: Any) -> bool:
    """Whether a seeding call, made from ``frame`` (the code that called the seeding function), is not a seed the
    reader's loop sets: a call from gradaccum's own tools (the exact full-batch BatchNorm scheme restores the RNG
    state to replay dropout masks) or from torch itself (``fork_rng`` and activation checkpointing save and
    restore the RNG state). Only the immediate caller counts: the reader's step is itself called by the checker.

    The tools are the code under gradaccum's directory, except a package of it that declares its code a user's
    (``USER_CODE = True`` in its ``__init__``: a layer built on the toolkit, whose loops are checked as a reader's
    are)."""
    # torch's own pass-through frames: a seeding function calling another (manual_seed → cuda.manual_seed_all)
    # and the wrappers that keep the compiler out of it
    while (
        frame is not None
        and os.path.abspath(frame.f_code.co_filename).startswith(_TORCH)
        and (frame.f_code.co_name in _SEED_NAMES or frame.f_code.co_filename.endswith(("eval_frame.py", "_compile.py")))
    ):
        frame = frame.f_back
    if frame is None:
        return True
    filename = os.path.abspath(frame.f_code.co_filename)
    if filename.startswith(_TORCH):
        return True
    if not filename.startswith(_PACKAGE):
        return False
    package = frame.f_globals.get("__package__") or ""
    while package:
        if getattr(sys.modules.get(package), "USER_CODE", False) is True:
            return False
        package = package.rpartition(".")[0]
    return True


def _changes_nothing(frame: Any, name: str) -> bool:
    """A seeding call that leaves every shared generator as it was: a new ``random.Random`` seeding itself as it is
    constructed (``tempfile`` makes one), or ``torch.set_rng_state`` given the state the generator is in (a
    framework restoring what it saved around code that drew nothing, as Lightning's ``isolate_rng`` does)."""
    if name == "seed":
        return frame.f_back is not None and frame.f_back.f_code is random.Random.__init__.__code__
    state = frame.f_locals.get("new_state")
    if name != "set_rng_state" or not frame.f_code.co_filename.endswith(os.path.join("torch", "random.py")):
        return False
    return isinstance(state, torch.Tensor) and torch.equal(state, torch.get_rng_state())
