"""Which local Ray a run joins (tasks/engine/local_ray.py `ray_dir`): one per user and Python
environment, and one per Slurm job, since Slurm ends every process of a job when it ends, a
keeper that another job's runs on the node were using included."""

from __future__ import annotations

from tasks.engine.local_ray import DIR_ENV, ray_dir


def test_each_slurm_job_has_a_local_ray_of_its_own(monkeypatch):
    monkeypatch.delenv(DIR_ENV, raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    machine = ray_dir()
    monkeypatch.setenv("SLURM_JOB_ID", "101")
    job_101 = ray_dir()
    monkeypatch.setenv("SLURM_JOB_ID", "102")
    job_102 = ray_dir()
    assert len({machine, job_101, job_102}) == 3, (machine, job_101, job_102)
    assert len(str(job_101)) == len(str(machine))  # as short: Ray's unix socket paths under it have 108 bytes
    monkeypatch.setenv("SLURM_JOB_ID", "101")
    assert ray_dir() == job_101  # the job's runs share it
    monkeypatch.setenv(DIR_ENV, "/tmp/chosen")
    assert str(ray_dir()) == "/tmp/chosen"  # a folder the user names wins
