"""The submitit extension for heterogeneous jobs (submitit has none: facebookincubator/submitit#1741).

Three small overrides of submitit's Slurm classes, nothing else:
    HetSlurmExecutor   writes slurm.batch_script's text (one ``#SBATCH hetjob`` section per component,
                       one srun step over all of them) instead of submitit's single-component script;
                       counts the tasks of every component (submitit expects one result per task, and
                       every task sees the het job's id as SLURM_JOB_ID and a SLURM_PROCID over all
                       components); hands sbatch an environment of the caller's choosing.
    HetInfoWatcher     sacct lists a het job as one row per component, ``123+0``, ``123+1`` (and steps,
                       ``123+0.0``): maps them back to job ``123`` with one combined state (sacct.py).
    HetSlurmJob        a submitit SlurmJob that uses that watcher.
Imported only when a job is submitted (see slurm.py), so ``import rolloutpipe`` never imports submitit.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from submitit.core import core, utils
from submitit.slurm.slurm import SlurmExecutor, SlurmInfoWatcher, SlurmJob

from rolloutpipe.launch.sacct import read_sacct


class HetInfoWatcher(SlurmInfoWatcher):
    def read_info(self, string: bytes | str) -> dict[str, dict[str, str]]:
        return read_sacct(string)


class HetSlurmJob(SlurmJob):
    watcher = HetInfoWatcher(delay_s=60)


class HetSlurmExecutor(SlurmExecutor):
    job_class = HetSlurmJob

    def __init__(self, folder: Path, *, script: str, num_tasks: int, environ: dict[str, str]) -> None:
        super().__init__(folder)
        self.script = script
        self.num_tasks = num_tasks
        self.environ = environ

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return self.script  # its srun line runs ``python -m rolloutpipe.launch.slurm <folder>``, not ``command``

    def _num_tasks(self) -> int:
        return self.num_tasks

    def _submit_command(self, command: str) -> core.Job:
        # submitit's own, except that sbatch gets self.environ (with the run's secret) and --export=ALL.
        path = utils.JobPaths.get_first_id_independent_folder(self.folder) / f".submission_file_{uuid.uuid4().hex}.sh"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self._make_submission_file_text(command, ""))
        output = utils.CommandFunction(["sbatch", "--export=ALL", str(path)], verbose=False, env=self.environ)()
        job = self.job_class(folder=self.folder, job_id=self._get_job_id_from_submission_command(output),
                             tasks=list(range(self.num_tasks)))
        job.paths.move_temporary_file(path, "submission_file", keep_as_symlink=True)
        return job
