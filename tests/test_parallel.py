"""gradaccum.book.parallel.run_jobs: the jobs' results in order, the same in spawned processes as here."""

import pytest
import torch

from gradaccum.book.parallel import run_jobs


def seeded_draw(seed: int, n: int) -> list[float]:
    """A job that seeds its own generator (as every study's run does) and reports its thread count."""
    g = torch.Generator().manual_seed(seed)
    return [*torch.randn(n, generator=g, dtype=torch.float64).cumsum(0).tolist(), float(torch.get_num_threads())]


def test_jobs_in_two_processes_give_the_results_of_one_after_the_other():
    jobs = [dict(seed=s, n=n) for s, n in ((3, 5), (1, 2), (4, 7), (1, 2))]
    here = run_jobs(seeded_draw, jobs)
    assert here == [seeded_draw(**job) for job in jobs]
    there = run_jobs(seeded_draw, jobs, workers=2)
    assert there == here and all(r[-1] == 1.0 for r in there)  # one thread in each process, as setup() sets
    assert run_jobs(seeded_draw, [], workers=2) == [] and run_jobs(seeded_draw, jobs[:1], workers=2) == here[:1]


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_a_bad_worker_count_is_refused(bad):
    with pytest.raises(ValueError, match="workers"):
        run_jobs(seeded_draw, [dict(seed=0, n=1)], workers=bad)


def pid_after(seconds: float) -> int:
    import os
    import time

    time.sleep(seconds)
    return os.getpid()


def die() -> None:
    import os

    os._exit(3)


@pytest.mark.slow
def test_the_processes_are_kept_for_the_next_study_and_replaced_when_one_dies():
    from concurrent.futures.process import BrokenProcessPool

    from gradaccum.book import parallel

    parallel.shutdown()
    first = set(run_jobs(pid_after, [dict(seconds=0.5)] * 4, workers=2))
    again = set(run_jobs(pid_after, [dict(seconds=0.5)] * 4, workers=2))
    assert len(first) == 2 and again == first  # no new process started: the seconds torch takes to import
    with pytest.raises(BrokenProcessPool):
        run_jobs(die, [{}, {}], workers=2)
    assert not set(run_jobs(pid_after, [dict(seconds=0.5)] * 2, workers=2)) & first  # a new pool
    parallel.shutdown()
    assert not parallel._POOLS


def test_jobs_forked_from_the_fork_server_give_the_results_of_one_after_the_other():
    jobs = [dict(seed=s, n=n) for s, n in ((2, 3), (5, 4), (2, 3))]
    there = run_jobs(seeded_draw, jobs, workers=2, start_method="forkserver")
    assert there == [seeded_draw(**job) for job in jobs] and all(r[-1] == 1.0 for r in there)
    with pytest.raises(ValueError, match="start_method"):
        run_jobs(seeded_draw, jobs, workers=2, start_method="fork")  # type: ignore[arg-type]


def imported(names: tuple[str, ...]) -> list[bool]:
    """Which of the modules ``names`` the process running this job has imported."""
    import sys

    return [name in sys.modules for name in names]


@pytest.mark.slow
def test_workers_forked_after_start_fork_server_find_its_modules_imported():
    """start_fork_server returns at once; the fork server imports the modules, and every worker forked from it
    starts with them (spawned workers import only what the job needs: the control)."""
    from multiprocessing import forkserver

    from gradaccum.book import ddp_workers, parallel

    names = ("torch._dynamo", "gradaccum.book.ddp_workers")
    jobs = [dict(names=names)] * 2
    parallel.shutdown()
    forkserver._forkserver._stop()  # a server another test started keeps what it preloaded
    try:
        if not ddp_workers.start_fork_server(names[:1]):
            pytest.skip("this platform has no fork server")
        assert run_jobs(imported, jobs, workers=2, start_method="forkserver") == [[True, True]] * 2
        assert run_jobs(imported, jobs, workers=2) == [[False, False]] * 2
    finally:
        parallel.shutdown()
        forkserver._forkserver._stop()
