"""What sacct says about a heterogeneous job: one row per component (``123+0``, ``123+1``), folded into one state.

Pure parsing, shared by the launcher's monitor loop (slurm.py) and the submitit extension (submitit_het.py).
"""

from __future__ import annotations

UNFINISHED_STATES = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED",
                     "PREEMPTED", "SIGNALING", "STAGE_OUT", "REQUEUE_HOLD", "REQUEUE_FED", "UNKNOWN")


def combine_states(states: list[str]) -> str:
    """One state for a het job from its components' sacct states (``CANCELLED by 0`` reads CANCELLED).

    Unfinished while any component is; then CANCELLED if any was cancelled, else the first component
    that did not complete, else COMPLETED.
    """
    words = [s.split()[0].upper() if s.strip() else "UNKNOWN" for s in states]
    unfinished = [w for w in words if w in UNFINISHED_STATES]
    if unfinished:
        return "RUNNING" if "RUNNING" in unfinished else unfinished[0]
    if "CANCELLED" in words:
        return "CANCELLED"
    return next((w for w in words if w != "COMPLETED"), "COMPLETED")



def read_sacct(text: str | bytes) -> dict[str, dict[str, str]]:
    """``sacct --parsable2`` rows -> job id -> info; a het job's components fold into one entry whose
    State is combine_states of theirs and whose HetStates lists them, e.g. ``COMPLETED|FAILED``."""
    if isinstance(text, bytes):
        text = text.decode()
    lines = text.splitlines()
    if len(lines) < 2:
        return {}
    names = lines[0].split("|")
    plain: dict[str, dict[str, str]] = {}
    components: dict[str, dict[int, dict[str, str]]] = {}
    for line in lines[1:]:
        row = dict(zip(names, (v.strip() for v in line.split("|"))))
        job_id = row.get("JobID", "")
        if not job_id or "." in job_id:  # steps (123+0.batch, 123+1.0) are not jobs
            continue
        main, plus, offset = job_id.partition("+")
        if plus:
            components.setdefault(main, {})[int(offset)] = row
        else:
            plain[job_id] = row
    for main, rows in components.items():
        ordered = [rows[k] for k in sorted(rows)]
        states = [r.get("State", "") for r in ordered]
        plain[main] = {**ordered[0], "JobID": main, "State": combine_states(states), "HetStates": "|".join(states)}
    return plain
