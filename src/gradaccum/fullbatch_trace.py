"""The cached scheme's plan: torch.fx traces the model's forward once per step and cuts it at its L
batch-statistics BatchNorm calls into L + 1 stages (:class:`_Plan`), or refuses, saying why, a model whose trace
would not compute what its forward computes. Chapter 2 of the book.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from gradaccum.fullbatch_norm import _label, _twice_message


class _Refused(ValueError):
    """A refusal raised while tracing, told apart from torch.fx's own errors."""


def _has_hooks(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)


class _Tracer(fx.Tracer):
    """torch.fx's tracer with every BatchNorm (subclasses too) kept as one call, the cuts of the cached scheme.
    Refuses a hook on a module it traces through: the graph would leave the hook out."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, _BatchNorm) or super().is_leaf_module(m, module_qualified_name)

    def call_module(
        self, m: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        name = self.path_of_module(m)
        if _has_hooks(m) and not self.is_leaf_module(m, name):
            raise _Refused(
                f"module {_label(name)} has hooks; cache=True runs a torch.fx trace of the model, which "
                "runs only the hooks of the modules it keeps whole (torch.nn layers). Remove the hooks "
                "or use cache=False."
            )
        return super().call_module(m, forward, args, kwargs)


@dataclass
class _Stage:
    run: fx.GraphModule  # the stage's inputs → its outputs (the last stage: → the model's output)
    inputs: list[fx.Node]  # values it reads that were computed before it
    outputs: list[fx.Node]  # its values read after it


@dataclass
class _Plan:
    """The traced forward cut at its L batch-statistics BatchNorm calls. Steps: stage 0, cut 1, stage 1, …,
    cut L, stage L, numbered 0..2L (stage s is step 2s, cut c step 2c − 1). ``last_use[n]``: the last step that
    reads value n; ``kept[n]``: the first stage whose recomputation reads n (a value only a BatchNorm reads is
    not kept: x̂ is); ``cut_of[n]``: the index of cut n; ``read_at[n]``: the first step whose BatchNorm reads n."""

    input: fx.Node
    stages: list[_Stage]
    cuts: list[fx.Node]
    layers: list[_BatchNorm]
    last_use: dict[fx.Node, int]
    kept: dict[fx.Node, int]
    cut_of: dict[fx.Node, int]
    read_at: dict[fx.Node, tuple[int, str]]


def _plan(model: nn.Module, names: dict[_BatchNorm, str]) -> _Plan:
    """The stages of ``model``, traced at every call: a trace bakes in whatever the forward read while it ran (a
    dict's entries, a module-level global, an attribute's value), and no check of the model can tell that one of
    those changed, so a kept trace could silently compute another network. ValueError
    for hooks the stages would skip: on the model (a forward pre-hook that only looks is allowed; one that changes
    the input is refused when it runs, see :func:`_find_rng_starts`) and on the BatchNorm layers they replace."""
    if model._forward_hooks or model._backward_hooks or model._backward_pre_hooks:
        raise ValueError(
            "the model has forward or backward hooks; cache=True runs a torch.fx trace of its forward, "
            "which leaves them out (forward pre-hooks are allowed). Remove them or use cache=False."
        )
    hooked = [name for layer, name in names.items() if _has_hooks(layer)]
    if hooked:
        raise ValueError(
            f"BatchNorm layer {_label(hooked[0])} has hooks; cache=True computes the layers it cuts at "
            "itself, so their hooks would not run. Remove them or use cache=False."
        )
    return _trace(model, names)


@contextmanager
def _grad_mode_watch() -> Iterator[list[str]]:
    """Record every change of autograd's mode (``torch.no_grad``, ``enable_grad``, ``set_grad_enabled``,
    ``inference_mode``) made while the body runs: a torch.fx trace does not record them."""
    seen: list[str] = []
    set_grad, inference = torch._C._set_grad_enabled, torch._C._InferenceMode

    def watched_set_grad(mode: bool) -> None:
        seen.append(f"set_grad_enabled({mode})")
        set_grad(mode)

    def watched_inference(*args: Any, **kwargs: Any) -> Any:
        seen.append("inference_mode")
        return inference(*args, **kwargs)

    torch._C._set_grad_enabled, torch._C._InferenceMode = watched_set_grad, watched_inference  # type: ignore[misc,assignment]
    try:
        yield seen
    finally:
        torch._C._set_grad_enabled, torch._C._InferenceMode = set_grad, inference  # type: ignore[misc]


def _traced_graph(model: nn.Module) -> fx.Graph:
    """``model``'s forward as a torch.fx graph with one input, or ValueError saying why the trace would not compute
    what the forward computes."""
    state = random.getstate()
    try:
        with _grad_mode_watch() as changes:
            graph = _Tracer().trace(model)
    except _Refused:
        raise
    except Exception as e:
        raise ValueError(
            f"cache=True cuts the model's forward at its BatchNorm layers with torch.fx, which cannot "
            f"trace this model ({type(e).__name__}: {e}). Use cache=False — unless model(x) itself "
            f"raises this error, which is then a bug in the model to fix first."
        ) from e
    if random.getstate() != state:
        random.setstate(state)
        raise ValueError(
            "the forward draws from Python's random module; a torch.fx trace would freeze the value "
            "drawn while tracing. Use cache=False (or torch's generators, which the scheme replays)."
        )
    if changes:
        raise ValueError(
            f"the forward changes autograd's mode ({changes[0]}, e.g. a torch.no_grad() block); a "
            "torch.fx trace does not record that, so cache=True would compute gradients the model "
            "switched off. Use cache=False."
        )
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise ValueError(
            f"cache=True runs models called as model(x); this forward takes {len(placeholders)} "
            "inputs. Use cache=False."
        )
    return graph


def _steps(
    graph: fx.Graph, model: nn.Module, names: dict[_BatchNorm, str]
) -> tuple[dict[fx.Node, int], list[fx.Node], list[_BatchNorm], dict[fx.Node, tuple[int, str]]]:
    """Number every node by its step (the input −1, stage s 2s, cut c 2c − 1; ``get_attr`` nodes left out), with
    the cuts, their layers and, per BatchNorm input, the first step whose layer reads it."""
    cuts: list[fx.Node] = []
    layers: list[_BatchNorm] = []
    step: dict[fx.Node, int] = {}
    read_at: dict[fx.Node, tuple[int, str]] = {}
    for n in graph.nodes:
        if n.op == "get_attr":
            continue  # copied into every stage that reads it
        layer = model.get_submodule(str(n.target)) if n.op == "call_module" else None
        if not (isinstance(layer, _BatchNorm) and layer in names):
            step[n] = -1 if n.op == "placeholder" else 2 * len(cuts)
            continue
        if layer in layers:
            raise ValueError(_twice_message(names[layer]))
        x = n.args[0] if len(n.args) == 1 and not n.kwargs else None
        if not isinstance(x, fx.Node) or x.op == "get_attr":
            raise ValueError(
                f"BatchNorm layer {_label(names[layer])} is called with {n.args} {n.kwargs}; cache=True "
                "handles one input computed in the forward. Use cache=False."
            )
        cuts.append(n)
        layers.append(layer)
        step[n] = 2 * len(cuts) - 1
        read_at.setdefault(x, (step[n], names[layer]))
    return step, cuts, layers, read_at


def _stage(model: nn.Module, s: int, step: dict[fx.Node, int], last_use: dict[fx.Node, int], final: bool) -> _Stage:
    """Stage s as its own graph module: the nodes of step 2s, reading the values earlier steps computed."""
    nodes = [n for n in step if step[n] == 2 * s]
    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a in step and step[a] != 2 * s))
    outputs = [n for n in nodes if n.op != "output" and last_use[n] > 2 * s]
    g = fx.Graph()
    env = {a: g.placeholder(a.name) for a in inputs}
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in env:  # a get_attr node
                env[a] = g.node_copy(a)
        env[n] = g.node_copy(n, env.__getitem__)
    if not final:
        g.output(tuple(env[n] for n in outputs))
    return _Stage(fx.GraphModule(model, g), inputs, outputs)


def _trace(model: nn.Module, names: dict[_BatchNorm, str]) -> _Plan:
    """Trace ``model`` and cut it into stages (ValueError, saying why, for a model the cache cannot run)."""
    graph = _traced_graph(model)
    step, cuts, layers, read_at = _steps(graph, model, names)
    last_use = {n: max((step[u] for u in n.users), default=step[n]) for n in step}
    cut_of = {n: c for c, n in enumerate(cuts)}
    stages = [_stage(model, s, step, last_use, s == len(cuts)) for s in range(len(cuts) + 1)]
    kept: dict[fx.Node, int] = {}
    for s, stage in enumerate(stages):
        for a in stage.inputs:
            if a.op != "placeholder" and a not in cut_of:
                kept.setdefault(a, s)
    placeholder = next(n for n in graph.nodes if n.op == "placeholder")
    return _Plan(placeholder, stages, cuts, layers, last_use, kept, cut_of, read_at)
