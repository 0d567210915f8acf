"""The seeded chaos runs of tests/chaos.py, short: a few faults drawn at random (with a fixed seed) under torchrun
and under the horovod self-launch, and the finished run checked against what an unbroken one trains."""

import pytest

from tests.chaos import Job, check, run


@pytest.mark.slow
@pytest.mark.parametrize(("launcher", "seed", "faults"), [("torchrun", 2, 4), ("horovod", 1, 3)])
def test_a_run_under_a_random_schedule_of_faults_trains_what_an_unbroken_run_does(launcher, seed, faults, tmp_path):
    job = Job(launcher, seed, faults, epochs=3, folder=tmp_path)
    kinds = sorted({fault.kind for fault in job.schedule})
    assert len(job.schedule) == faults, job.schedule
    code, seconds = run(job, timeout=600)
    logs = "\n".join(p.read_text()[-2000:] for p in sorted(tmp_path.glob("*.log")))
    assert code == 0, logs
    figures = check(job)
    assert figures["faults"] == faults, (figures, kinds)
    print(f"\n{launcher} seed {seed}: {kinds}: {figures}, {seconds:.1f} s")
