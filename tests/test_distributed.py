import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gradaccum import distributed as D
from gradaccum.accumulate import agreement, full_batch_gradient
from gradaccum.models import make_cnn


def test_no_sync_same_gradients_and_one_allreduce(digits):
    ranks = D.launch("equality", world_size=2, k=4, b=8)
    for res in ranks:
        sync, nosync = res["sync every micro-batch"], res["no_sync"]
        assert (sync["calls"], nosync["calls"]) == (4, 1)
        assert sync["bytes"] == 4 * nosync["bytes"] == 4 * 8 * res["params"]
        assert torch.allclose(sync["grad"], nosync["grad"], rtol=0, atol=1e-15)
    full = full_batch_gradient(make_cnn("group"), torch.nn.CrossEntropyLoss(), digits.x_train[:64], digits.y_train[:64])
    assert agreement(full, ranks[1]["no_sync"]["grad"]).rel_error < 1e-12


def test_single_process_group_works():
    res = D.launch("equality", world_size=1, k=2, b=4)[0]
    assert res["no_sync"]["calls"] == 1


@pytest.mark.parametrize("how, message", [("raise", "failed on purpose"), ("exit", "exit code 3")])
def test_failed_worker_surfaces_quickly_and_leaves_nothing(how, message):
    start = time.perf_counter()
    with pytest.raises(D.WorkerFailed, match=message):
        D.launch("crash", world_size=2, crash_rank=1, how=how)
    assert time.perf_counter() - start < 60
    assert not multiprocessing.active_children()


def test_hung_worker_is_killed_at_the_deadline():
    start = time.perf_counter()
    with pytest.raises(D.WorkerFailed, match="did not finish within 5 s"):
        D.launch("crash", world_size=2, timeout=5, crash_rank=0, how="hang", pg_timeout=120)
    assert time.perf_counter() - start < 20
    assert not multiprocessing.active_children()
    ps = subprocess.run(["ps", "-eo", "ppid,cmd"], capture_output=True, text=True).stdout
    assert not [line for line in ps.splitlines() if line.split()[0] == str(os.getpid()) and "spawn" in line]


def test_launch_arguments():
    with pytest.raises(ValueError, match="unknown task"):
        D.launch("dance")
    with pytest.raises(ValueError, match="world_size"):
        D.launch("equality", world_size=0)
    with pytest.raises(ValueError, match="timeout"):
        D.launch("equality", timeout=0)


def test_free_port_is_bindable():
    import socket

    port = D.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_ring_model_and_fit():
    link = D.Interconnect("x", bandwidth=1e9, latency=1e-5, source="test")
    assert D.ring_allreduce_time(1e9, 1, link) == 0.0
    assert D.ring_allreduce_time(1e9, 2, link) == pytest.approx(2e-5 + 1.0)
    assert D.ring_allreduce_time(1e9, 8, link) == pytest.approx(14e-5 + 1.75)
    sizes = [1e3, 1e5, 1e7]
    fitted = D.fit_alpha_beta(sizes, [D.ring_allreduce_time(n, 4, link) for n in sizes], 4)
    assert fitted.bandwidth == pytest.approx(1e9, rel=1e-6) and fitted.latency == pytest.approx(1e-5, rel=1e-6)
    with pytest.raises(ValueError):
        D.fit_alpha_beta([1e3], [1.0], 2)


def test_predict_step():
    link = D.PRESETS["Ethernet 10 Gb/s"]
    pred = D.predict_step(10**6, 8, 4, link, 0.01)
    assert pred.saving == pytest.approx(7 * D.ring_allreduce_time(4e6, 4, link))
    assert D.predict_step(10**6, 1, 4, link, 0.01).saving == 0
    with_copy = D.predict_step(10**6, 2, 4, link, 0.0, copy_bandwidth=1e10)
    assert with_copy.saving == pytest.approx(D.ring_allreduce_time(4e6, 4, link) + 3 * 4e6 / 1e10)
    with pytest.raises(ValueError):
        D.predict_step(0, 2, 2, link, 0.1)
    grid = D.savings_grid(10**9, [1, 8], [2, 64], link, 0.1)
    assert grid.shape == (2, 2) and (grid[0] == 0).all() and (grid[1] > 0.5).all()


def test_analyse_timing_on_synthetic_measurements():
    link = D.Interconnect("x", 1e9, 1e-4, "t")
    sizes = [4 * 2**10, 4 * 2**16, 4 * 2**20]
    params = {64: 10**5}
    saving = 3 * (D.ring_allreduce_time(4e5, 2, link) + 3 * 4e5 / 1e10)
    result = {"allreduce": {s: D.ring_allreduce_time(s, 2, link) for s in sizes}, "copy": {s: s / 1e10 for s in sizes},
              "params": params, "steps": {(64, 1, False): 1.0, (64, 1, True): 1.0, (64, 4, False): 1.0 + saving,
                                          (64, 4, True): 1.0}}
    fit = D.analyse_timing(result, p=2)
    assert fit.link.bandwidth == pytest.approx(1e9, rel=1e-6)
    (row,) = [r for r in fit.rows if r[2] == 4]
    assert row[6] == pytest.approx(row[5], rel=1e-6)  # a perfect model predicts the saving exactly
    assert "bandwidth" in D.format_timing(fit)


def test_figures():
    import matplotlib

    matplotlib.use("Agg")
    assert len(D.plot_prediction(100, 8, 16, "PCIe 4.0 x16", 50).axes) == 1
    with pytest.raises(ValueError, match="interconnect"):
        D.plot_prediction(100, 8, 16, "carrier pigeon", 50)
    assert len(D.plot_savings_grid(10**8, [1, 4], [2, 8], 0.1, ["PCIe 4.0 x16"]).axes) == 2


def test_torchrun_script_runs():
    torchrun = Path(sys.executable).with_name("torchrun")
    script = Path(__file__).resolve().parents[1] / "scripts" / "ddp_train.py"
    proc = subprocess.run([str(torchrun), "--nproc_per_node=2", "--master_port", str(D.free_port()), str(script),
                           "--k", "2", "--b", "4", "--steps", "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "backend gloo" in proc.stdout and "max |params(sync) - params(no_sync)|" in proc.stdout
    diff = float(proc.stdout.rsplit("=", 1)[1])
    assert diff < 1e-12
