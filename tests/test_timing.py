import time

import pytest
import torch

from gradaccum import timing
from gradaccum.timing import median_time


def test_median_time_counts_calls():
    calls = []
    seconds = median_time(lambda: calls.append(1), repeat=5, warmup=2)
    assert len(calls) == 7 and seconds >= 0


def test_median_time_bad_arguments():
    with pytest.raises(ValueError):
        median_time(lambda: None, repeat=0)


def test_interleaved_medians_alternate_and_validate():
    calls = []
    times = timing.interleaved_medians(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeat=3, warmup=1
    )
    assert calls == ["a", "b"] * 4 and set(times) == {"a", "b"} and all(t >= 0 for t in times.values())
    with pytest.raises(ValueError, match="repeat"):
        timing.interleaved_medians({}, repeat=1)
    calls.clear()
    timing.interleaved_medians({name: (lambda n=name: calls.append(n)) for name in "abc"}, repeat=3, rotate=True)
    assert "".join(calls) == "abc" + "bca" + "cab" + "abc"  # every one follows every other equally often


def test_interleaved_times_clocks_and_statistics():
    """The process clock counts this process's CPU seconds, not sleeping; ``min`` takes the fastest round."""
    fns = {"sleep": lambda: time.sleep(0.02), "spin": lambda: sum(range(200_000))}
    wall = timing.interleaved_times(fns, repeat=3, clock="wall")
    cpu = timing.interleaved_times(fns, repeat=3, clock="process", statistic="min")
    assert wall["sleep"] >= 0.02 and cpu["sleep"] < 0.005  # a sleeping process uses no CPU
    assert cpu["spin"] > 0
    assert timing.interleaved_times(fns, repeat=3, clock="auto", statistic="min").keys() == fns.keys()
    durations = iter([0.3, 0.1, 0.2])
    fake = {"f": lambda: time.sleep(next(durations))}
    assert timing.interleaved_times(fake, repeat=3, warmup=0, statistic="min")["f"] == pytest.approx(0.1, abs=0.05)


def test_interleaved_times_refuses_bad_choices():
    with pytest.raises(ValueError, match="clock must be one of"):
        timing.interleaved_times({"a": lambda: None}, clock="cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="statistic one of"):
        timing.interleaved_times({"a": lambda: None}, statistic="mean")  # type: ignore[arg-type]
    for device in ("cuda", "cuda:0", torch.device("cuda", 0), "mps", "meta"):
        with pytest.raises(ValueError, match="misses the work of a"):
            timing.interleaved_times({"a": lambda: None}, device=device, clock="process")


def test_auto_clock_is_the_process_clock_only_for_single_threaded_cpu_code(monkeypatch):
    used = []
    monkeypatch.setitem(timing._CLOCKS, "process", lambda: used.append("process") or time.process_time())
    monkeypatch.setitem(timing._CLOCKS, "wall", lambda: used.append("wall") or time.perf_counter())
    threads = torch.get_num_threads()
    try:
        for n, clock in ((1, "process"), (2, "wall")):
            torch.set_num_threads(n)
            used.clear()
            timing.interleaved_times({"a": lambda: None}, repeat=1, warmup=0, clock="auto")
            assert set(used) == {clock}
        used.clear()
        timing.interleaved_times({"a": lambda: None}, device="meta", repeat=1, warmup=0, clock="auto")
        assert set(used) == {"wall"}
    finally:
        torch.set_num_threads(threads)
