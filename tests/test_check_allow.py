"""Declared, expected findings (``check(..., allow=[...])``, ``--allow CODE``) and the inputs the checker refuses
before it runs anything: non-finite data, a step that cannot take the window's K."""

import pytest
import torch
from torch import nn

from gradaccum import check
from gradaccum.checker import main


def bn_mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)).double()


def data(n=16):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


def missing_1_over_k(model, loss_fn, x, y, k):
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        loss_fn(model(xb), yb).backward()


def test_an_allowed_batchnorm_finding_is_reported_but_does_not_fail_the_check():
    x, y = data()
    plain = check(bn_mlp(), nn.CrossEntropyLoss(), x, y, 4)
    assert not plain.ok and "batch_coupled_layer" in plain.codes
    allowed = check(bn_mlp(), nn.CrossEntropyLoss(), x, y, 4, allow=["batch_coupled_layer"])
    assert allowed.ok, str(allowed)
    assert "batch_coupled_layer" in allowed.codes  # still reported
    assert "(allowed)" in str(allowed) and allowed.to_dict()["allowed"] == ["batch_coupled_layer"]


def test_the_batchnorm_fix_names_the_remedies_and_how_to_accept_the_difference():
    """Issue 39: the fix names the toolkit's two BatchNorm schemes, the per-sample norms, and the allow option."""
    x, y = data()
    (finding,) = check(bn_mlp(), nn.CrossEntropyLoss(), x, y, 4).findings
    for name in (
        "gradaccum.ghostify",
        "gradaccum.full_batch_stats_backward",
        "GroupNorm/LayerNorm",
        "allow=['batch_coupled_layer']",
        "--allow batch_coupled_layer",
    ):
        assert name in finding.fix, finding.fix


def test_a_bug_beside_an_allowed_finding_still_fails():
    x, y = data()
    report = check(bn_mlp(), nn.CrossEntropyLoss(), x, y, 4, step=missing_1_over_k, allow=["batch_coupled_layer"])
    assert not report.ok and "missing_1_over_k" in report.codes, str(report)


@pytest.mark.parametrize("allow", [["no_such_code"], "batch_coupled_layer", None])
def test_allow_takes_a_list_of_known_codes(allow):
    x, y = data()
    with pytest.raises(ValueError, match="allow"):
        check(bn_mlp(), nn.CrossEntropyLoss(), x, y, 4, allow=allow)


def test_non_finite_inputs_are_refused_before_anything_runs():
    x, y = data()
    x[3, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        check(bn_mlp(), nn.CrossEntropyLoss(), x, y, 4)


def test_a_step_without_k_is_a_usage_error_not_a_raising_loop():
    x, y = data()

    def step(model, loss_fn, x, y):  # forgot k
        loss_fn(model(x), y).backward()

    with pytest.raises(ValueError, match=r"step must take \(model, loss_fn, x, y, k\)"):
        check(bn_mlp(), nn.CrossEntropyLoss(), x, y, 4, step=step)


def test_the_command_line_allows_a_code(tmp_path, monkeypatch, capsys):
    (tmp_path / "bn_loop.py").write_text(
        "import torch\nfrom torch import nn\n\n\ndef make():\n    torch.manual_seed(0)\n"
        "    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)).double()\n"
        "    x = torch.randn(16, 6, dtype=torch.float64)\n    y = torch.randint(0, 3, (16,))\n"
        "    return model, nn.CrossEntropyLoss(), x, y\n"
    )
    monkeypatch.chdir(tmp_path)
    assert main(["bn_loop:make", "-k", "4"]) == 1
    assert main(["bn_loop:make", "-k", "4", "--allow", "batch_coupled_layer"]) == 0
    assert "(allowed)" in capsys.readouterr().out
    assert main(["bn_loop:make", "--allow", "no_such_code", "--json"]) == 2
