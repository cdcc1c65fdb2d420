import multiprocessing
import os
import subprocess
import sys
import time

import pytest
import torch

from gradaccum import distributed
from gradaccum.accumulate import agreement, full_batch_gradient
from gradaccum.book import ch05_no_sync as ch5
from gradaccum.book import ddp_tasks, ddp_workers, exercises, parallel
from gradaccum.book.models import make_cnn


def test_no_sync_same_gradients_and_one_allreduce(digits):
    ranks = ch5.launch("equality", world_size=2, k=4, b=8)
    for res in ranks:
        sync, nosync = res["sync every micro-batch"], res["no_sync"]
        assert (sync["calls"], nosync["calls"]) == (4, 1)
        assert sync["bytes"] == 4 * nosync["bytes"] == 4 * 8 * res["params"]
        assert torch.allclose(sync["grad"], nosync["grad"], rtol=0, atol=1e-15)
    full = full_batch_gradient(make_cnn("group"), torch.nn.CrossEntropyLoss(), digits.x_train[:64], digits.y_train[:64])
    assert agreement(full, ranks[1]["no_sync"]["grad"]).rel_error < 1e-12


@pytest.mark.slow
def test_calls_per_step_equal_the_buckets_from_the_second_step(digits):
    """Exercise ex-ch5-calls: 3 buckets, K = 8 → 24 calls per step without no_sync, 3 with it; the first step
    still has one bucket until its first synchronized backward (1 + 7·3 = 22, and 1)."""
    ranks = ch5.launch("equality", world_size=2, k=8, b=2, steps=3, bucket_cap_mb=0.005)
    for res in ranks:
        assert res["sync every micro-batch"]["calls per step"] == [22, 24, 24]
        assert res["no_sync"]["calls per step"] == [1, 3, 3]
    assert exercises.grade_allreduce_calls(24, k=8, buckets=3).correct


@pytest.mark.slow
def test_placement_of_the_last_forward(digits):
    """Chapter 5's pitfall and exercise ex-ch5-forward: the last forward inside no_sync() → no all-reduce, ranks
    keep their own gradients; every forward outside (backward inside) → K all-reduces, the right gradient."""
    ranks = ch5.launch("placement", world_size=2, k=4, b=8)
    for res in ranks:
        calls = {name: res[name]["calls"] for name in distributed.PLACEMENTS}
        assert calls == {"sync every micro-batch": 4, "no_sync": 1, "last forward inside": 0, "forward outside": 4}
        reference = res["sync every micro-batch"]["grad"]
        for name in ("no_sync", "forward outside"):
            assert torch.allclose(res[name]["grad"], reference, rtol=0, atol=1e-15)
        assert torch.allclose(res["last forward inside"]["grad"], res["local"], rtol=0, atol=1e-15)
    gap = (ranks[0]["last forward inside"]["grad"] - ranks[1]["last forward inside"]["grad"]).abs().max()
    assert gap > 0.1
    assert torch.equal(ranks[0]["no_sync"]["grad"], ranks[1]["no_sync"]["grad"])


@pytest.mark.slow
def test_a_parameter_unused_in_the_last_micro_batch_is_silently_unsynchronized_by_no_sync(digits):
    """Sixth review: with the default find_unused_parameters=False, a parameter used only inside no_sync() leaves
    its bucket unready: the step launches no all-reduce and each rank keeps its own gradient, where the naive loop
    raises in the step; find_unused_parameters=True gives the ranks' average (one all-reduce)."""
    ranks = ch5.launch("unused", world_size=2, k=3, b=8)
    for res in ranks:
        assert res["sync every micro-batch"].startswith("RuntimeError: Expected to have finished reduction")
        assert res["no_sync"]["calls"] == 0
        assert res["no_sync, find_unused_parameters=True"]["calls"] == 1
    own = [res["no_sync"]["grad"] for res in ranks]
    assert (own[0] - own[1]).abs().max() > 1e-3  # the ranks step apart
    average = (own[0] + own[1]) / 2
    for res in ranks:
        assert torch.allclose(res["no_sync, find_unused_parameters=True"]["grad"], average, rtol=0, atol=1e-15)


def test_placed_accumulate_rejects_an_unknown_placement():
    with pytest.raises(ValueError, match="unknown placement"):
        distributed.placed_accumulate(None, None, torch.zeros(4, 1), torch.zeros(4), 2, "backward first")


def test_micro_batch_that_fits():
    assert distributed.micro_batch_that_fits(1221, 2, 4, 5) == 8  # README: 2 processes, K = 4
    assert distributed.micro_batch_that_fits(1221, 8, 8, 5) == 3  # one node of 8
    assert distributed.micro_batch_that_fits(1221, 16, 4, 5) == 3  # two nodes of 8
    assert distributed.micro_batch_that_fits(1221, 2, 4, 5, cap=100) == 30
    with pytest.raises(ValueError, match="use at most 9 steps"):
        distributed.micro_batch_that_fits(1221, 16, 8, 10)
    with pytest.raises(ValueError, match="world_size"):
        distributed.micro_batch_that_fits(1221, 0, 8, 10)


def test_shard_that_does_not_fit_says_what_to_do(digits):
    with pytest.raises(ValueError, match="lower the micro-batch size"):
        ddp_tasks._shard(7, 8, 320, torch.float64, (digits.x_train, digits.y_train))


def test_ring_and_saving_exercises():
    """Exercises ex-ch5-bytes (175 MB) and ex-ch5-saving (17.5 ms per all-reduce, 122.5 ms per step)."""
    link = distributed.Interconnect("10 GB/s", bandwidth=10e9, latency=0.0, source="exercise")
    sent = distributed.ring_allreduce_time(100e6, 8, link) * link.bandwidth
    assert sent == pytest.approx(175e6) and exercises.grade_ring_bytes(175, p=8, megabytes=100).correct
    assert distributed.ring_allreduce_time(100e6, 8, link) == pytest.approx(17.5e-3)
    saving = distributed.predict_step(25_000_000, 8, 8, link, 0.0).saving  # 25 M fp32 gradients = 100 MB
    assert saving == pytest.approx(122.5e-3)
    assert exercises.grade_nosync_saving(122.5, k=8, p=8, megabytes=100, gb_per_s=10).correct
    # sixth review: at K = p, "K all-reduces" and "the large-p 2n with K − 1" both give 140: both are named
    both = exercises.grade_nosync_saving(140, k=8, p=8, megabytes=100, gb_per_s=10)
    assert not both.correct and "K − 1 all-reduces, not K" in str(both) and "large-p limit 2n" in str(both)
    only_k = exercises.grade_nosync_saving(70, k=4, p=8, megabytes=100, gb_per_s=10)
    only_2n = exercises.grade_nosync_saving(60, k=4, p=8, megabytes=100, gb_per_s=10)
    assert "large-p" not in str(only_k) and "not K:" in str(only_k)
    assert "large-p limit 2n" in str(only_2n) and "not K:" not in str(only_2n)


def test_single_process_group_works():
    res = ch5.launch("equality", world_size=1, k=2, b=4)[0]
    assert res["no_sync"]["calls"] == 1


@pytest.mark.parametrize("how, message", [("raise", "failed on purpose"), ("exit", "exit code 3")])
def test_failed_worker_surfaces_quickly_and_leaves_nothing(how, message):
    parallel.shutdown()  # another test's kept study processes are children too
    start = time.perf_counter()
    with pytest.raises(ch5.WorkerFailed, match=message):
        ch5.launch("crash", world_size=2, crash_rank=1, how=how)
    assert time.perf_counter() - start < 60
    assert not multiprocessing.active_children()


@pytest.mark.slow
def test_hung_worker_is_killed_at_the_deadline():
    parallel.shutdown()  # another test's kept study processes are children too
    start = time.perf_counter()
    with pytest.raises(ch5.WorkerFailed, match="did not finish within 5 s"):
        ch5.launch("crash", world_size=2, timeout=5, crash_rank=0, how="hang", pg_timeout=120)
    assert time.perf_counter() - start < 20
    assert not multiprocessing.active_children()
    # -ww: the whole command line (piped, ps cuts it at $COLUMNS or 80 characters, where a long venv path can
    # push "forkserver" out of sight)
    ps = subprocess.run(["ps", "-ww", "-eo", "pid,ppid,cmd"], capture_output=True, text=True).stdout
    rows = [(int(pid), int(ppid), cmd) for pid, ppid, cmd in (line.split(None, 2) for line in ps.splitlines()[1:])]
    me = os.getpid()
    servers = {pid for pid, ppid, cmd in rows if ppid == me and "forkserver" in cmd}
    assert servers or ddp_workers.start_method() == "spawn"  # the workers' parent is looked at
    left = [cmd for pid, ppid, cmd in rows if ppid in servers or (ppid == me and "spawn_main" in cmd)]
    assert not left, left  # no worker left: neither forked by the fork server nor spawned


def test_launch_arguments():
    with pytest.raises(ValueError, match="unknown task"):
        ch5.launch("dance")
    with pytest.raises(ValueError, match="world_size"):
        ch5.launch("equality", world_size=0)
    with pytest.raises(ValueError, match="timeout"):
        ch5.launch("equality", timeout=0)


def test_free_port_is_bindable():
    import socket

    port = ch5.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_ring_model_and_fit():
    link = distributed.Interconnect("x", bandwidth=1e9, latency=1e-5, source="test")
    assert distributed.ring_allreduce_time(1e9, 1, link) == 0.0
    assert distributed.ring_allreduce_time(1e9, 2, link) == pytest.approx(2e-5 + 1.0)
    assert distributed.ring_allreduce_time(1e9, 8, link) == pytest.approx(14e-5 + 1.75)
    sizes = [1e3, 1e5, 1e7]
    fitted = ch5.fit_alpha_beta(sizes, [distributed.ring_allreduce_time(n, 4, link) for n in sizes], 4)
    assert fitted.bandwidth == pytest.approx(1e9, rel=1e-6) and fitted.latency == pytest.approx(1e-5, rel=1e-6)
    with pytest.raises(ValueError):
        ch5.fit_alpha_beta([1e3], [1.0], 2)


def test_predict_step():
    link = distributed.PRESETS["Ethernet 10 Gb/s"]
    pred = distributed.predict_step(10**6, 8, 4, link, 0.01)
    assert pred.saving == pytest.approx(7 * distributed.ring_allreduce_time(4e6, 4, link))
    assert distributed.predict_step(10**6, 1, 4, link, 0.01).saving == 0
    with_copy = distributed.predict_step(
        10**6, 2, 4, link, 0.0, copy_bandwidth=1e10
    )  # DDP: division fused into the copy
    assert with_copy.saving == pytest.approx(distributed.ring_allreduce_time(4e6, 4, link) + 2 * 4e6 / 1e10)
    hooked = distributed.predict_step(
        10**6, 2, 4, link, 0.0, copy_bandwidth=1e10, copy_passes=3
    )  # a hook divides apart
    assert hooked.saving - with_copy.saving == pytest.approx(4e6 / 1e10)
    with pytest.raises(ValueError):
        distributed.predict_step(0, 2, 2, link, 0.1)
    grid = ch5.savings_grid(10**9, [1, 8], [2, 64], link, 0.1)
    assert grid.shape == (2, 2) and (grid[0] == 0).all() and (grid[1] > 0.5).all()


def test_analyse_timing_on_synthetic_measurements():
    link = distributed.Interconnect("x", 1e9, 1e-4, "t")
    sizes = [4 * 2**10, 4 * 2**16, 4 * 2**20]
    params = {64: 10**5}
    saving = 3 * (distributed.ring_allreduce_time(4e5, 2, link) + 2 * 4e5 / 1e10)
    result = {
        "allreduce": {s: distributed.ring_allreduce_time(s, 2, link) for s in sizes},
        "copy": {s: s / 1e10 for s in sizes},
        "params": params,
        "steps": {(64, 1, False): 1.0, (64, 1, True): 1.0, (64, 4, False): 1.0 + saving, (64, 4, True): 1.0},
    }
    fit = ch5.analyse_timing(result, p=2)
    assert fit.link.bandwidth == pytest.approx(1e9, rel=1e-6)
    (row,) = [r for r in fit.rows if r[2] == 4]
    assert row[6] == pytest.approx(row[5], rel=1e-6)  # a perfect model predicts the saving exactly
    assert "bandwidth" in repr(ch5.format_timing(fit))
    # with pairs, the saving is the median of the paired differences, not the difference of the medians
    result["pairs"] = {(64, 1): [(1.0, 1.0)] * 3, (64, 4): [(2.0, 1.0), (1.5, 1.4), (9.0, 1.0)]}
    (row,) = [r for r in ch5.analyse_timing(result, p=2).rows if r[2] == 4]
    assert row[5] == pytest.approx(1.0)
    assert ch5.format_seconds(-8.67e-3) == "-8.67 ms"
    result["world_size"] = 2  # the result records who measured it: another p is refused
    with pytest.raises(ValueError, match="pass p=2"):
        ch5.analyse_timing(result, p=4)
    with pytest.raises(ValueError, match="p"):
        ch5.analyse_timing(result, p=1)


def test_figures():
    import matplotlib

    matplotlib.use("Agg")
    assert len(ch5.plot_prediction(100, 8, 16, "PCIe 4.0 x16", 50).axes) == 1
    with pytest.raises(ValueError, match="interconnect"):
        ch5.plot_prediction(100, 8, 16, "carrier pigeon", 50)
    with pytest.raises(ValueError, match="one node"):  # the page's NVLink is one node of up to 8 GPUs
        ch5.plot_prediction(100, 8, 64, "NVLink 4 (H100)", 50)
    assert len(ch5.plot_savings_grid(10**8, [1, 4], [2, 8], 0.1, ["PCIe 4.0 x16"]).axes) == 2


def test_worker_errors_name_an_exit_without_a_traceback():
    """A worker that dies by os._exit leaves no traceback: its exit code is the root cause, before a peer's
    lost connection."""
    assert ddp_workers._worker_errors(["", ""], [None, 3]) == ["rank 1: process exited with exit code 3"]
    assert ddp_workers._worker_errors(["", ""], [0, None]) == []


def test_worker_errors_list_ranks_killed_by_a_signal_last(tmp_path):
    """torch.multiprocessing sends SIGTERM (exit code −15) to the survivors of a failure: those are consequences,
    listed after the root cause even when their rank number is lower."""
    import pickle

    assert ddp_workers._worker_errors(["", "", ""], [-15, 3, -15]) == [
        "rank 1: process exited with exit code 3",
        "rank 0: killed by SIGTERM (exit code -15), a consequence of the failure above",
        "rank 2: killed by SIGTERM (exit code -15), a consequence of the failure above",
    ]
    error_file = tmp_path / "rank1.err"
    error_file.write_bytes(pickle.dumps("Traceback ...\nValueError: 2 ranks × 800 images exceed the 1221"))
    lost = tmp_path / "rank2.err"
    lost.write_bytes(pickle.dumps("Traceback ...\nRuntimeError: [gloo] Connection closed by peer"))
    lines = ddp_workers._worker_errors(["", str(error_file), str(lost)], [-15, 1, 1])
    assert lines[0].startswith("rank 1: ValueError") and lines[1].startswith("rank 2: RuntimeError: [gloo]")
    assert lines[2].startswith("rank 0: killed by SIGTERM")
    # every rank killed and none reporting an error: the signal came from outside, not from a failure "above"
    outside = ddp_workers._worker_errors(["", ""], [-9, -9])
    assert outside[0].startswith("rank 0: killed by SIGKILL (exit code -9): no rank reported an error")
    assert not any("consequence" in line for line in outside)


@pytest.mark.parametrize("world_size", [2, 3])
def test_launcher_reports_the_root_cause_first(world_size):
    """The crashed rank 1 comes first, before rank 0 that torch terminated."""
    with pytest.raises(ch5.WorkerFailed) as info:
        ch5.launch("crash", world_size=world_size, crash_rank=1, how="exit")
    assert str(info.value).splitlines()[1] == "rank 1: process exited with exit code 3"


def test_the_raising_rank_is_reported_first_while_both_cores_are_busy():
    """Chapter 5 prints the report's first two lines. A raising rank used to destroy its process group before its
    error was written, so under load the peer's lost connection could come first (and torch then stopped the
    raising rank before it wrote anything): the stored output must not depend on which process reports first."""
    parallel.shutdown()
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        for _ in range(3):
            with pytest.raises(ch5.WorkerFailed) as info:
                ch5.launch("crash", world_size=2, crash_rank=1, how="raise")
            assert str(info.value).splitlines()[1] == "rank 1: RuntimeError: rank 1 failed on purpose"
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    assert not multiprocessing.active_children()


def test_launcher_reports_a_bad_shard_first(digits):
    with pytest.raises(ch5.WorkerFailed) as info:
        ch5.launch("equality", k=4, b=200, data=(digits.x_train, digits.y_train))
    assert str(info.value).splitlines()[1].startswith("rank 1: ValueError: 2 ranks × 800 images exceed")


def test_cost_model_rejects_bad_input():
    link = distributed.PRESETS["Ethernet 10 Gb/s"]
    with pytest.raises(ValueError, match="whole number of ranks"):
        distributed.ring_allreduce_time(1e6, 2.5, link)
    with pytest.raises(ValueError, match="whole number of ranks"):
        distributed.ring_allreduce_time(1e6, True, link)
    with pytest.raises(ValueError, match="n_bytes"):
        distributed.ring_allreduce_time(-1.0, 2, link)
    with pytest.raises(ValueError, match="micro_compute > 0"):
        ch5.savings_grid(10**6, [1, 8], [1, 8], link, 0.0)
    assert ch5.savings_grid(10**6, [8], [8], link, 0.0)[0, 0] == pytest.approx(7 / 8)  # no compute: (K − 1)/K


def test_savings_grid_is_the_closed_form():
    """The share saved is (K − 1)A / (K(c + A)) for one synchronization A and compute c per micro-batch: it grows
    with K and with A by construction (a property of the model, not a measurement)."""
    link = distributed.PRESETS["InfiniBand NDR 400 Gb/s"]
    grid = ch5.savings_grid(10**9, [1, 2, 8], [8, 512], link, 0.1)
    for i, k in enumerate([1, 2, 8]):
        for j, p in enumerate([8, 512]):
            a = distributed.ring_allreduce_time(4e9, p, link)
            assert grid[i, j] == pytest.approx((k - 1) * a / (k * (0.1 + a)), rel=1e-12)


def test_cluster_numbers_of_the_chapter():
    """One all-reduce of 10^9 fp32 gradients: ~15.6 ms in an 8-GPU NVLink 4 domain, ~165 ms across 512 GPUs on
    InfiniBand NDR, ~6.4 s across 512 GPUs on 10 Gb/s Ethernet (nominal rates, assumed latencies)."""
    t = {
        name: distributed.ring_allreduce_time(4e9, p, distributed.PRESETS[name])
        for name, p in (("NVLink 4 (H100)", 8), ("InfiniBand NDR 400 Gb/s", 512), ("Ethernet 10 Gb/s", 512))
    }
    assert t["NVLink 4 (H100)"] == pytest.approx(15.6e-3, rel=5e-3)
    assert t["InfiniBand NDR 400 Gb/s"] == pytest.approx(0.165, rel=5e-3)
    assert t["Ethernet 10 Gb/s"] == pytest.approx(6.44, rel=5e-3)


def test_the_timing_cell_is_the_one_that_waits_for_heavy_jobs():
    """The repository's conftest.py makes the cell holding layout.TIMING_CELL wait for heavy_job(): exactly one cell
    of chapter 5 holds it, and it is the cell that launches the timing task."""
    import json

    from layout import ROOT, TIMING_CELL

    cells = json.loads((ROOT / "chapters" / "05_no_sync.ipynb").read_text())["cells"]
    sources = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    holding = [s for s in sources if TIMING_CELL in s]
    assert len(holding) == 1 and 'launch(\n    "timing",' in holding[0]
    assert "def pytest_runtest_call" in (ROOT / "conftest.py").read_text()


def test_buffers_are_broadcast_only_at_the_first_forward_of_each_window():
    """Chapter 5 (errata 13): DDP broadcasts buffers before a forward when the *previous* forward ran synchronized.
    With the first K − 1 micro-batches inside no_sync(), that is the first forward of every window only: the
    window's synchronized last forward broadcasts nothing, and BatchNorm's running statistics leave the window
    different on each rank."""
    ranks = ch5.launch("buffers", world_size=2, k=4, b=4, windows=2, timeout=120)
    for r in ranks:
        assert r["broadcast"] == [True, False, False, False] * 2
    assert not torch.equal(ranks[0]["running_mean"], ranks[1]["running_mean"])


def test_cost_model_graders_and_launcher_refuse_impossible_input():
    """Found by review: these returned garbage (negative times, a 490 s saving, '✓ correct: 0') or crashed with a
    ZeroDivisionError / TypeError / a worker's traceback fragment."""
    link = distributed.PRESETS["Ethernet 10 Gb/s"]
    for bandwidth, latency in ((0.0, 1e-6), (-1e9, 1e-6), (1e9, -1.0), (1e9, float("nan"))):
        with pytest.raises(ValueError, match="Interconnect"):
            distributed.Interconnect("bad", bandwidth, latency, "none")
    for n_bytes in ("1e9", None, float("inf"), -1.0, torch.tensor(1e6)):
        with pytest.raises(ValueError, match="n_bytes"):
            distributed.ring_allreduce_time(n_bytes, 4, link)
    for kwargs, message in (
        (dict(params=1.5), "params"),
        (dict(params=True), "params"),
        (dict(micro_compute=float("nan")), "micro_compute"),
        (dict(buckets=2.5), "buckets"),
        (dict(params=10, buckets=10**6), "buckets for 10 parameters"),
        (dict(copy_bandwidth=0.0), "copy_bandwidth"),
        (dict(bytes_per_param=0), "bytes_per_param"),
    ):
        args = dict(params=1000, k=4, p=8, link=link, micro_compute=0.01) | kwargs
        with pytest.raises(ValueError, match=message):
            distributed.predict_step(**args)
    for grader, kwargs in (
        (exercises.grade_allreduce_calls, dict(k=0)),
        (exercises.grade_allreduce_calls, dict(buckets=2.5)),
        (exercises.grade_allreduce_calls, dict(k=True)),
        (exercises.grade_ring_bytes, dict(p=0)),
        (exercises.grade_ring_bytes, dict(p=2.5)),
        (exercises.grade_ring_bytes, dict(megabytes=-100.0)),
        (exercises.grade_nosync_saving, dict(k=0)),
        (exercises.grade_nosync_saving, dict(gb_per_s=0.0)),
    ):
        with pytest.raises(ValueError):
            grader(1.0, **kwargs)
    with pytest.raises(ValueError, match="no positive bandwidth"):
        ch5.fit_alpha_beta([1000, 2000], [2e-3, 1e-3], 2)
    with pytest.raises(ValueError, match="two different sizes"):
        ch5.fit_alpha_beta([1000, 1000], [1e-3, 1e-3], 2)
    fit = ch5.fit_alpha_beta([1000, 2000, 4000], [0.9e-6, 2e-6, 4.1e-6], 2)  # the best line has alpha < 0
    assert fit.latency == 0.0 and fit.bandwidth > 0
    with pytest.raises(ValueError, match="smaller K or fewer ranks"):
        distributed.micro_batch_that_fits(10, 4, 4, 1)
    for kwargs, message in (
        (dict(k=4, b=0), "micro-batch|b must"),
        (dict(k=2.0, b=4), "K"),
        (dict(k=2, b=4, bucket_cap_mb=-1.0), "bucket_cap_mb"),
    ):
        with pytest.raises(ValueError, match=message):
            ch5.launch("equality", world_size=2, **kwargs)


@pytest.mark.slow
def test_find_unused_parameters_adds_one_all_reduce_per_synchronized_backward():
    """Exercise ex-ch5-calls' solution, measured at the process group (the profiler counts every all-reduce; the
    comm hook only the gradient buckets): the default makes 22, 24, 24 without no_sync and 1, 3, 3 with it, as
    the hook counts; with find_unused_parameters=True each synchronized backward also all-reduces the map of used
    parameters: 24 + 8 = 32 and 3 + 1 = 4 per step, from the first step on."""
    for res in ch5.launch("collectives", world_size=2, k=8, b=2, steps=3):
        assert res["sync every micro-batch"] == [22, 24, 24] and res["no_sync"] == [1, 3, 3], res
        assert res["sync every micro-batch, find_unused_parameters=True"] == [32, 32, 32], res
        assert res["no_sync, find_unused_parameters=True"] == [4, 4, 4], res


@pytest.mark.slow
def test_static_graph_keeps_one_bucket_for_two_synchronized_backward_passes():
    """Chapter 5's rule for static_graph=True: the first two synchronized backward passes use the single bucket,
    the buckets are rebuilt before the third. At K = 1 the count equals the buckets only from step 3 (the
    default rebuilds after the first: from step 2)."""
    res = ch5.launch("equality", world_size=2, k=1, b=8, steps=4, bucket_cap_mb=0.005)[0]["sync every micro-batch"]
    assert res["calls per step"] == [1, 3, 3, 3]
    assert res["variants"]["static_graph=True"] == [1, 1, 3, 3]


def test_prediction_tools_refuse_what_they_cannot_compute():
    """Third review: NaN/inf/str inputs gave NumPy errors, TypeErrors or the wrong diagnosis; the formatters
    printed '1e+03 µs' and '1e+03 B'; a NumPy bandwidth leaked NumPy floats into the predictions."""
    import math

    import numpy as np

    from gradaccum import distributed
    from gradaccum.book import ch05_no_sync as ch5

    eth = distributed.PRESETS["Ethernet 10 Gb/s"]
    bad = [
        lambda: ch5.plot_prediction(float("nan"), 8, 8, "Ethernet 10 Gb/s", 1.0),
        lambda: ch5.plot_prediction(math.inf, 8, 8, "Ethernet 10 Gb/s", 1.0),
        lambda: ch5.plot_prediction(10, 8, 1, "Ethernet 10 Gb/s", 0.0),
        lambda: ch5.plot_prediction(10, 8, "8", "NVLink 4 (H100)", 1.0),
        lambda: ch5.plot_prediction(10, 8, 8, ["Ethernet 10 Gb/s"], 1.0),
        lambda: distributed.ring_allreduce_time(100, 2, None),
        lambda: distributed.predict_step(10, 2, 1, None, 0.1),
        lambda: ch5.fit_alpha_beta([1000, 2000], [float("nan"), 1.0], 2),
        lambda: ch5.fit_alpha_beta(["1000", "2000"], [1.0, 2.0], 2),
        lambda: ch5.fit_alpha_beta([-1000, 2000], [1.0, 2.0], 2),
        lambda: ch5.savings_grid(10, [], [2], eth, 0.1),
        lambda: ch5.format_seconds(float("nan")),
        lambda: ch5.bytes_human(float("inf")),
    ]
    for call in bad:
        with pytest.raises(ValueError):
            call()
    assert ch5.format_seconds(0.0009999) == "1 ms" and ch5.format_seconds(0.000999) == "999 µs"
    assert ch5.format_seconds(123.456) == "123 s" and ch5.format_seconds(0.9999) == "1 s"  # sixth review
    with pytest.raises(ValueError, match="a NumPy integer"):  # not NumPy's "truth value ... is ambiguous"
        ch5.savings_grid(85_002, np.array([1, 4]), np.array([2, 8]), distributed.PRESETS["PCIe 4.0 x16"], 1e-3)
    assert ch5.bytes_human(999.6) == "1 KB" and ch5.bytes_human(999.0) == "999 B"
    link = distributed.Interconnect("x", np.float64(1e9), np.float64(0.0), "s")
    assert type(link.bandwidth) is float and type(distributed.ring_allreduce_time(1e6, 2, link)) is float


@pytest.mark.slow
def test_the_counting_hook_averages_over_the_models_own_group():
    """Review: counting_hook averaged over the default group, so a DDP model on a subgroup (one replica per rank
    here) was averaged with other replicas' gradients (1.5 on both ranks instead of 1 and 2), silently."""
    res = ch5.launch("subgroups", world_size=2)
    assert [r["grad"] for r in res] == [1.0, 2.0] and all(r["calls"] == 1 for r in res), res
    from gradaccum.distributed import register_counter

    with pytest.raises(ValueError, match="DistributedDataParallel"):
        register_counter(torch.nn.Linear(2, 2))


def test_accumulating_a_plain_module_is_refused():
    """Review: ddp_accumulate on a plain module raised AttributeError ('no_sync') or ran plain accumulation."""
    for no_sync in (True, False):
        with pytest.raises(ValueError, match="DistributedDataParallel"):
            distributed.ddp_accumulate(
                torch.nn.Linear(2, 2), torch.nn.MSELoss(), torch.ones(4, 2), torch.ones(4, 2), 2, no_sync=no_sync
            )


def test_the_crash_task_checks_its_arguments_before_starting():
    """Review: crash_rank outside the ranks returned [None, None] (no rank failed); how='bogus' raised."""
    with pytest.raises(ValueError, match="crash_rank must be a rank"):
        ch5.launch("crash", world_size=2, crash_rank=5, how="raise")
    with pytest.raises(ValueError, match="how must be"):
        ch5.launch("crash", world_size=2, crash_rank=1, how="bogus")
