"""Hydra's cluster launchers, made to wait for every point before reporting a dead one.

Hydra's Ray and submitit launchers collect the points' results in order (`[ray.get(r) for r in runs]`,
`[j.results()[0] for j in jobs]`) and raise at the first point whose worker died (kill -9 of a Ray
worker, `scancel` of a SLURM job). The sweep then returns while the later points are still running:
Ray kills them when the driver exits, SLURM runs them with nobody waiting, and the sweep's record calls
them interrupted. These subclasses change only that: every point's job ends (or dies) first, then the
results are collected exactly as the plugin does. Which job runs where stays the plugin's business.

Used through `_target_` in manifests/launchers/{ray,slurm,local}.yaml (Hydra instantiates launchers from
the hydra_plugins package only, hence this package beside runner/). Imported by Hydra's plugin scan on
every sweep: it imports neither ray nor submitit until a launch.
"""

from __future__ import annotations

import subprocess
import time
from unittest import mock

try:
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher as _SubmititLocal
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as _SubmititSlurm
except ImportError:  # pip install -e '.[slurm]'
    _SubmititLocal = _SubmititSlurm = object


class _WaitForAllJobs:
    """submitit: map_array returns the jobs only once every one of them has ended.

    A SLURM job's end is its result file, or (submitit asks `sacct`, which needs SLURM's accounting
    storage; without it submitit waits forever for a cancelled job) the job leaving `squeue` without one.
    """

    def launch(self, job_overrides, initial_job_idx):
        import submitit

        map_array = submitit.AutoExecutor.map_array

        def map_array_then_wait(executor, fn, *iterables):
            jobs = map_array(executor, fn, *iterables)
            pending = list(jobs)
            while pending:
                pending = [job for job in pending if not (job.done() or _left_slurm_queue(job))]
                time.sleep(1 if pending else 0)
            dead = [job for job in jobs if not job.done() and not _result_appears(job)]
            if dead:
                from submitit.core.utils import UncompletedJobError

                raise UncompletedJobError(", ".join(
                    f"job {job.job_id} left the SLURM queue without a result (cancelled, killed or failed; "
                    f"its log: {job.paths.stderr})" for job in dead))
            return jobs

        with mock.patch.object(submitit.AutoExecutor, "map_array", map_array_then_wait):
            return super().launch(job_overrides, initial_job_idx)


def _left_slurm_queue(job) -> bool:
    """A SLURM job squeue no longer lists (ended in any way), or no longer knows; False for other executors."""
    if type(job).__name__ != "SlurmJob":
        return False
    done = subprocess.run(["squeue", "-h", "-o", "%T", "-j", str(job.job_id)], capture_output=True, text=True)
    if done.returncode != 0:
        return "Invalid job id" in done.stderr  # purged after MinJobAge; any other error: ask again later
    return not done.stdout.strip()


def _result_appears(job, grace_s: float = 10.0) -> bool:
    """The job's result file, allowing a shared file system a few seconds to show it."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if job.paths.result_pickle.exists():
            return True
        time.sleep(0.5)
    return job.paths.result_pickle.exists()


class SlurmLauncher(_WaitForAllJobs, _SubmititSlurm):
    pass


class LocalLauncher(_WaitForAllJobs, _SubmititLocal):
    pass


def _ray_launcher():
    from hydra_plugins.hydra_ray_launcher import ray_launcher

    return ray_launcher.RayLauncher


try:
    _RayBase = _ray_launcher()
except ImportError:  # the ray extra is not installed: RayLauncher below says so when it is used
    _RayBase = None


class RayLauncher(_RayBase or object):
    """Ray: every point's task is waited for (`ray.wait` on all) before the plugin's `ray.get` in order."""

    def __init__(self, ray=None, **kwargs):
        if _RayBase is None:
            raise ImportError("Hydra's Ray launcher plugin is not installed: pip install -e '.[ray]' "
                              "(or make test-cluster)")
        super().__init__(ray=ray, **kwargs)

    def launch(self, job_overrides, initial_job_idx):
        import ray

        from hydra_plugins.hydra_ray_launcher import _core

        refs = []
        launch_job_on_ray = _core.launch_job_on_ray

        def launch_and_remember(*args, **kwargs):
            refs.append(launch_job_on_ray(*args, **kwargs))
            return refs[-1]

        def get_after_all(ref):
            ray.wait(refs, num_returns=len(refs))
            return ray.get(ref)

        with mock.patch.object(_core, "launch_job_on_ray", launch_and_remember), \
                mock.patch.object(_core, "ray", mock.Mock(get=get_after_all)):
            return _core.launch(launcher=self, job_overrides=job_overrides, initial_job_idx=initial_job_idx)
