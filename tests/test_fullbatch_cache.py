"""``full_batch_stats_backward(..., cache=True | "cpu")``: the same step as without the cache on the graphs the
property tests do not generate (BatchNorm layers back to back, a BatchNorm output or a skip read across several
cuts, one value read by two BatchNorm layers, an input that needs a gradient, the book's SmallCNN), the constants
scheme, what a pre-hook on the model sees, the trace kept per model, the refusals, and :func:`cache_bytes`."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradaccum import fullbatch_bn, fullbatch_trace
from gradaccum.book.models import make_cnn

LOSS = nn.CrossEntropyLoss()


class _Graphs(nn.Module):
    """BatchNorm layers back to back (bn2(bn1(h))), bn1's output read again after bn3, a skip (h) read across three
    cuts, and one value (z) read by two BatchNorm layers."""

    def __init__(self):
        super().__init__()
        self.lin, self.lin2, self.head = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.bn1, self.bn2, self.bn3 = (nn.BatchNorm1d(4) for _ in range(3))
        self.bn4 = nn.BatchNorm1d(4, affine=False)

    def forward(self, x):
        h = self.lin(x)
        a = self.bn1(h)
        z = self.lin2(torch.tanh(self.bn2(a)))
        return self.head(self.bn3(z) * self.bn4(z) + a + h)


class _Deep(nn.Module):
    """A residual CNN with 6 BatchNorm layers (stem, two blocks of two, the head) and in-place ReLUs."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(inplace=True))
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.Conv2d(c, c, 3, padding=1, bias=False),
                nn.BatchNorm2d(c),
                nn.ReLU(inplace=True),
                nn.Conv2d(c, c, 3, padding=1, bias=False),
                nn.BatchNorm2d(c),
            )
            for _ in range(2)
        )
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(2),
            nn.Flatten(),
            nn.Linear(4 * c, 16, bias=False),
            nn.BatchNorm1d(16),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Linear(16, 10),
        )

    def forward(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = torch.relu_(block(h) + h)
        return self.head(h)


def _step(model: nn.Module, x, y, k, cache, exact=True, seed=0):
    """One step on a copy; returns the copy's flat gradient, the loss and its buffers."""
    work = copy.deepcopy(model)
    work.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    if exact:
        loss = fullbatch_bn.full_batch_stats_backward(work, LOSS, x, y, k, cache=cache)
    else:
        loss = fullbatch_bn.full_batch_stats_as_constants_backward(work, LOSS, x, y, k, cache=cache)
    grads = [p.grad.reshape(-1) for p in work.parameters() if p.grad is not None]
    return torch.cat(grads), loss, [b.clone() for b in work.buffers()], work


def _assert_same(model, x, y, k, exact=True, cache: bool | str = True):
    g0, loss0, buffers0, _ = _step(model, x, y, k, False, exact)
    g1, loss1, buffers1, _ = _step(model, x, y, k, cache, exact)
    assert float((g1 - g0).norm() / g0.norm()) < 1e-12
    assert abs(loss1 - loss0) < 1e-12
    for a, b in zip(buffers0, buffers1):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)


def _digits(n: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 10, (n,), generator=g)


@pytest.mark.parametrize("cache", [True, "cpu"])
def test_graphs_the_properties_do_not_generate(cache):
    torch.manual_seed(0)
    model = _Graphs().double()
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randint(0, 2, (8,))
    _assert_same(model, x, y, 4, cache=cache)
    _assert_same(model, x, y, 4, exact=False, cache=cache)  # the constants scheme too


def test_an_input_that_needs_a_gradient():
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(3), nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double()
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randint(0, 2, (8,))
    grads = []
    for cache in (False, True):
        xx = x.clone().requires_grad_()
        fullbatch_bn.full_batch_stats_backward(copy.deepcopy(model), LOSS, xx, y, 4, exact=True, cache=cache)
        grads.append(xx.grad)
    ref = x.clone().requires_grad_()
    LOSS(copy.deepcopy(model)(ref), y).backward()
    assert torch.allclose(grads[1], grads[0], rtol=0, atol=1e-14)
    assert torch.allclose(grads[1], ref.grad, rtol=0, atol=1e-14)


@pytest.mark.parametrize("exact", [True, False])
def test_small_cnn_and_a_deeper_residual_cnn(exact):
    x, y = _digits()
    _assert_same(make_cnn("batch").train(), x, y, 4, exact)
    _assert_same(_Deep().double().train(), x, y, 4, exact)  # dropout in the head: same masks with the cache


def test_what_a_pre_hook_on_the_model_sees():
    """The model's forward is called once (micro-batch 0: does it draw random numbers?), or K times when it does;
    the stages call its torch.nn layers, whose hooks run as usual."""
    x, y = _digits()
    for model, calls in ((make_cnn("batch").train(), 1), (_Deep().double().train(), 4)):
        counted, conv_calls = [0], [0]
        model.register_forward_pre_hook(lambda *_, c=counted: c.__setitem__(0, c[0] + 1))
        first_conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
        first_conv.register_forward_pre_hook(lambda *_, c=conv_calls: c.__setitem__(0, c[0] + 1))
        fullbatch_bn.full_batch_stats_backward(model, LOSS, x, y, 4, exact=True, cache=True)
        assert counted[0] == calls
        assert conv_calls[0] == calls + 2 * 4  # and per micro-batch: pass 1 and the recomputation


def test_the_model_is_traced_at_every_call(monkeypatch):
    """A kept trace would bake in values the forward read (see the dict/global test below): one trace per call."""
    traces = []
    trace = fullbatch_trace._trace
    monkeypatch.setattr(fullbatch_trace, "_trace", lambda *a: traces.append(1) or trace(*a))
    model, (x, y) = make_cnn("batch").train(), _digits()
    for _ in range(3):
        fullbatch_bn.full_batch_stats_backward(model, LOSS, x, y, 4, exact=True, cache=True)
    assert len(traces) == 3
    model.head[1].eval()  # one BatchNorm frozen: another graph
    _assert_same(model, x, y, 4)


class _KeptInPlace(nn.Module):
    """A value read after the BatchNorm (s), changed in place there: fine without the cache, refused with it."""

    def __init__(self):
        super().__init__()
        self.lin, self.norm, self.head = nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 2)

    def forward(self, x):
        h = self.lin(x)
        s = h * 2
        out = self.norm(h)
        s.mul_(3)
        return self.head(out + s)


class _OutputChangedThenRead(nn.Module):
    """norm's output changed in place (relu_) and read again after norm2: the cache recomputes it unchanged."""

    def __init__(self):
        super().__init__()
        self.lin, self.lin2, self.head = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 2)
        self.norm, self.norm2 = nn.BatchNorm1d(3), nn.BatchNorm1d(3)

    def forward(self, x):
        y = self.norm(self.lin(x))
        z = torch.relu_(y)
        return self.head(self.norm2(self.lin2(z)) + y)


class _TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.norm, self.head = nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 2)

    def forward(self, x, scale=2.0):
        return self.head(self.norm(self.lin(x)) * scale)


class _TupleAcross(nn.Module):
    """A tuple of tensors (chunk's result) read after the BatchNorm."""

    def __init__(self):
        super().__init__()
        self.lin, self.norm, self.head = nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(2, 2)

    def forward(self, x):
        parts = self.lin(x).chunk(2, dim=1)
        out = self.norm(self.lin(x))
        return self.head(out[:, :2] + parts[0])


def test_refusals_say_use_cache_false():
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randint(0, 2, (8,))
    for model in (_KeptInPlace(), _OutputChangedThenRead()):
        _step(model.double(), x, y, 2, False)  # fine without the cache
        with pytest.raises(ValueError, match="in place.*cache=False"):
            _step(model.double(), x, y, 2, True)
    with pytest.raises(ValueError, match="tuple.*cache=False"):
        _step(_TupleAcross().double(), x, y, 2, True)
    with pytest.raises(ValueError, match="takes 2 inputs.*cache=False"):
        _step(_TwoInputs().double(), x, y, 2, True)
    hooked = nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.BatchNorm1d(3), nn.ReLU()), nn.Linear(3, 2)).double()
    hooked[1].register_forward_hook(lambda mod, inp, out: out * 2)
    with pytest.raises(ValueError, match="module '1' has hooks.*cache=False"):
        _step(hooked, x, y, 2, True)
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 2)).double()
    model.register_forward_hook(lambda mod, inp, out: out * 2)
    with pytest.raises(ValueError, match="hooks.*cache=False"):
        _step(model, x, y, 2, True)
    for bad in ("cuda", 1):  # (None: the default, the cache where it applies)
        with pytest.raises(ValueError, match="cache"):
            _step(nn.Sequential(nn.BatchNorm1d(3), nn.Linear(3, 2)).double(), x, y, 2, bad)


def test_cache_bytes():
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randint(0, 2, (8,))
    # Linear saves its input x (8·3 float64 = 192 bytes); its weight is not counted
    assert fullbatch_bn.saved_activation_bytes(nn.Linear(3, 4).double(), lambda out, _: out.sum(), x, y) == 192
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double()
    before = copy.deepcopy(model.state_dict())
    state = torch.get_rng_state()
    cost = fullbatch_bn.cache_bytes(model, LOSS, x, y, 2)
    assert cost.cache == 2 * 8 * 4 * 8  # x̂ (8·4 float64) and ∂L/∂x̂ at the cut, together at the peak
    assert cost.activations == fullbatch_bn.saved_activation_bytes(model, LOSS, x, y) > 0
    assert cost.fraction == cost.cache / cost.activations
    assert all(torch.equal(a, b) for a, b in zip(before.values(), model.state_dict().values()))
    assert all(p.grad is None for p in model.parameters()) and torch.equal(state, torch.get_rng_state())
    cnn = fullbatch_bn.cache_bytes(make_cnn("batch").train(), LOSS, *_digits(64), 16)
    assert 0 < cnn.fraction < 1


def test_tensor_bytes_counts_views_not_storages():
    a = torch.zeros(10, 10, dtype=torch.float64)
    assert fullbatch_bn.tensor_bytes([a]) == 800 and fullbatch_bn.tensor_bytes([a, a.t()]) == 800
    assert fullbatch_bn.tensor_bytes([a[:2]]) == 160  # a slice: its own rows
    assert fullbatch_bn.tensor_bytes([a[:5], a[3:7]]) == 560  # overlapping views: the union
    assert fullbatch_bn.tensor_bytes([a[:, :1]]) == (1 + 9 * 10) * 8  # a strided column spans its rows
    assert fullbatch_bn.tensor_bytes([torch.zeros(1).expand(5)]) == 4
    assert fullbatch_bn.tensor_bytes([a], exclude={a.untyped_storage().data_ptr()}) == 0
    # a batch sliced from a larger dataset counts as the batch
    data, y = torch.randn(100, 3, dtype=torch.float64), torch.randint(0, 2, (8,))
    linear = nn.Linear(3, 4).double()
    assert fullbatch_bn.saved_activation_bytes(linear, lambda out, _: out.sum(), data[:8], y) == 192


class _Gate(nn.Module):
    """Linear → BatchNorm1d → Linear → BatchNorm1d, with one of several things a trace could get wrong."""

    def __init__(self, how: str = "plain"):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.b1, self.l2, self.b2 = nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), nn.BatchNorm1d(4)
        self.how, self.temp = how, 1.0
        self.double()

    def forward(self, x):
        h = self.b1(self.l1(x))
        if self.how == "no_grad":
            with torch.no_grad():
                gate = torch.sigmoid(self.l2(h))
            return self.b2(self.l2(h)) * gate
        if self.how == "functional":
            return F.batch_norm(self.l2(h), None, None, training=True)
        if self.how == "python_random":
            return self.b2(self.l2(h)) * (1.0 + random.random())
        return self.b2(self.l2(h / self.temp))


def _reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    work = copy.deepcopy(model)
    F.mse_loss(work(x), y).backward()
    return torch.cat([p.grad.flatten() for p in work.parameters()])


def test_what_a_trace_would_get_wrong_is_refused_or_retraced():
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="changes autograd's mode"):
        fullbatch_bn.full_batch_stats_gradient(_Gate("no_grad"), F.mse_loss, x, y, 4, True, True)
    assert torch.allclose(
        fullbatch_bn.full_batch_stats_gradient(_Gate("no_grad"), F.mse_loss, x, y, 4, True),
        _reference(_Gate("no_grad"), x, y),
        rtol=1e-10,
        atol=1e-12,
    )
    for cache in (False, True):  # a functional batch norm would stay per micro-batch: refused either way
        with pytest.raises(ValueError, match="not a BatchNorm module"):
            fullbatch_bn.full_batch_stats_gradient(_Gate("functional"), F.mse_loss, x, y, 4, True, cache)
    with pytest.raises(ValueError, match="Python's random module"):
        fullbatch_bn.full_batch_stats_gradient(_Gate("python_random"), F.mse_loss, x, y, 4, True, True)
    model = _Gate()
    hook = model.b1.register_forward_hook(lambda _m, _a, out: out * 2)
    with pytest.raises(ValueError, match="BatchNorm layer 'b1' has hooks"):
        fullbatch_bn.full_batch_stats_gradient(model, F.mse_loss, x, y, 4, True, True)
    hook.remove()
    hook = model.register_forward_pre_hook(lambda _m, args: (args[0] * 3 + 1,))
    with pytest.raises(ValueError, match="pre-hook"):
        fullbatch_bn.full_batch_stats_gradient(model, F.mse_loss, x, y, 4, True, True)
    hook.remove()
    # a plain attribute the forward reads changes between calls: traced again, exact again
    fullbatch_bn.full_batch_stats_gradient(model, F.mse_loss, x, y, 4, True, True)
    model.temp = 3.0
    assert torch.allclose(
        fullbatch_bn.full_batch_stats_gradient(model, F.mse_loss, x, y, 4, True, True),
        _reference(model, x, y),
        rtol=1e-10,
        atol=1e-12,
    )


class _Configured(nn.Module):
    """A forward that reads a dict entry and a module-level global: values a kept trace would bake in."""

    def __init__(self):
        super().__init__()
        self.lin, self.bn, self.out = nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 4)
        self.cfg = {"act": "relu"}

    def forward(self, x):
        h = self.bn(self.lin(x))
        h = torch.relu(h) if self.cfg["act"] == "relu" else torch.tanh(h)
        return self.out(h) * _SCALE[0]


_SCALE = [1.0]


def test_a_changed_dict_entry_or_global_is_never_served_from_a_stale_trace():
    """Found by review: the cached scheme kept its trace while the forward's dict entry or a global changed, and
    returned another network's gradient (relative error 0.8) without a word. It now traces at every call."""
    torch.manual_seed(0)
    model = _Configured().double()
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    for change in (lambda: model.cfg.update(act="tanh"), lambda: _SCALE.__setitem__(0, 3.0)):
        fullbatch_bn.full_batch_stats_gradient(model, F.mse_loss, x, y, 4, True, True)
        change()
        assert torch.allclose(
            fullbatch_bn.full_batch_stats_gradient(model, F.mse_loss, x, y, 4, True, True),
            _reference(model, x, y),
            rtol=1e-10,
            atol=1e-12,
        )
    _SCALE[0] = 1.0


def test_buffers_changed_in_forward_and_layers_some_micro_batches_skip_are_refused_and_undone():
    """Review: spectral_norm's power iteration (a buffer the forward changes) saw a different network in every
    pass, a wrong gradient even at K = 1; a BatchNorm only some micro-batches reach got statistics from those
    alone (exact=False) or a KeyError (exact=True); a refusal left the first micro-batches' gradients in .grad."""
    import torch.nn.functional as F
    from torch.nn.utils import spectral_norm

    from gradaccum.fullbatch_bn import full_batch_stats_backward
    from gradaccum.ghost_bn import GhostBatchNorm

    torch.manual_seed(0)
    x, y = torch.randn(8, 3, 6, 6, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    model = nn.Sequential(spectral_norm(nn.Conv2d(3, 4, 3)), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(64, 2))
    model = model.double()
    u = model[0].weight_u.clone()
    for cache in (False, True):
        with pytest.raises(ValueError, match="weight_u"):
            full_batch_stats_backward(model, F.mse_loss, x, y, 1, exact=True, cache=cache)
        assert all(p.grad is None for p in model.parameters()) and torch.equal(model[0].weight_u, u)

    class Branching(nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.b, self.b2, self.fc = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.BatchNorm2d(4), nn.Linear(4, 2)

        def forward(self, x):
            h = self.b(self.c(x))
            if x[0, 0, 0, 0] > 0:  # data-dependent: some micro-batches call b2, others do not
                h = self.b2(h)
            return self.fc(h.mean((2, 3)))

    for first in (1.0, -1.0):  # micro-batch 0 calls b2 and later ones do not, or the other way round
        net = Branching().double()
        before = {n: b.clone() for n, b in net.named_buffers()}
        xs = x.clone()
        xs[::2, 0, 0, 0] = torch.tensor([first, -first, first, -first], dtype=torch.float64)
        for backward in (fullbatch_bn.full_batch_stats_as_constants_backward, full_batch_stats_backward):
            with pytest.raises(ValueError, match="different order|not all"):
                backward(net, F.mse_loss, xs, y, 4)
            assert all(p.grad is None for p in net.parameters())
            assert all(torch.equal(b, before[n]) for n, b in net.named_buffers())
    for impl in ("loop", "fold"):  # an empty batch passes through, as through nn.BatchNorm2d
        assert GhostBatchNorm(3, 2, impl=impl)(torch.randn(0, 3, 4, 4)).shape == (0, 3, 4, 4)
