import pytest

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
    times = timing.interleaved_medians({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                                       repeat=3, warmup=1)
    assert calls == ["a", "b"] * 4 and set(times) == {"a", "b"} and all(t >= 0 for t in times.values())
    with pytest.raises(ValueError, match="repeat"):
        timing.interleaved_medians({}, repeat=1)
