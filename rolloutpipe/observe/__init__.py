"""Observability: spans and per-step metrics as data, and what is made of them.

    metrics.py    the span recorder both node groups write to, RolloutStats/TrainStats, the per-step reduction
    trace.py      span files merged into trace.json (Perfetto) and group lifecycles
    timeline.py   the timeline picture; ``finish_run`` (trace, picture and W&B at the end of a run)
    tracking.py   W&B: the run, one log per step, the timeline at the end
    report.py     the table of runs (tools/report.py)
    progress.py   progress lines on the terminal

May import: types, control/ (the clock). Nothing of rollout/, trainer/, launch/ or config: observers read
records, they do not drive the run.
"""
