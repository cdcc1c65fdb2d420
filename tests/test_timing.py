import pytest

from gradaccum.timing import median_time


def test_median_time_counts_calls():
    calls = []
    seconds = median_time(lambda: calls.append(1), repeat=5, warmup=2)
    assert len(calls) == 7 and seconds >= 0


def test_median_time_bad_arguments():
    with pytest.raises(ValueError):
        median_time(lambda: None, repeat=0)
