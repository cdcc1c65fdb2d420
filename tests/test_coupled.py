"""gradaccum.coupled: GradCache is the full-batch gradient of a contrastive loss (two encoders, float64, generated
networks), plain accumulation is not; the window's load-balancing loss is recovered from the window's routing;
checkpointing reruns BatchNorm's statistics update, and the wrapper keeps them."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradaccum import coupled


def encoder(d_in: int, widths: list[int], seed: int, dropout: float = 0.0) -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        for a, b in zip([d_in, *widths], widths):
            layers += [nn.Linear(a, b), nn.Tanh()] + ([nn.Dropout(dropout)] if dropout else [])
        return nn.Sequential(*layers[:-1]).double()


def grads(*modules: nn.Module) -> torch.Tensor:
    params = list(dict.fromkeys(p for m in modules for p in m.parameters()))
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def full_batch(encoders, inputs, loss_fn=coupled.info_nce) -> torch.Tensor:
    loss_fn(*[enc(x) for enc, x in zip(encoders, inputs)]).backward()
    return grads(*encoders)


def pair(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    return x, x + 0.1 * torch.randn(n, 6, generator=g, dtype=torch.float64)  # two views of each sample


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_grad_cache_equals_the_full_batch_with_two_encoders():
    xa, xb = pair(24)
    encs = [encoder(6, [8, 5], 0), encoder(6, [7, 5], 1)]
    reference = full_batch([copy.deepcopy(e) for e in encs], [xa, xb])
    loss = coupled.grad_cache_backward(encs, [xa, xb], 4)
    assert rel(grads(*encs), reference) < 1e-13
    with torch.no_grad():
        assert loss == pytest.approx(float(coupled.info_nce(encs[0](xa), encs[1](xb))), rel=1e-12)


def test_plain_accumulation_is_a_different_loss():
    xa, xb = pair(24)
    encs = [encoder(6, [8, 5], 0), encoder(6, [7, 5], 1)]
    reference = full_batch([copy.deepcopy(e) for e in encs], [xa, xb])
    coupled.plain_accumulation_backward(encs, [xa, xb], 4)
    assert rel(grads(*encs), reference) > 0.05
    # it is exactly the mean of the micro-batches' own losses
    fresh = [encoder(6, [8, 5], 0), encoder(6, [7, 5], 1)]
    sum(coupled.info_nce(fresh[0](a), fresh[1](b)) / 4 for a, b in zip(xa.chunk(4), xb.chunk(4))).backward()
    assert rel(grads(*encs), grads(*fresh)) < 1e-13


def test_a_shared_encoder_and_k_equal_one():
    xa, xb = pair(12, seed=3)
    enc = encoder(6, [9, 4], 2)
    reference = full_batch([copy.deepcopy(enc)] * 2, [xa, xb])
    coupled.grad_cache_backward([enc, enc], [xa, xb], 3)
    assert rel(grads(enc), reference) < 1e-13
    enc.zero_grad()
    coupled.grad_cache_backward([enc, enc], [xa, xb], 1)
    assert rel(grads(enc), reference) < 1e-13


def test_dropout_masks_are_replayed():
    """With dropout, GradCache's gradient is the full graph's gradient under the masks its first pass drew."""
    xa, xb = pair(16, seed=5)
    encs = [encoder(6, [8, 5], 0, dropout=0.3), encoder(6, [8, 5], 1, dropout=0.3)]
    twins = [copy.deepcopy(e) for e in encs]
    torch.manual_seed(11)
    coupled.grad_cache_backward(encs, [xa, xb], 4)
    torch.manual_seed(11)  # the same draws, in the same order, each micro-batch's graph kept
    za, zb = [], []
    for a, b in zip(xa.chunk(4), xb.chunk(4)):
        za.append(twins[0](a))
        zb.append(twins[1](b))
    coupled.info_nce(torch.cat(za), torch.cat(zb)).backward()
    assert rel(grads(*encs), grads(*twins)) < 1e-13


@settings(max_examples=25, deadline=None)
@given(
    widths=st.lists(st.integers(2, 9), min_size=1, max_size=3),
    k=st.integers(1, 6),
    b=st.integers(2, 5),
    seed=st.integers(0, 10_000),
    temperature=st.floats(0.05, 2.0),
)
def test_grad_cache_on_generated_encoders(widths, k, b, seed, temperature):
    xa, xb = pair(k * b, seed)
    encs = [encoder(6, widths, seed), encoder(6, widths, seed + 1)]
    loss = lambda a, c: coupled.info_nce(a, c, temperature)  # noqa: E731
    reference = full_batch([copy.deepcopy(e) for e in encs], [xa, xb], loss)
    coupled.grad_cache_backward(encs, [xa, xb], k, loss)
    assert rel(grads(*encs), reference) < 1e-11


@settings(max_examples=25, deadline=None)
@given(
    widths=st.lists(st.integers(2, 9), min_size=1, max_size=3),
    k=st.integers(1, 6),
    b=st.integers(1, 5),
    seed=st.integers(0, 10_000),
    temperature=st.floats(0.05, 2.0),
)
def test_micro_batch_info_nce_is_plain_accumulation_in_one_pass(widths, k, b, seed, temperature):
    """The masked one-pass loss: the value and the gradient of plain accumulation (b = 1 included: no negative, a
    zero loss), on generated encoders and temperatures."""
    xa, xb = pair(k * b, seed)
    encs = [encoder(6, widths, seed), encoder(6, widths, seed + 1)]
    twins = [copy.deepcopy(e) for e in encs]
    loss = lambda a, c: coupled.info_nce(a, c, temperature)  # noqa: E731
    total = coupled.plain_accumulation_backward(encs, [xa, xb], k, loss)
    one_pass = coupled.micro_batch_info_nce(twins[0](xa), twins[1](xb), k, temperature)
    one_pass.backward()
    assert float(one_pass.detach()) == pytest.approx(total, rel=1e-12, abs=1e-15)
    reference = grads(*encs)
    assert (grads(*twins) - reference).norm() <= 1e-11 * max(float(reference.norm()), 1e-300)
    if k > 1 and b > 1:  # not the full batch's loss
        with torch.no_grad():
            assert float(coupled.info_nce(twins[0](xa), twins[1](xb), temperature)) > float(one_pass)


def test_micro_batch_info_nce_refuses_bad_input_with_what_to_do():
    a = torch.randn(12, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="divide"):
        coupled.micro_batch_info_nce(a, a, 5)
    with pytest.raises(ValueError, match="divide"):
        coupled.micro_batch_info_nce(a[:0], a[:0], 2)
    for bad_a, bad_b in ((a, a[:6]), (a[:, 0], a[:, 0]), (a[0, 0], a[0, 0]), (a[None], a[None])):
        with pytest.raises(ValueError, match=r"\(n, d\)"):
            coupled.micro_batch_info_nce(bad_a, bad_b, 2)
    for bad_t in (0.0, -0.1, float("nan"), float("inf"), None, "0.1", True):
        with pytest.raises(ValueError, match="temperature"):
            coupled.micro_batch_info_nce(a, a, 2, temperature=bad_t)
    for bad_k in (0, -1, 2.0, True, torch.tensor(2)):
        with pytest.raises(ValueError, match="accumulation steps"):
            coupled.micro_batch_info_nce(a, a, bad_k)
    for bad_t in (torch.tensor(0.0), torch.tensor([0.1, 0.2]), torch.tensor(1), torch.tensor(float("nan"))):
        with pytest.raises(ValueError, match="temperature"):
            coupled.micro_batch_info_nce(a, a, 2, temperature=bad_t)


def test_a_learnable_temperature_gets_plain_accumulations_gradient():
    """Found by review: a tensor temperature (learnable, as CLIP's) was refused by the one-pass form."""
    za, zb = (torch.randn(12, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(s)) for s in (0, 1))
    t1 = torch.tensor(0.2, dtype=torch.float64, requires_grad=True)
    t2 = torch.tensor(0.2, dtype=torch.float64, requires_grad=True)
    coupled.micro_batch_info_nce(za, zb, 3, temperature=t1).backward()
    sum(coupled.info_nce(a, b, temperature=t2) / 3 for a, b in zip(za.chunk(3), zb.chunk(3))).backward()
    assert t1.grad is not None and abs(float(t1.grad - t2.grad)) < 1e-12 * max(1.0, abs(float(t2.grad)))
    import numpy as np

    reference = coupled.micro_batch_info_nce(za, zb, 3, temperature=0.2)
    for same in (np.float32(0.2), np.float64(0.2), torch.full((1, 1, 1), 0.2, dtype=torch.float64)):
        assert torch.allclose(coupled.micro_batch_info_nce(za, zb, 3, temperature=same), reference, rtol=1e-6)


def test_grad_cache_refuses_batchnorm_in_training_and_bad_input():
    xa, xb = pair(8)
    bn = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4)).double()
    with pytest.raises(ValueError, match="batch statistics"):
        coupled.grad_cache_backward([bn, bn], [xa, xb], 2)
    coupled.grad_cache_backward([bn.eval(), bn], [xa, xb], 2)  # frozen statistics: a constant affine map
    with pytest.raises(ValueError, match="does not divide"):
        coupled.grad_cache_backward([bn, bn], [xa, xb], 3)
    with pytest.raises(ValueError, match="one encoder per input"):
        coupled.grad_cache_backward([bn], [xa, xb], 2)
    with pytest.raises(ValueError, match="same shape"):
        coupled.info_nce(torch.zeros(3, 2), torch.zeros(4, 2))


def test_the_load_balancing_loss_of_a_window():
    torch.manual_seed(0)
    router = nn.Linear(6, 4).double()
    x = torch.randn(32, 6, dtype=torch.float64)
    micro = list(x.chunk(4))
    probs = lambda t: router(t).softmax(1)  # noqa: E731
    window = coupled.switch_aux_loss(probs(x))
    per_micro = sum(coupled.switch_aux_loss(probs(m)) for m in micro) / 4
    assert abs(float((per_micro - window).detach())) > 1e-3  # a mean of products is not a product of means
    f = coupled.window_fractions(probs, micro, 4)
    assert torch.equal(f, coupled.expert_fractions(probs(x).argmax(1), 4))
    fixed = sum(coupled.switch_aux_loss(probs(m), fractions=f) for m in micro) / 4
    assert float(fixed.detach()) == pytest.approx(float(window.detach()), rel=1e-12)
    g_window = torch.autograd.grad(window, router.weight)[0]
    g_fixed = torch.autograd.grad(fixed, router.weight)[0]
    assert rel(g_fixed, g_window) < 1e-12
    with pytest.raises(ValueError, match="one entry per expert"):
        coupled.switch_aux_loss(probs(x), fractions=torch.ones(3))


def bn_net(seed: int = 0) -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6, momentum=0.1), nn.ReLU(), nn.Linear(6, 2)).double()


@pytest.mark.parametrize("k", [1, 3])
def test_checkpointing_updates_batchnorm_twice_and_the_wrapper_once(k):
    x = torch.randn(6 * k, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    plain, ckpt, kept = bn_net(), bn_net(), bn_net()
    for xb in x.chunk(k):
        plain(xb).sum().backward()
        checkpoint(ckpt, xb, use_reentrant=False).sum().backward()
        coupled.checkpoint_keeping_bn_stats(kept, xb).sum().backward()
    bn = lambda m: m[1]  # noqa: E731
    assert int(bn(plain).num_batches_tracked) == k and int(bn(ckpt).num_batches_tracked) == 2 * k
    assert int(bn(kept).num_batches_tracked) == k
    assert torch.allclose(bn(kept).running_mean, bn(plain).running_mean, rtol=0, atol=1e-15)
    assert torch.allclose(bn(kept).running_var, bn(plain).running_var, rtol=0, atol=1e-15)
    assert rel(grads(kept), grads(plain)) < 1e-13 and rel(grads(ckpt), grads(plain)) < 1e-13
    # checkpointing moved the running mean with momentum 1 − (1 − m)^(2k) from its start (zero): same batches
    if k == 1:
        mean = x.mean(0) @ bn_net()[0].weight.T.detach() + bn_net()[0].bias.detach()
        expected = coupled.recompute_momentum(0.1, 1) * mean
        assert torch.allclose(bn(ckpt).running_mean, expected, rtol=1e-12, atol=1e-14)
        assert coupled.recompute_momentum(0.1, 1) == pytest.approx(1 - 0.9**2)


def test_parameters_inside_the_loss_get_their_full_batch_gradient():
    """Found by review: a learnable temperature (CLIP's logit scale) or a head inside loss_fn."""
    xa, xb = pair(16, seed=7)
    encs = [encoder(6, [8, 5], 0), encoder(6, [8, 5], 1)]
    twins = [copy.deepcopy(e) for e in encs]
    scale, scale_ref = (
        nn.Parameter(torch.tensor(2.0, dtype=torch.float64)),
        nn.Parameter(torch.tensor(2.0, dtype=torch.float64)),
    )

    def clip_loss(s):
        def loss(a, b):
            logits = s * torch.nn.functional.normalize(a, dim=1) @ torch.nn.functional.normalize(b, dim=1).T
            labels = torch.arange(len(a))
            return (
                torch.nn.functional.cross_entropy(logits, labels) + torch.nn.functional.cross_entropy(logits.T, labels)
            ) / 2

        return loss

    clip_loss(scale_ref)(twins[0](xa), twins[1](xb)).backward()
    coupled.grad_cache_backward(encs, [xa, xb], 4, clip_loss(scale))
    assert scale.grad is not None and float(scale.grad) == pytest.approx(float(scale_ref.grad), rel=1e-12)
    assert rel(grads(*encs), grads(*twins)) < 1e-13


def test_batch_statistics_without_running_stats_are_refused_and_a_frozen_tower_is_skipped():
    xa, xb = pair(8)
    no_stats = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4, track_running_stats=False)).double().eval()
    with pytest.raises(ValueError, match="track_running_stats=False"):
        coupled.grad_cache_backward([no_stats, no_stats], [xa, xb], 2)
    trained, frozen = encoder(6, [5], 0), encoder(6, [5], 1).requires_grad_(False)
    reference = copy.deepcopy(trained)
    coupled.info_nce(reference(xa), frozen(xb)).backward()
    coupled.grad_cache_backward([trained, frozen], [xa, xb], 2)
    assert rel(grads(trained), grads(reference)) < 1e-13


class _Counter(nn.Module):
    """A layer that counts its training forward calls in a buffer and scales by it: stateful, looks at no other
    sample."""

    def __init__(self, replace: bool = False) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.float64))
        self.replace = replace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.replace:  # a new tensor in the slot (review: got through, 0.48 off)
            self.calls = self.calls + 1
        elif self.training:
            self.calls += 1
        return x * (1 + 0.1 * self.calls)


def test_grad_cache_refuses_encoders_whose_forward_changes_a_buffer():
    """Found by review: spectral norm's power iteration, an InstanceNorm's running statistics or any counter
    advance in both passes, so the second pass ran another network than the first (relative errors 0.14 and
    0.15): refused by name, the buffers put back; in eval mode (nothing advances) the gradient is exact."""
    xa, xb = pair(24)
    stateful = {
        "spectral_norm": lambda e: (nn.utils.spectral_norm(e[0]), e)[1],
        "parametrized spectral_norm": lambda e: (nn.utils.parametrizations.spectral_norm(e[0]), e)[1],
        "InstanceNorm1d": lambda e: nn.Sequential(
            e, nn.Unflatten(1, (1, 5)), nn.InstanceNorm1d(1, track_running_stats=True).double(), nn.Flatten()
        ),
        "counter": lambda e: nn.Sequential(e, _Counter()),
        "counter replacing its buffer": lambda e: nn.Sequential(e, _Counter(replace=True)),
    }
    for name, make in stateful.items():
        enc = make(encoder(6, [8, 5], 0)).train()
        saved = {n: b.clone() for n, b in enc.named_buffers()}
        held = dict(enc.named_buffers())
        with pytest.raises(ValueError, match="changed the buffer"):
            coupled.grad_cache_backward([enc, enc], [xa, xb], 4)
        assert all(torch.equal(b, saved[n]) for n, b in enc.named_buffers()), name
        assert all(b is held[n] for n, b in enc.named_buffers()), name  # the same tensors, put back
        assert all(p.grad is None for p in enc.parameters()), name
        enc.eval()  # nothing advances: exact
        reference = full_batch([copy.deepcopy(enc)] * 2, [xa, xb])
        coupled.grad_cache_backward([enc, enc], [xa, xb], 4)
        assert rel(grads(enc), reference) < 1e-12, name


def test_a_buffer_holding_nan_that_nothing_changes_is_not_refused():
    xa, xb = pair(8)
    enc = encoder(6, [8, 5], 0)
    enc.register_buffer("unused", torch.tensor([float("nan"), 1.0], dtype=torch.float64))
    reference = full_batch([copy.deepcopy(enc)] * 2, [xa, xb])
    coupled.grad_cache_backward([enc, enc], [xa, xb], 2)
    assert rel(grads(enc), reference) < 1e-13


def test_the_checkpoint_wrapper_also_keeps_instance_norm_statistics():
    """Found by review: InstanceNorm with running statistics was updated twice under the wrapper."""
    x = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def net() -> nn.Sequential:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return nn.Sequential(
                nn.Linear(6, 6),
                nn.Unflatten(1, (2, 3)),
                nn.InstanceNorm1d(2, track_running_stats=True),
                nn.Flatten(),
                nn.Linear(6, 1),
            ).double()

    plain, ckpt, kept = net(), net(), net()
    for xb in x.chunk(2):
        plain(xb).sum().backward()
        checkpoint(ckpt, xb, use_reentrant=False).sum().backward()
        coupled.checkpoint_keeping_bn_stats(kept, xb).sum().backward()
    norm = lambda m: m[2]  # noqa: E731
    assert not torch.allclose(norm(ckpt).running_mean, norm(plain).running_mean, rtol=0, atol=1e-6)  # the trap
    assert torch.allclose(norm(kept).running_mean, norm(plain).running_mean, rtol=0, atol=1e-15)
    assert torch.allclose(norm(kept).running_var, norm(plain).running_var, rtol=0, atol=1e-15)
    assert norm(kept).momentum == 0.1 and rel(grads(kept), grads(plain)) < 1e-13


def test_coupled_tools_refuse_what_they_cannot_compute():
    """Found by review: empty batches gave NaN, fractions of the wrong length or sum and logits gave numbers,
    a function handed to checkpoint_keeping_bn_stats failed only in backward, and negative reruns a momentum."""
    enc = nn.Linear(4, 3).double()
    x = torch.randn(8, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="non-empty"):
        coupled.grad_cache_backward([enc, enc], [x[:0], x[:0]], 2)
    with pytest.raises(ValueError, match="no pairs"):
        coupled.info_nce(x[:0], x[:0])
    for bad in (torch.tensor([0.1, 0.2]), True, math.inf, "0.1"):
        with pytest.raises(ValueError, match="temperature"):
            coupled.info_nce(x, x, bad)
    with pytest.raises(ValueError, match=r"indices in \[0, 2\)"):
        coupled.expert_fractions(torch.tensor([0, 5]), 2)
    with pytest.raises(ValueError, match="n_experts"):
        coupled.expert_fractions(torch.tensor([0, 1]), 2.5)
    with pytest.raises(ValueError, match="one column per expert"):
        coupled.window_fractions(nn.Linear(4, 4).double(), [x[:4], x[4:]], 2)
    probs = torch.softmax(torch.randn(6, 4, dtype=torch.float64), 1)
    for fractions in (torch.full((4,), 1.0, dtype=torch.float64), torch.tensor([0.5, 0.5, 0.5, -0.5]).double()):
        with pytest.raises(ValueError, match="fractions"):
            coupled.switch_aux_loss(probs, fractions)
    with pytest.raises(ValueError, match="softmax"):
        coupled.switch_aux_loss(torch.randn(6, 4))
    for kwargs in (dict(reruns=-1), dict(reruns=0.5), dict(m=True), dict(m=None), dict(m=-0.1)):
        with pytest.raises(ValueError):
            coupled.recompute_momentum(**(dict(m=0.1, k=2) | kwargs))
    assert coupled.recompute_momentum(0.0, 4) == 0.0  # momentum 0 is legal: frozen running statistics
    with pytest.raises(ValueError, match="nn.Module"):
        coupled.checkpoint_keeping_bn_stats(lambda t: enc(t), x)


def test_coupled_tools_refuse_nan_and_wrong_types():
    """Third review of chapter 8: NaN fractions or router scores gave NaN or sent tokens to expert 0, a temperature
    whose inverse overflows gave NaN, mixed dtypes, lists and empty windows raised RuntimeError/AttributeError,
    recompute_momentum returned a NumPy float32, and aux_losses weighed unequal micro-batches by 1/K."""
    import numpy as np

    from gradaccum.book import ch08_beyond_batchnorm as ch8
    from gradaccum.book import exercises as ex
    from gradaccum.book.data import load_digits_split

    probs = torch.softmax(torch.randn(12, 4, dtype=torch.float64), 1)
    a, b = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    calls = [
        (
            lambda: coupled.switch_aux_loss(probs, torch.tensor([float("nan"), 1.0, 0.0, 0.0], dtype=torch.float64)),
            "summing to 1",
        ),
        (
            lambda: coupled.window_fractions(lambda x: torch.full((len(x), 4), float("nan")), [torch.randn(5, 6)], 4),
            "inf or NaN",
        ),
        (lambda: coupled.window_fractions(lambda x: x, [], 4), "no micro-batches"),
        (lambda: coupled.info_nce(a, b, 1e-320), "overflows"),
        (lambda: coupled.info_nce(a, b.float()), "one dtype"),
        (lambda: coupled.info_nce(torch.randn(8, 0), torch.randn(8, 0)), "d >= 1"),
        (lambda: coupled.info_nce(a, b * float("nan")), "inf or NaN"),
        (lambda: coupled.expert_fractions([0, 1], 3), "tensor"),
        (lambda: ex.grade_switch_aux(1.0, fractions=(float("nan"), 0.5)), "finite"),
    ]
    for call, match in calls:
        with pytest.raises(ValueError, match=match):
            call()
    assert type(coupled.recompute_momentum(np.float32(0.02), 5)) is float
    x = load_digits_split().x_train
    with pytest.raises(ValueError, match="does not divide"):
        ch8.aux_losses(x, (3,))
    with pytest.raises(ValueError, match="1600"):
        ch8.accumulation_error(x, 40, 40)
    assert "NT-Xent" in ex.grade_negatives_per_sample(12).message
    assert "NT-Xent" in ex.grade_negatives_per_sample(166).message
    assert "f_i goes with P_i" in ex.grade_switch_aux(0.9).message
    assert ex.grade_switch_aux(1.1, fractions=(np.float32(0.75), np.float32(0.25))).correct


def test_grad_cache_refuses_functions_arrays_tuples_and_unreduced_losses():
    """Review: each gave an AttributeError or RuntimeError from deep inside; now a ValueError that says what to do."""
    import numpy as np

    enc = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match="not an nn.Module"):
        coupled.grad_cache_backward([lambda t: t, enc], [x, x], 2)
    with pytest.raises(ValueError, match=r"torch.as_tensor"):
        coupled.grad_cache_backward([enc, enc], [np.ones((4, 3)), x], 2)

    class Pair(nn.Module):
        def forward(self, t):
            return t[:, :2], t[:, 1:]

    with pytest.raises(ValueError, match="returned a tuple"):
        coupled.grad_cache_backward([Pair(), enc], [x, x], 2)
    with pytest.raises(ValueError, match="scalar"):
        coupled.grad_cache_backward([enc, enc], [x, x], 2, lambda a, b: (a * b).sum(1))
    assert enc.weight.grad is None  # refused before any backward pass


class PerToken(nn.Module):
    """An encoder that returns one row per token: (b, T, d) in, (b·T, e) out."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.net = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5)).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).reshape(-1, 5)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_grad_cache_with_several_rows_per_sample_is_the_full_batch_gradient(k):
    """Review: an encoder returning one embedding per token ((b·T, d) from b samples) made step 3 slice the cached
    gradient by samples, failing with a raw autograd error after part of .grad was written. The slices follow the
    cached rows now, and the gradient is the full batch's."""
    g = torch.Generator().manual_seed(3)
    xa = torch.randn(8, 3, 6, generator=g, dtype=torch.float64)
    xb = xa + 0.1 * torch.randn(8, 3, 6, generator=g, dtype=torch.float64)
    encs = [PerToken(0), PerToken(1)]
    reference = full_batch([copy.deepcopy(e) for e in encs], [xa, xb])
    coupled.grad_cache_backward(encs, [xa, xb], k)
    assert rel(grads(*encs), reference) < 1e-13
    with pytest.raises(ValueError, match="0-dimensional"):
        coupled.grad_cache_backward([encoder(6, [5], 0), lambda_module(lambda x: x.sum())], list(pair(8)), 2)


class lambda_module(nn.Module):  # noqa: N801
    def __init__(self, f) -> None:
        super().__init__()
        self.f = f

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.f(x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_switch_aux_loss_takes_a_low_precision_softmax(dtype):
    """Review: a bf16 router softmax (rows off 1 by up to 2.6e-3) was refused as "not a softmax"; the slack is the
    dtype's rounding now, and logits are still refused, with the size of the error."""
    logits = torch.randn(512, 8, generator=torch.Generator().manual_seed(0)) * 3
    probs = logits.to(dtype).softmax(1)
    assert torch.isfinite(coupled.switch_aux_loss(probs))
    with pytest.raises(ValueError, match="off by"):
        coupled.switch_aux_loss(logits.to(dtype))


def test_grad_cache_refuses_an_encoder_that_scales_its_input_in_place():
    """Sixth review: x.div_(4) in forward scaled the input twice (step 1 and the replay): 56% off, silently."""

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 4).double()

        def forward(self, x):
            return self.lin(x.div_(4.0))

    torch.manual_seed(0)
    xq, xk = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match="returned another embedding"):
        coupled.grad_cache_backward([Scale(), Scale()], [xq, xk], 4)
