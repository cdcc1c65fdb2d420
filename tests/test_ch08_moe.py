"""Chapter 8's fine print on mixture-of-experts routing, batch-size rules and contrastive losses across ranks: the
core's replayed counting pass and window-normalized z-loss, the book's measurements behind the page's ranges, and
the rules checked against PyTorch's own optimizers and averages."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gradaccum import load_balancing as lb
from gradaccum.book import ch08_moe as moe
from gradaccum.book import ch08_rules as rules
from gradaccum.book.data import load_digits_split


def _dropout_router(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Dropout(0.3), nn.Linear(6, 4)).double().train()


def test_a_replayed_counting_pass_routes_every_token_as_the_training_pass_does():
    router = _dropout_router()
    micro = [torch.randn(40, 6, dtype=torch.float64) for _ in range(3)]
    counted = []

    def counting(x):
        scores = router(x)
        counted.append(scores.argmax(1))
        return scores

    window = lb.count_window(counting, micro, 4)
    fresh = torch.cat([router(x).argmax(1) for x in micro])
    before = torch.get_rng_state()
    replayed = []
    for k, x in enumerate(micro):
        with window.replay(k):
            replayed.append(router(x).argmax(1))
    assert torch.equal(torch.get_rng_state(), before)  # the caller's random stream is left alone
    assert torch.equal(torch.cat(replayed), torch.cat(counted))
    assert not torch.equal(fresh, torch.cat(counted))  # fresh masks route some tokens elsewhere
    assert torch.equal(window.fractions, lb.expert_fractions(torch.cat(replayed), 4))
    with pytest.raises(ValueError, match="micro-batch index"):
        with window.replay(3):
            pass


def test_window_fractions_is_the_counted_window_without_randomness():
    w = torch.randn(4, 6, dtype=torch.float64)
    micro = [torch.randn(10, 6, dtype=torch.float64), torch.randn(7, 6, dtype=torch.float64)]
    counted = lb.count_window(lambda x: x @ w.T, micro, 4)
    assert torch.equal(counted.fractions, lb.window_fractions(lambda x: x @ w.T, micro, 4))
    assert len(counted.rng_states) == 2
    with pytest.raises(ValueError, match="no micro-batches"):
        lb.count_window(lambda x: x, [], 4)


def test_the_z_loss_divided_by_the_window_tokens_adds_up_to_the_window_loss():
    torch.manual_seed(0)
    logits = torch.randn(31, 5, dtype=torch.float64, requires_grad=True)
    parts = logits.split([20, 8, 3])
    window = lb.router_z_loss(logits)
    summed = sum(lb.router_z_loss(p, tokens=31) for p in parts)
    means = sum(lb.router_z_loss(p) for p in parts) / 3
    expected = torch.logsumexp(logits, 1).pow(2).mean()
    assert abs(float((window - expected).detach())) < 1e-12 and abs(float((summed - window).detach())) < 1e-12
    g_window, g_summed, g_means = (
        torch.autograd.grad(v, logits, retain_graph=True)[0] for v in (window, summed, means)
    )
    assert torch.allclose(g_summed, g_window, rtol=0, atol=1e-15)
    assert (g_means - g_window).norm() > 0.1 * g_window.norm()  # unequal sizes: the mean of means is another loss
    for bad, match in (
        (lambda: lb.router_z_loss(logits, tokens=10), "fewer than"),
        (lambda: lb.router_z_loss(torch.zeros(4)), "tokens, experts"),
        (lambda: lb.router_z_loss(torch.zeros(4, 3, dtype=torch.long)), "floating-point"),
        (lambda: lb.router_z_loss(logits, tokens=0), "tokens must be"),
    ):
        with pytest.raises(ValueError, match=match):
            bad()


def test_balancing_error_vanishes_for_one_micro_batch_and_grows_with_documents():
    x, w = moe.document_tokens(0.2, 3), moe.router_weights(3)
    loss, grad = moe.balancing_error(moe.micro_batches(x, False, 1), w)
    assert abs(loss) < 1e-12 and grad < 1e-12
    iid = moe.balancing_error(moe.micro_batches(x, True, 4, 3), w)
    docs = moe.balancing_error(moe.micro_batches(x, False, 4), w)
    assert 0 < iid[1] < docs[1] and docs[1] > 5 * docs[0]


def test_the_page_ranges_hold_on_other_seeds():
    """Seeds 5-9 (the page uses 0-4): i.i.d. micro-batches of 2,048 keep the gradient within 1-6%, a few documents
    per micro-batch put it past 5% at the weakest preference, and the gradient always moves more than the loss."""
    study = moe.moe_gradient_study((0.1, 0.3), range(5, 10))
    iid = [v[1] for (layout, _, _), v in study.items() if layout == "i.i.d., 2,048 tokens"]
    docs = [v[1] for (layout, _, _), v in study.items() if layout == "4 documents, 2,048 tokens"]
    assert 0.005 < min(iid) and max(iid) < 0.06 and min(docs) > 0.05 and max(docs) > 0.5
    assert all(abs(g) > 5 * abs(d) for d, g in study.values())


def test_the_moe_measurements_are_deterministic_and_refuse_bad_input():
    assert moe.moe_gradient_study((0.2,), (1,)) == moe.moe_gradient_study((0.2,), (1,))
    assert torch.equal(moe.document_tokens(0.0, 1), moe.document_tokens(0.0, 1))
    state = torch.get_rng_state()
    out = moe.dropout_reroute(seed=2)
    assert torch.equal(torch.get_rng_state(), state) and out["replayed"] == 0 and out["fresh masks"] > 0.1
    for bad in (
        lambda: moe.document_tokens(-1.0, 0),
        lambda: moe.micro_batches(torch.zeros(10, 2), False, 3),
        lambda: moe.dropped_share([torch.zeros(4, moe.DIM)], moe.router_weights(0), 0.0),
    ):
        with pytest.raises(ValueError):
            bad()


def test_dropped_share_counts_tokens_over_each_experts_capacity():
    w = torch.zeros(moe.EXPERTS, moe.DIM, dtype=torch.float64)
    w[0, 0] = w[1, 1] = 1.0
    x = torch.zeros(16, moe.DIM, dtype=torch.float64)
    x[:12, 0] = 1.0  # 12 tokens to expert 0, 4 to expert 1: capacity ceil(1.25 * 16 / 8) = 3 per expert
    x[12:, 1] = 1.0
    assert moe.dropped_share([x], w) == (9 + 1) / 16
    assert moe.dropped_share([x], w, capacity_factor=8.0) == 0.0


def test_the_fine_print_numbers_on_other_seeds():
    z = moe.z_loss_error(seed=4)
    assert z["mean of micro-batch means"] > 0.05 and z["divided by the window's tokens"] < 1e-12
    signs = moe.bias_update_signs(4, steps=40)
    assert signs["one rank's window"] < signs["last micro-batch"] and signs["last micro-batch"] > 0.25
    dropped = moe.capacity_study(seeds=range(5, 8))
    assert all(w <= m for w, m in zip(dropped["the window, 8,192 tokens"], dropped["1 document, 512 tokens"]))


def test_the_ema_and_weight_decay_rules_with_pytorchs_own_classes():
    assert abs(rules.ema_start_weight(0.99, 37) - 0.99**37) < 1e-12
    for kappa in (2, 4, 8):
        assert abs(rules.ema_start_weight(0.995**kappa, 400 // kappa) - rules.ema_start_weight(0.995, 400)) < 1e-9
        base = rules.decay_per_epoch("AdamW", 1e-3, 0.05, 800)
        as_is = rules.decay_per_epoch("AdamW", 1e-3 * math.sqrt(kappa), 0.05, 800 // kappa)
        scaled = rules.decay_per_epoch("AdamW", 1e-3 * math.sqrt(kappa), 0.05 * math.sqrt(kappa), 800 // kappa)
        assert abs(math.log(as_is) / math.log(base) - 1 / math.sqrt(kappa)) < 1e-3 and abs(scaled - base) < 1e-4
        sgd = rules.decay_per_epoch("SGD", 0.01 * kappa, 1e-2, 800 // kappa)
        assert abs(sgd - rules.decay_per_epoch("SGD", 0.01, 1e-2, 800)) < 1e-3
    assert abs(rules.decay_per_epoch("AdamW", 1e-2, 0.1, 10) - (1 - 1e-3) ** 10) < 1e-12
    for bad in (
        lambda: rules.ema_start_weight(1.0, 3),
        lambda: rules.decay_per_epoch("Adam", 1e-3, 0.1, 3),
        lambda: rules.step_progress(0, 10),
    ):
        with pytest.raises(ValueError):
            bad()


def test_the_noise_scale_matches_per_sample_gradients_from_autograd():
    split = load_digits_split()
    x, y = split.x_train[:60], split.y_train[:60]
    feats = x.reshape(60, -1).double()
    weights = torch.zeros(64, 10, dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(10, dtype=torch.float64, requires_grad=True)
    grads = []
    for i in range(60):
        loss = nn.functional.cross_entropy(feats[i : i + 1] @ weights + bias, y[i : i + 1])
        gw, gb = torch.autograd.grad(loss, (weights, bias))
        grads.append(torch.cat([gw.reshape(-1), gb]))
    g = torch.stack(grads)
    expected = float((g - g.mean(0)).pow(2).sum() / 60 / g.mean(0).pow(2).sum())
    assert abs(rules.noise_scale(x, y, (0,))[0] - expected) < 1e-9 * expected
    early, late = rules.noise_scale(split.x_train, split.y_train, (0, 300))
    assert late > 3 * early
    assert rules.step_progress(10, 10) == 0.5


@pytest.mark.slow
def test_contrastive_gradients_across_two_gloo_ranks():
    from gradaccum.book.ch08_ddp import GRAD_CACHES, contrastive_ddp, start_fork_server

    start_fork_server()  # as the chapter does: started early, in the background; the launch forks from it
    g = torch.Generator().manual_seed(3)
    a, b = torch.rand(16, 64, generator=g, dtype=torch.float64), torch.rand(16, 64, generator=g, dtype=torch.float64)
    out = contrastive_ddp(a, b)
    assert out["own pairs only"]["error"] > 0.01
    for half in (out["all_gather, no gradient"], out[GRAD_CACHES[0]]):  # exactly half the gradient
        assert abs(half["error"] - 0.5) + abs(half["norm ratio"] - 0.5) < 1e-12
    exact = ("all_gather with gradient", "with gradient, own rows", GRAD_CACHES[1])
    assert all(out[how]["error"] < 1e-12 for how in exact)
    with pytest.raises(ValueError, match="pairs"):
        contrastive_ddp(a[:12], b[:12])


def _coupled_loss(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A loss written for the test: each row's term reads every row of the batch (a softmax and a batch mean)."""
    return torch.logsumexp(a @ b.T, dim=1).mean() - (a * b).sum(1).mean() + a.mean(0).pow(2).sum()


def _encoder_for_test() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _grad_cache_rank(rank: int, world: int, folder: str, xa: torch.Tensor, xb: torch.Tensor) -> None:
    """One gloo rank: its share of the pairs through GradCache (K = 3) on a DDP encoder, without and with the
    factor p; saves the loss and the two synced gradients."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradaccum.book.ch08_ddp import grad_cache_ddp_backward

    torch.set_num_threads(1)
    store = f"file://{folder}/store"
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    model, rows = DDP(_encoder_for_test()), slice(rank * len(xa) // world, (rank + 1) * len(xa) // world)
    grads = []
    for scale in (False, True):
        model.zero_grad(set_to_none=True)
        loss = grad_cache_ddp_backward(model, (xa[rows], xb[rows]), 3, _coupled_loss, scale)
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    torch.save((loss, grads), f"{folder}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow
def test_grad_cache_across_ddp_ranks_gives_the_global_batch_gradient_once_scaled_by_p(tmp_path):
    """GradCache on 2 gloo ranks (K = 3 micro-batches of 2 each): DDP's averaged gradient is the gradient of the
    loss over all 12 samples with the cached gradients scaled by p = 2, and exactly half of it without."""
    g = torch.Generator().manual_seed(0)
    xa, xb = (torch.randn(12, 5, generator=g, dtype=torch.float64) for _ in range(2))
    torch.multiprocessing.spawn(_grad_cache_rank, args=(2, str(tmp_path), xa, xb), nprocs=2)
    reference = _encoder_for_test()
    full = _coupled_loss(reference(xa), reference(xb))
    full.backward()
    expected = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    for rank in (0, 1):
        loss, (unscaled, scaled) = torch.load(tmp_path / f"rank{rank}.pt")
        assert abs(loss - float(full.detach())) < 1e-12
        assert float((scaled - expected).norm()) < 1e-12 * float(expected.norm())
        assert float((unscaled - expected / 2).norm()) < 1e-12 * float(expected.norm())


def test_grad_cache_across_ranks_refuses_a_model_outside_ddp():
    from gradaccum.book.ch08_ddp import grad_cache_ddp_backward

    x = torch.randn(6, 5, dtype=torch.float64)
    with pytest.raises(ValueError, match="DistributedDataParallel"):
        grad_cache_ddp_backward(_encoder_for_test(), (x, x), 3, _coupled_loss)
