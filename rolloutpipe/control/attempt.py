"""One attempt of a run: its sealing key, and how it ended.

An attempt is one start of the run's processes: a launch, or one start of a Slurm job (a requeued job starts its
batch script again: ``SLURM_RESTART_COUNT`` counts them). ``launcher=slurm`` keeps the run's secret, id, store port
and directory across the requeues of its job, so every key the processes use is derived for the attempt
(control/env.py ``attempt_key``): records sealed, handles signed and engine API keys issued in attempt N are
worthless in attempt N + 1, even if someone who could read attempt N's store writes them into the next one's.

How it ended: trainer rank 0 writes ``<run_dir>/outcome.json`` when the attempt ends, sealed with the attempt's key:

    {"attempt": n, "finished": bool, "requeue": bool, "last_step": k, "checkpoint_step": c, "reason": "..."}

``finished``: every step trained and the final policy written; else the run stopped after step ``last_step`` (its
metrics written) with a checkpoint of step ``checkpoint_step`` on disk (trainer/restore.py), for ``reason``;
``requeue``: a fresh start of the job is the remedy: Slurm warned of the time limit, or a process of the run died
without a word (its heart-beat or the store it hosted gone: a lost node, which Slurm does not requeue itself in the
rollout het group, started with ``--no-kill``), or a process stopped on an error a fresh start fixes (``FreshStart``:
the last engine in service lost where its policy can no longer be sent again). The
requeue wrapper (launch/requeue.py) decides from this record, not from srun's exit code (the highest of every task's,
so 137 for an engine host lost hours earlier). A record of another attempt fails the seal, so it reads as absent.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

from rolloutpipe.control.seal import Forged, seal, unseal

OUTCOME_FILE = "outcome.json"


class FreshStart(RuntimeError):
    """An error that a fresh start of the job fixes: its process aborts the run for a requeue (pipeline.run_node), so
    the attempt's outcome says ``requeue`` and a Slurm job resumes from the last finished step's checkpoint. Not for
    an error that would come back in the next attempt (a bug, a bad config)."""


@dataclass(kw_only=True, slots=True)
class Outcome:
    attempt: int
    finished: bool
    requeue: bool
    """It stopped to be requeued (Slurm's warning, a lost process or node, a ``FreshStart`` error): the wrapper
    requeues the job."""
    last_step: int
    """The last step whose metrics were written (-1: none yet)."""
    checkpoint_step: int
    """The newest step with a complete checkpoint on disk (-1: none): where a resume continues."""
    reason: str


def write_outcome(run_dir: Path, key: bytes, outcome: Outcome) -> None:
    path = run_dir / OUTCOME_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(seal(key, OUTCOME_FILE, asdict(outcome)))
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    tmp.rename(path)


def read_outcome(run_dir: Path, key: bytes, attempt: int) -> Outcome | None:
    """Attempt ``attempt``'s outcome, or None: not written (its trainer rank 0 died), or not this attempt's."""
    try:
        record = unseal(key, OUTCOME_FILE, (run_dir / OUTCOME_FILE).read_bytes())
    except (OSError, Forged):
        return None
    outcome = Outcome(**record)
    return outcome if outcome.attempt == attempt else None
