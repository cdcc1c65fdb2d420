"""Property-based tests of the exact full-batch-statistics scheme
(``fullbatch_bn.full_batch_stats_backward(exact=True)``).

Hypothesis draws small float64 networks from torch's layers — BatchNorm1d on (N, C) and (N, C, L), BatchNorm2d,
affine on/off, momentum None/0.1, track_running_stats on/off, layers frozen in eval mode, frozen parameters,
BatchNorm on the raw input, residual connections, parallel branches, a BatchNorm whose input also feeds a skip,
in-place activations, dropout before and after blocks — and K in {1, 2, 4, 8}. Each step of the scheme is compared
with ONE full batch through the same ``nn.BatchNorm`` layers, written here without the package's helpers: the
gradient, the loss, the running statistics and ``num_batches_tracked`` after the step, and every module's mode.

Dropout: the reference applies the masks the scheme drew for each micro-batch in its *final* sweep (recorded by a
forward hook). If the statistics or correction sweeps drew other masks than the final sweep, the scheme's
statistics and corrections would belong to another network than its final forward, and the gradient would not
match.

Every generated network runs without the cache and with it (``cache=True``, or ``"cpu"`` for every other seed),
each compared with the full batch and the two with each other. With the cache the final sweep is the backward's
recomputation of each stage, which calls each dropout layer last, micro-batch after micro-batch, too.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

from gradaccum import fullbatch_bn, ghost_bn

N, C, W, CLASSES = 8, 3, 4, 3  # batch, input channels, width, classes
SPATIAL = {"1d": (), "seq": (3,), "2d": (3, 3)}


@dataclass(frozen=True)
class BN:
    affine: bool = True
    momentum: float | None = 0.1
    track: bool = True
    frozen_eval: bool = False  # layer.eval() inside a train-mode model
    frozen_affine: bool = False  # weight and bias with requires_grad=False


@dataclass(frozen=True)
class Block:
    kind: str = "plain"  # plain | residual | branch | bn_skip
    bn: BN = BN()
    bn2: BN = BN()  # the second branch's BatchNorm
    act: str = "relu"  # relu | relu_ (in place) | leaky_ (in place) | tanh
    dropout: str = "none"  # none | before | after
    frozen_linear: bool = False


@dataclass(frozen=True)
class Arch:
    kind: str = "1d"  # 1d: (N, C), seq: (N, C, L), both BatchNorm1d; 2d: (N, C, H, W), BatchNorm2d
    input_bn: BN | None = None  # BatchNorm on the raw input (which needs no gradient)
    frozen_stem: bool = False
    blocks: tuple[Block, ...] = (Block(),)
    k: int = 4
    seed: int = 0


def _mixer(kind: str, c_in: int, c_out: int) -> nn.Module:
    if kind == "1d":
        return nn.Linear(c_in, c_out)
    return nn.Conv1d(c_in, c_out, 1) if kind == "seq" else nn.Conv2d(c_in, c_out, 3, padding=1)


def _bn(kind: str, c: int, spec: BN) -> nn.Module:
    layer = (nn.BatchNorm2d if kind == "2d" else nn.BatchNorm1d)(
        c, momentum=spec.momentum, affine=spec.affine, track_running_stats=spec.track
    )
    with torch.no_grad():
        if spec.track:  # running statistics that differ from the defaults, so that a wrong update shows
            layer.running_mean.normal_()
            layer.running_var.uniform_(0.5, 2.0)
            layer.num_batches_tracked.fill_(3)
        if spec.affine:
            layer.weight.uniform_(0.5, 1.5)
            layer.bias.normal_()
            layer.requires_grad_(not spec.frozen_affine)
    return layer.train(not spec.frozen_eval)


def _act(name: str) -> nn.Module:
    return {
        "relu": nn.ReLU(),
        "relu_": nn.ReLU(inplace=True),
        "leaky_": nn.LeakyReLU(0.1, inplace=True),
        "tanh": nn.Tanh(),
    }[name]


class _Block(nn.Module):
    def __init__(self, spec: Block, kind: str):
        super().__init__()
        self.kind = spec.kind
        self.lin, self.bn, self.act = _mixer(kind, W, W), _bn(kind, W, spec.bn), _act(spec.act)
        self.lin.requires_grad_(not spec.frozen_linear)
        if spec.kind == "branch":
            self.lin2, self.bn2 = _mixer(kind, W, W), _bn(kind, W, spec.bn2)
        self.before = nn.Dropout(0.3) if spec.dropout == "before" else nn.Identity()
        self.after = nn.Dropout(0.3) if spec.dropout == "after" else nn.Identity()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.before(h)
        if self.kind == "plain":
            out = self.act(self.bn(self.lin(h)))
        elif self.kind == "residual":
            out = h + self.act(self.bn(self.lin(h)))
        elif self.kind == "branch":
            out = self.act(self.bn(self.lin(h))) + self.bn2(self.lin2(h))
        else:  # bn_skip: the BatchNorm's input also feeds the skip connection
            out = self.act(h + self.bn(h))
        return self.after(out)


class _Net(nn.Module):
    def __init__(self, spec: Arch):
        super().__init__()
        torch.manual_seed(spec.seed)
        self.input_bn = _bn(spec.kind, C, spec.input_bn) if spec.input_bn is not None else nn.Identity()
        self.stem = _mixer(spec.kind, C, W).requires_grad_(not spec.frozen_stem)
        self.blocks = nn.Sequential(*[_Block(b, spec.kind) for b in spec.blocks])
        size = 1
        for s in SPATIAL[spec.kind]:
            size *= s
        self.head = nn.Linear(W * size, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(self.input_bn(x))).flatten(1))


def _data(spec: Arch) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(spec.seed + 1)
    x = torch.randn(N, C, *SPATIAL[spec.kind], generator=g, dtype=torch.float64) * 2 + 1
    return x, torch.randint(0, CLASSES, (N,), generator=g)


def _dropouts(model: nn.Module) -> dict[str, nn.Dropout]:
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Dropout)}


def _scheme_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, k: int, cache: bool | str = False):
    """The scheme (with ``cache``) on a copy; returns the copy, the loss, and per dropout layer the mask factors
    (0 or 1/(1-p)) its final sweep drew, micro-batch after micro-batch."""
    work = copy.deepcopy(model)
    work.zero_grad(set_to_none=True)
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in _dropouts(work)}
    for name, m in _dropouts(work).items():
        m.register_forward_hook(
            lambda mod, inp, out, r=seen[name]: r.append(
                torch.where(inp[0] != 0, out / inp[0], torch.zeros_like(out)).detach()
            )
        )
    loss = fullbatch_bn.full_batch_stats_backward(work, nn.CrossEntropyLoss(), x, y, k, exact=True, cache=cache)
    return work, loss, {name: torch.cat(r[-k:]) for name, r in seen.items()}


def _reference_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, masks: dict[str, torch.Tensor]):
    """ONE forward/backward of the whole batch through nn.BatchNorm, each dropout layer's output replaced by its
    input times the given mask factors."""
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    for name, m in _dropouts(ref).items():
        m.register_forward_hook(lambda mod, inp, out, f=masks[name]: inp[0] * f)
    loss = nn.CrossEntropyLoss()(ref(x), y)
    loss.backward()
    return ref, float(loss.detach())


def _assert_same_step(model: nn.Module, spec: Arch, cache: bool | str = False) -> torch.Tensor:
    """Compare one step of the scheme with the full batch; returns the scheme's gradient."""
    x, y = _data(spec)
    modes = [m.training for m in model.modules()]
    work, loss, masks = _scheme_step(model, x, y, spec.k, cache)
    ref, ref_loss = _reference_step(model, x, y, masks)
    assert abs(loss - ref_loss) < 1e-12
    got, want = [], []
    for (name, p), q in zip(work.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name  # frozen parameters get no gradient in either
        if q.grad is not None:
            got.append(p.grad.reshape(-1))
            want.append(q.grad.reshape(-1))
    g, r = torch.cat(got), torch.cat(want)
    assert float(r.norm()) > 0
    assert float((g - r).norm() / r.norm()) < 1e-10
    for (name, a), b in zip(work.named_buffers(), ref.buffers()):
        if a.is_floating_point():
            assert torch.allclose(a, b, rtol=0, atol=1e-12), name  # running mean and variance
        else:
            assert torch.equal(a, b), name  # num_batches_tracked
    assert [m.training for m in work.modules()] == modes  # no module's mode changed
    return g


bns = st.builds(
    BN,
    affine=st.booleans(),
    momentum=st.sampled_from([None, 0.1]),
    track=st.booleans(),
    frozen_eval=st.booleans(),
    frozen_affine=st.booleans(),
)
blocks = st.builds(
    Block,
    kind=st.sampled_from(["plain", "residual", "branch", "bn_skip"]),
    bn=bns,
    bn2=bns,
    act=st.sampled_from(["relu", "relu_", "leaky_", "tanh"]),
    dropout=st.sampled_from(["none", "before", "after"]),
    frozen_linear=st.booleans(),
)
archs = st.builds(
    Arch,
    kind=st.sampled_from(["1d", "seq", "2d"]),
    input_bn=st.none() | bns,
    frozen_stem=st.booleans(),
    blocks=st.lists(blocks, min_size=1, max_size=3).map(tuple),
    k=st.sampled_from([1, 2, 4, 8]),
    seed=st.integers(0, 2**16),
)

# Architectures that once broke the exact scheme (in-place activations after BatchNorm, a frozen BatchNorm,
# BatchNorm on the input, dropout), always run first.
INPLACE_AFTER_BN = Arch(blocks=(Block(bn=BN(affine=False), act="relu_"), Block()))
INPLACE_CONV = Arch(kind="2d", blocks=(Block(bn=BN(affine=False), act="relu_"), Block(act="relu_")))
FROZEN_BN = Arch(blocks=(Block(), Block(bn=BN(frozen_eval=True))))
BN_ON_INPUT = Arch(input_bn=BN(), blocks=(Block(),))
DROPOUT = Arch(blocks=(Block(dropout="before"), Block(dropout="after")))


@pytest.mark.slow
@settings(
    max_examples=120, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(archs)
@example(INPLACE_AFTER_BN)
@example(INPLACE_CONV)
@example(FROZEN_BN)
@example(BN_ON_INPUT)
@example(DROPOUT)
def test_exact_scheme_is_one_full_batch(spec):
    model = _build(spec)
    grads = []
    for cache in (False, True if spec.seed % 2 == 0 else "cpu"):
        torch.manual_seed(spec.seed)  # the same dropout masks for both
        grads.append(_assert_same_step(model, spec, cache))
    assert float((grads[1] - grads[0]).norm() / grads[0].norm()) < 1e-12


def _build(spec: Arch) -> nn.Module:
    """The model in train mode, except the BatchNorm layers the spec freezes in eval mode."""
    return _Net(spec).double()


@pytest.mark.parametrize("cache", [False, True])
def test_dropout_masks_are_plain_accumulations(cache):
    """The scheme draws the masks plain accumulation draws (micro-batch i continues the generator where i−1 left
    it) and leaves the generator where plain accumulation leaves it. (Tanh: no dropout input is 0, so every
    recorded factor shows the mask.)"""
    spec = Arch(blocks=(Block(dropout="before", act="tanh"), Block(dropout="after", act="tanh")))
    model, (x, y) = _build(spec), _data(spec)
    torch.manual_seed(5)
    _, _, masks = _scheme_step(model, x, y, spec.k, cache)
    after_scheme = torch.get_rng_state()
    plain = copy.deepcopy(model)
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in _dropouts(plain)}
    for name, m in _dropouts(plain).items():
        m.register_forward_hook(
            lambda mod, inp, out, r=seen[name]: r.append(
                torch.where(inp[0] != 0, out / inp[0], torch.zeros_like(out)).detach()
            )
        )
    torch.manual_seed(5)
    for xb, yb in zip(x.split(N // spec.k), y.split(N // spec.k)):
        (nn.CrossEntropyLoss()(plain(xb), yb) / spec.k).backward()
    assert torch.equal(after_scheme, torch.get_rng_state())
    for name, r in seen.items():
        assert torch.equal(masks[name] != 0, torch.cat(r) != 0), name  # same kept/dropped pattern
        assert 0 < float((masks[name] == 0).double().mean()) < 1  # some dropped, some kept


@pytest.mark.parametrize("cache", [False, True])
def test_syncbatchnorm_outside_distributed_is_batchnorm(cache):
    spec = Arch(blocks=(Block(), Block(kind="residual")))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(_build(spec))
    assert any(isinstance(m, nn.SyncBatchNorm) for m in model.modules())
    _assert_same_step(model, spec, cache)


# ------------------------------------------------------------------------------------------------ refusals


def _step(model: nn.Module, x: torch.Tensor, k: int = 2, cache: bool | str = False) -> float:
    y = torch.zeros(x.shape[0], dtype=torch.long)
    return fullbatch_bn.full_batch_stats_backward(model, nn.CrossEntropyLoss(), x, y, k, exact=True, cache=cache)


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.norm, self.head = nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 2)

    def forward(self, x):
        return self.head(self.norm(self.lin(self.norm(x))))


class _InplaceInput(nn.Module):
    """Modifies the BatchNorm's input in place after the layer read it (nn.BatchNorm's backward fails too)."""

    def __init__(self):
        super().__init__()
        self.lin, self.norm, self.head = nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 2)

    def forward(self, x):
        h = self.lin(x)
        out = self.norm(h)
        h.mul_(2)
        return self.head(out + h)


class _Swap(nn.Module):
    """Calls its two BatchNorm layers in an order that depends on the data."""

    def __init__(self):
        super().__init__()
        self.lin, self.a, self.b, self.head = nn.Linear(3, 3), nn.BatchNorm1d(3), nn.BatchNorm1d(3), nn.Linear(3, 2)

    def forward(self, x):
        h = self.lin(x)
        first, second = (self.a, self.b) if float(x[0, 0]) > 0 else (self.b, self.a)
        return self.head(second(first(h)))


@pytest.mark.parametrize("cache", [False, True])
def test_refusals_name_the_layer(cache):
    x = torch.randn(8, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="'norm' is called more than once"):
        _step(_Twice().double(), x, cache=cache)
    with pytest.raises(ValueError, match="input of BatchNorm layer 'norm' was modified in place"):
        _step(_InplaceInput().double(), x, cache=cache)
    swap = _Swap().double()
    x_swap = x.clone()
    x_swap[0, 0], x_swap[4, 0] = 1.0, -1.0
    with pytest.raises(ValueError, match="cache=False" if cache else "different order"):
        _step(swap, x_swap, cache=cache)
    ghosted = nn.Sequential(nn.Linear(3, 4), ghost_bn.GhostBatchNorm(4, 2, dims=1), nn.Linear(4, 2)).double()
    with pytest.raises(ValueError, match="'1' is a GhostBatchNorm with its own forward"):
        _step(ghosted, x, cache=cache)
    with pytest.raises(ValueError, match="'1' sees 1 value per channel"):
        _step(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double(), x[:1], k=1, cache=cache)
    with pytest.raises(ValueError, match="train"):
        _step(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double().eval(), x, cache=cache)
    with pytest.raises(ValueError, match="no BatchNorm"):
        _step(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).double(), x, cache=cache)
    frozen = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double().requires_grad_(False)
    with pytest.raises(ValueError, match="needs no gradient"):
        _step(frozen, x, cache=cache)
    dropped = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.BatchNorm1d(4), nn.Linear(4, 2)).double()
    with pytest.raises(ValueError, match="dropout layer '1'"):
        fullbatch_bn.full_batch_forward_error(dropped, x, 2)


@pytest.mark.parametrize("cache", [False, True])
def test_frozen_ghost_batchnorm_is_accepted(cache):
    """A BatchNorm subclass with its own forward is fine once frozen in eval mode (a constant affine map)."""
    spec = Arch()
    model = _build(spec)
    ghosted = ghost_bn.GhostBatchNorm(W, 2, dims=1).double()
    ghosted.load_state_dict(model.blocks[0].bn.state_dict())
    model.blocks[0].bn = ghosted.eval()
    _assert_same_step(model, spec, cache)


def test_batchnorm_layers_keeps_every_mode():
    model = _build(FROZEN_BN)
    modes = [m.training for m in model.modules()]
    state = torch.get_rng_state()
    names = [n for n, _ in fullbatch_bn.batchnorm_layers(model, _data(FROZEN_BN)[0])]
    assert names == ["blocks.0.bn", "blocks.1.bn"]
    assert [m.training for m in model.modules()] == modes and not model.blocks[1].bn.training
    assert torch.equal(state, torch.get_rng_state())
    twice = _Twice().double()
    with pytest.raises(ValueError, match="'norm' is called more than once"):
        fullbatch_bn.batchnorm_layers(twice, torch.randn(4, 3, dtype=torch.float64))


def test_forward_error_keeps_frozen_layers_frozen():
    model = _build(FROZEN_BN)
    x = _data(FROZEN_BN)[0]
    assert list(fullbatch_bn.full_batch_statistics(model, list(x.split(2)))) == [model.blocks[0].bn]
    assert fullbatch_bn.full_batch_forward_error(model, x, 4) < 1e-12
    unfrozen = copy.deepcopy(model)
    unfrozen.blocks[1].bn.train()  # what the old check did: it could not tell the two apart
    reference = copy.deepcopy(model)(x).detach()
    assert float((copy.deepcopy(unfrozen)(x) - reference).detach().abs().max()) > 1e-3
