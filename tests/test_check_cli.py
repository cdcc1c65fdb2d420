"""`python -m gradaccum.checker` for CI: --clip, --tolerance, --seed, --json, --no-partial; exit 0 = no bug,
1 = bug found, 2 = usage error; --demo fails when a planted bug is missed or a correct loop is flagged; the checker
imports without the book's plotting and widget stack."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from layout import ROOT

from gradaccum import checker as C
from gradaccum.book import check_demo

MODULE = textwrap.dedent("""
    import torch
    from torch import nn
    from gradaccum.book.data import load_digits_split
    from gradaccum.book.models import make_cnn


    def data():
        d = load_digits_split()
        return d.x_train[:16], d.y_train[:16]


    def clip_once(model, loss_fn, x, y, k):
        for xb, yb in zip(x.chunk(k), y.chunk(k)):
            (loss_fn(model(xb), yb) / k).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)


    def missing_k(model, loss_fn, x, y, k):
        for xb, yb in zip(x.chunk(k), y.chunk(k)):
            loss_fn(model(xb), yb).backward()


    def seeded_dropout():
        torch.nn.Dropout(0.5)(torch.ones(3))  # make() may use the global RNG: --seed fixes it
        return nn.Sequential(nn.Flatten(), nn.Dropout(0.5), nn.Linear(64, 10)).double()


    def good():
        return (make_cnn("group"), nn.CrossEntropyLoss(), *data())


    def clipped():
        return (*good(), clip_once)


    def buggy():
        return (*good(), missing_k)


    def dropout():
        return (seeded_dropout(), nn.CrossEntropyLoss(), *data())


    def raises():
        raise RuntimeError("no data here")


    def short():
        return good()[:3]


    def indivisible():
        model, loss_fn, x, y = good()
        return model, loss_fn, x[:10], y[:10]
""")


def run(*args: str, cwd=None, env=None) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "gradaccum.checker", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=environment,
    )


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli")
    (path / "loops.py").write_text(MODULE)
    return path


@pytest.fixture
def cli(folder, monkeypatch, capsys):
    """The command line run in this process (a subprocess costs seconds of imports): (status, stdout, stderr)."""
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))

    def call(*args: str) -> tuple[int, str, str]:
        try:
            status = C.main(list(args))
        except SystemExit as exit_:  # argparse's usage errors
            status = exit_.code
        out = capsys.readouterr()
        return status, out.out, out.err

    return call


@pytest.mark.slow
def test_a_usage_error_exits_2_without_a_traceback_in_a_real_process(folder):
    """(Exit statuses 0 and 1 of a real process: the page's console examples, tests/test_check_page.py.)"""
    usage = run("loops:raises", cwd=folder)
    assert usage.returncode == 2 and "raises() raised RuntimeError" in usage.stderr and "Traceback" not in usage.stderr


def test_exit_status_0_and_1(cli):
    assert cli("loops:good", "-k", "4")[0] == 0
    status, out, _ = cli("loops:buggy", "-k", "4")
    assert status == 1 and "missing 1/K" in out


def test_usage_errors_exit_2_with_a_message(cli):
    for args, message in [
        (("loops:raises",), "raises() raised RuntimeError: no data here"),
        (("loops:short",), "must return (model, loss_fn, x, y)"),
        (("loops:nothing",), "has no function nothing"),
        (("nomodule:make",), "cannot import nomodule"),
        (("loops",), "module:function"),
        (("loops:indivisible", "-k", "4"), "divisors of 10"),
        (("loops:good", "-k", "0"), "-k must be >= 1"),
        (("loops:good", "--clip", "-1"), "--clip must be a positive"),
        (("loops:good", "--tolerance", "0"), "--tolerance must be a positive"),
        (("loops:good", "--seed", "-3"), "--seed must be >= 0"),
        (("loops:good", "--demo"), "python -m gradaccum.book.check_demo"),
        (("--demo",), "--demo moved to the book layer"),
        ((), "give module:function"),
        (("loops:good", "--bogus"), "unrecognized arguments"),
    ]:
        status, out, err = cli(*args)
        assert status == 2 and message in err, (args, out, err)
        assert "Traceback" not in err


def test_a_file_path_target_works_from_anywhere(cli, folder, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli(f"{folder / 'loops.py'}:good")[0] == 0
    # a file that imports its neighbour (the page's my_fixed_loop.py imports my_loop) failed to import
    # from any other folder; its own folder now comes first, as with `python path/to/file.py`
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "neighbour_of_loops.py").write_text("from loops_copy import good, buggy  # noqa: F401\n")
    (other / "loops_copy.py").write_text((folder / "loops.py").read_text())
    assert cli(f"{other / 'neighbour_of_loops.py'}:good")[0] == 0
    assert cli(f"{other / 'neighbour_of_loops.py'}:buggy")[0] == 1


def test_clip_once_is_ok_with_or_without_clip_and_wrong_with_another_threshold(cli):
    assert cli("loops:clipped")[0] == 0  # the loop's own threshold is read
    assert cli("loops:clipped", "--clip", "0.05")[0] == 0
    status, out, _ = cli("loops:clipped", "--clip", "0.5")
    assert status == 1 and "scaled by a constant factor" in out
    assert cli("loops:good", "--clip", "0.05")[0] == 1  # --clip, but the loop never clips


def test_tolerance_decides_what_counts_as_equal(cli):
    assert cli("loops:buggy", "--tolerance", "10")[0] == 0  # relative error 3 < 10
    assert cli("loops:buggy", "--tolerance", "1")[0] == 1


def test_no_partial_skips_the_partial_window(cli, folder):
    (folder / "fixed.py").write_text(
        MODULE
        + textwrap.dedent("""
        def fixed_k(model, loss_fn, x, y, k):
            for xb, yb in zip(x.chunk(k), y.chunk(k)):
                (loss_fn(model(xb), yb) / 4).backward()


        def make():
            return (*good(), fixed_k)
    """)
    )
    status, out, _ = cli("fixed:make")
    assert status == 1 and "partial window" in out
    assert cli("fixed:make", "--no-partial")[0] == 0


def test_json_report(cli):
    status, out, _ = cli("loops:buggy", "--json")
    data = json.loads(out)
    assert status == 1 and data["ok"] is False and data["k"] == 4
    assert [f["code"] for f in data["findings"]] == ["missing_1_over_k"]
    assert data["rel_error"] == pytest.approx(3.0) and data["weights"] == pytest.approx([1.0] * 4)
    status, out, _ = cli("loops:good", "--json")
    assert status == 0 and json.loads(out)["ok"] is True and json.loads(out)["findings"] == []


def test_seed_makes_the_run_reproducible(cli):
    a, b = cli("loops:dropout", "--json", "--seed", "3"), cli("loops:dropout", "--json", "--seed", "3")
    ra, rb = json.loads(a[1]), json.loads(b[1])
    assert a[0] == b[0] == 0 and ra["findings"] == rb["findings"] == [] and ra["notes"] == rb["notes"]
    assert "replayed per sample" in ra["notes"][0] and ra["weights"] == pytest.approx(rb["weights"], abs=1e-12)


def test_demo_fails_when_a_planted_bug_is_missed_or_a_correct_loop_flagged(monkeypatch, capsys):
    cases = check_demo.demo_cases()
    keep = ["correct loop, GroupNorm", "missing 1/K"]
    monkeypatch.setattr(check_demo, "demo_cases", lambda: {name: cases[name] for name in keep})
    assert check_demo.main([]) == 0
    monkeypatch.setitem(check_demo.DEMO_EXPECTED, "missing 1/K", ("zero_grad_inside_window",))  # a miss
    assert check_demo.main([]) == 1
    monkeypatch.setitem(check_demo.DEMO_EXPECTED, "missing 1/K", ("missing_1_over_k",))
    monkeypatch.setitem(check_demo.DEMO_EXPECTED, "correct loop, GroupNorm", ("batch_coupled_layer",))  # a false alarm
    assert check_demo.main([]) == 1
    out = capsys.readouterr().out
    assert "NOT AS EXPECTED" in out and "demo: 1 of 2 verdicts as expected" in out


def test_demo_json(monkeypatch, capsys):
    cases = check_demo.demo_cases()
    monkeypatch.setattr(check_demo, "demo_cases", lambda: {"BatchNorm": cases["BatchNorm"]})
    assert check_demo.main(["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["all_as_expected"] and data["cases"][0]["report"]["findings"][0]["code"] == "batch_coupled_layer"


@pytest.mark.slow
def test_the_checker_imports_and_runs_without_matplotlib_sklearn_ipywidgets():
    code = textwrap.dedent("""
        import sys
        for name in ("matplotlib", "sklearn", "ipywidgets"):
            sys.modules[name] = None  # any import of them raises ImportError
        import torch
        from torch import nn
        from gradaccum.checker import check
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.2), nn.Linear(8, 3)).double()
        x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
        report = check(model, nn.CrossEntropyLoss(), x, y, 4)
        assert report.ok, report
        assert not any(m.split(".")[0] in ("matplotlib", "sklearn", "ipywidgets") and sys.modules[m] is not None
                       for m in sys.modules)
        print("imports fine")
    """)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert out.returncode == 0 and "imports fine" in out.stdout, out.stderr[-3000:]
