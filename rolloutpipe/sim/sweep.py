"""The simulator's command: sweep settings, simulate every mode of each, print the side-by-side table.

``tools/simulate.py`` binds Hydra's config (conf/simulate.yaml) to ``SimulateConfig``: ``job`` is the
job's own Config (the keys launch.py takes), ``sim`` the cost models (conf/sim/hardware/*.yaml),
``sweep`` a nested dict whose leaves are lists of values (``+sweep.job.n_samples_per_prompt=[8,16]``);
every combination is one setting, and each setting runs every mode of ``modes`` on the same samples.
Cells are medians over the simulated steps; reductions are ratios against ``sync`` of the same setting.
``step_s`` is the steady-state step time (optimizer-step end to optimizer-step end, weight sync included);
``bound@sync`` the on-policy bound on it from sync's own stages (its ideal rollout-to-train-end + weight sync).
``cgp+fgd+spec`` is cgp+fgd with speculative next-step rollout (sim.speculative=true, sim/speculative.py);
``cgp+fgd+spec@0.99`` also sets sim.acceptance for that row; ``drafted``/``kept`` are draft tokens per step.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rolloutpipe.config import Config, ConfigError, bind
from rolloutpipe.sim.models import SimConfig
from rolloutpipe.sim.run import SimResult, simulate

LISTED_BY = "python tools/simulate.py --cfg job"
"""The command that lists every key of the simulator's config and its default."""

MODES = {
    "sync": {"pipeline": {"mode": "sync"}, "rollout": {"admission": "fifo"}},
    "cgp": {"pipeline": {"mode": "cgp"}, "rollout": {"admission": "fifo"}},
    "cgp+fgd": {"pipeline": {"mode": "cgp"}, "rollout": {"admission": "fgd"}},
    "async_one_step": {"pipeline": {"mode": "async_one_step"}, "rollout": {"admission": "fifo"}},
    "cgp+fgd+spec": {"pipeline": {"mode": "cgp"}, "rollout": {"admission": "fgd"}},
}
"""Each mode's job overrides; a mode ending in ``+spec`` also turns on sim.speculative."""

DEFAULT_MODES = ["sync", "cgp", "cgp+fgd", "async_one_step"]

COLUMNS = [("perf/rollout_to_train_end_s", "r2t_s"), ("perf/trainer_wait_ratio", "wait"),
           ("perf/rollout_s", "rollout_s"), ("perf/train_compute_s", "compute_s"),
           ("perf/ideal_rollout_to_train_end_s", "ideal_s"), ("sim/step_s", "step_s"),
           ("sim/on_policy_bound_s", "bound_s"), ("sim/num_drafted_tokens", "drafted"),
           ("sim/num_kept_tokens", "kept")]


def _job_schema() -> Config:
    """Config's defaults without what ``__post_init__`` derives (else a swept batch size would clash with it)."""
    job = Config()
    job.num_steps_per_rollout = None
    job.rollout.num_engines = job.rollout.engines_per_node = None  # derived from launcher.rollout.nodes
    return job


@dataclass(kw_only=True, slots=True)
class SimulateConfig:
    job: Config = field(default_factory=_job_schema)
    sim: SimConfig = field(default_factory=SimConfig)
    modes: list[str] = field(default_factory=lambda: list(DEFAULT_MODES))
    """Names of MODES; ``cgp+fgd+spec@<a>`` runs the speculative mode at acceptance a."""
    num_steps: int = 20
    sweep: dict[str, Any] = field(default_factory=dict)
    """Nested like ``job``/``sim``; each leaf a list of values to try."""
    timeline: str | None = None
    """Draw the first setting's modes (steps 1-2) to this path (.png)."""
    csv: str | None = None

    def __post_init__(self) -> None:
        for mode in self.modes:
            mode_overrides(mode)
        if self.num_steps < 1:
            raise ValueError(f"num_steps={self.num_steps} must be >= 1.")


@dataclass(kw_only=True, slots=True)
class Row:
    setting: str
    mode: str
    medians: dict[str, float]
    cpu_s: float
    result: SimResult = field(repr=False)


def mode_overrides(mode: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A mode's job and sim overrides: ``cgp+fgd+spec@0.99`` is cgp+fgd, sim.speculative and sim.acceptance=0.99."""
    name, at, acceptance = mode.partition("@")
    if name not in MODES or (at and not name.endswith("+spec")):
        raise ValueError(f"modes: unknown {mode!r}; choose from {list(MODES)} (a +spec mode may add @<acceptance>).")
    sim: dict[str, Any] = {"speculative": True} if name.endswith("+spec") else {}
    if at:
        try:
            sim["acceptance"] = float(acceptance)
        except ValueError:
            raise ValueError(f"modes: {mode!r}: the acceptance after @ must be a number in [0, 1].") from None
    return MODES[name], sim


def settings(sweep: dict[str, Any]) -> list[dict[str, Any]]:
    """Every combination of the sweep's leaves, as {dotted key: value}."""
    leaves = _leaves(sweep)
    for key, values in leaves.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"sweep.{key} must be a non-empty list of values, got {values!r}.")
    return [dict(zip(leaves, combo)) for combo in itertools.product(*leaves.values())] or [{}]


def run_sweep(cfg: SimulateConfig, raw_job: Any, raw_sim: Any) -> list[Row]:
    rows = []
    for setting in settings(cfg.sweep):
        job_over = {k[len("job."):]: v for k, v in setting.items() if k.startswith("job.")}
        sim_over = {k[len("sim."):]: v for k, v in setting.items() if k.startswith("sim.")}
        bad = [k for k in setting if not k.startswith(("job.", "sim."))]
        if bad:
            raise ConfigError(f"sweep keys must start with job. or sim.: {bad}")
        first = not rows
        for mode in cfg.modes:
            job_mode, sim_mode = mode_overrides(mode)
            sim = _bind(SimConfig, "sim", raw_sim, _dotlist(sim_over), sim_mode)
            if cfg.timeline and first:  # the picture draws steps 1 and 2 of the first setting
                sim = replace(sim, num_span_steps=max(sim.num_span_steps, 3))
            job = _bind(Config, "job", raw_job, _dotlist(job_over), job_mode)
            start = time.process_time()
            result = simulate(job, sim, cfg.num_steps)
            cpu_s = time.process_time() - start
            medians = {key: statistics.median(r[key] for r in result.records) for key, _ in COLUMNS}
            rows.append(Row(setting=", ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in setting.items()) or "-",
                            mode=mode, medians=medians, cpu_s=cpu_s, result=result))
    return rows


def format_table(rows: list[Row]) -> str:
    head = ["setting", "mode", *(short for _, short in COLUMNS), "r2t vs sync", "wait vs sync", "step vs sync",
            "step vs bound@sync", "sim_cpu_s"]
    lines = [head]
    sync = {r.setting: r.medians for r in rows if r.mode == "sync"}
    for r in rows:
        base = sync.get(r.setting)
        lines.append([r.setting, r.mode, *(f"{r.medians[key]:.3f}" for key, _ in COLUMNS),
                      *(_vs(r.medians[key], base[key]) if base else "n/a" for key in
                        ("perf/rollout_to_train_end_s", "perf/trainer_wait_ratio", "sim/step_s")),
                      _vs(r.medians["sim/step_s"], base["sim/on_policy_bound_s"]) if base else "n/a",
                      f"{r.cpu_s:.1f}"])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def write_csv(rows: list[Row], path: Path) -> None:
    import csv

    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["setting", "mode", *(key for key, _ in COLUMNS), "sim_cpu_s"])
        for r in rows:
            writer.writerow([r.setting, r.mode, *(r.medians[key] for key, _ in COLUMNS), r.cpu_s])


def draw(rows: list[Row], path: Path) -> list[Path]:
    """The first setting's modes, steps 1-2, with the picture tool of real runs (rolloutpipe.observe.timeline)."""
    from rolloutpipe.observe.timeline import RunTimeline, draw_timeline

    first = [r for r in rows if r.setting == rows[0].setting]
    runs = [RunTimeline(label=f"{r.mode} (simulated)", mode=r.mode, spans=r.result.spans,
                        metrics={m["step"]: m for m in r.result.records}) for r in first]
    setting = rows[0].setting
    return draw_timeline(runs, path, steps=[1, 2], title="simulated" + (f": {setting}" if setting != "-" else ""))


def _vs(value: float, base: float) -> str:
    return f"{100 * (value / base - 1):+.1f}%" if base else "n/a"


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out = {}
    for key, value in tree.items():
        out.update(_leaves(value, f"{prefix}.{key}" if prefix else key))
    return out


def _bind(schema, where: str, *layers: Any):
    """``layers`` merged in order and bound to ``schema``; a config error names the section (``job``, ``sim``).
    Hydra's composition is read-only to new keys: merged as plain values, so ``bind`` names an unknown one."""
    plain = [OmegaConf.to_container(layer) if isinstance(layer, DictConfig) else layer for layer in layers]
    try:
        return bind(schema, OmegaConf.merge(*plain), listed_by=LISTED_BY)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None


def _dotlist(overrides: dict[str, Any]):
    return OmegaConf.from_dotlist([f"{k}={v}" for k, v in overrides.items()])
