"""Helpers for tests that run the real job: ``launch.py`` or the node entry point as real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# A small, fast workload: 4 prompts x 4 samples per step; every run of it takes a few seconds.
SMALL = [
    "num_rollout=2",
    "rollout_batch_size=4",
    "n_samples_per_prompt=4",
    "global_batch_size=16",
    "micro_batch_size=4",
    "rollout_max_response_len=6",
    "pipeline.peer_timeout_s=10",
    "pipeline.heartbeat_s=0.5",
]
DENSE_REWARD = ["reward.name=letter_fraction", "reward.import_modules=[tests.fixtures.dense_rewards]"]


@pytest.fixture(autouse=True, scope="session")
def _simulator_build_cache(tmp_path_factory):
    """The compiled simulator (rolloutpipe/sim/compiled.py) is built once per test session, not in ~/.cache."""
    os.environ.setdefault("ROLLOUTPIPE_CACHE", str(tmp_path_factory.mktemp("rolloutpipe-cache")))


def node_environ() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_CPP_LOG_LEVEL": "ERROR"}
    env.pop("RP_ROLE", None)
    return env


def run_job(run_dir: Path, *overrides: str, timeout_s: float = 240,
            environ: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python launch.py run.dir=<run_dir> <overrides>``, to completion (``environ``: more variables)."""
    return subprocess.run(
        [sys.executable, str(REPO / "launch.py"), f"run.dir={run_dir}", *overrides],
        cwd=run_dir.parent, env={**node_environ(), **(environ or {})}, capture_output=True, text=True,
        timeout=timeout_s,
    )


def assert_import_pulls_none_of(modules: list[str], heavy: list[str]) -> None:
    """Import ``modules`` in a fresh interpreter and check that none of ``heavy`` got imported with them."""
    code = (f"import sys; import {', '.join(modules)}; "
            f"heavy = [m for m in {heavy!r} if m in sys.modules]; print(heavy); sys.exit(bool(heavy))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def read_samples(run_dir: Path) -> list[dict]:
    rows = []
    for path in sorted((run_dir / "rollouts").glob("step=*.jsonl")):
        rows.extend(json.loads(line) for line in path.read_text().splitlines())
    return rows


def start_nodes(run_dir: Path, *overrides: str, commands: dict[str, list[str]] | None = None,
                capture: bool = True) -> dict[str, subprocess.Popen]:
    """Start the two node groups by hand with the launcher's environment contract (no launcher watching).

    ``commands`` replaces a role's ``-m rolloutpipe.launch.node`` (the fault suite runs a role under a wrapper).
    """
    from omegaconf import OmegaConf

    from rolloutpipe.config import load_config, save_config
    from rolloutpipe.control.env import NodeEnv, Role, free_port

    cfg = load_config(OmegaConf.from_dotlist([*overrides, f"run.dir={run_dir}", "run.id=bytest"]))
    save_config(cfg, run_dir / "config.yaml")
    port = free_port()
    procs = {}
    for role in (Role.rollout, Role.trainer):
        env = NodeEnv(role=role, rank=0, world_size=1, store_host="127.0.0.1", store_port=port, run_id="bytest",
                      secret=b"k" * 32, run_dir=run_dir)
        command = (commands or {}).get(role.value, ["-m", "rolloutpipe.launch.node"])
        pipe = subprocess.PIPE if capture else subprocess.DEVNULL
        procs[role.value] = subprocess.Popen([sys.executable, *command], cwd=REPO,
                                             env={**node_environ(), **env.to_environ()}, stdout=pipe,
                                             stderr=pipe, text=True)
    return procs


@pytest.fixture
def job_dir(tmp_path: Path):
    def make(name: str) -> Path:
        return tmp_path / name

    return make
