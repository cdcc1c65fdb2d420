import random

import numpy as np
import pytest
import torch

from gradaccum.runtime import DEVICE_ENV, pick_device, seed_everything, setup


def test_setup_fixes_threads_and_seeds():
    device = setup(seed=3, threads=1, prefer="cpu")
    assert device == torch.device("cpu")
    assert torch.get_num_threads() == 1
    a = (random.random(), np.random.rand(), torch.rand(1).item())
    setup(seed=3, threads=1, prefer="cpu")
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == a


def test_pick_device_default_and_env(monkeypatch):
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert pick_device().type == expected
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    assert pick_device() == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given when CUDA is absent")
def test_cuda_requested_without_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="CUDA is not available"):
        pick_device("cuda")


@pytest.mark.parametrize("bad", ["tpu-ish", "gpu"])
def test_unknown_device(bad):
    with pytest.raises(ValueError, match="unknown device"):
        pick_device(bad)


@pytest.mark.parametrize("kwargs", [{"seed": -1}, {"seed": 1.5}, {"threads": 0}])
def test_bad_setup_arguments(kwargs):
    with pytest.raises(ValueError):
        setup(**{"prefer": "cpu", **kwargs})
    setup(seed=0, prefer="cpu")


def test_seed_everything_rejects_negative():
    with pytest.raises(ValueError, match="non-negative"):
        seed_everything(-3)
