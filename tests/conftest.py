"""Helpers for tests that run the real job: ``launch.py`` or the node entry point as real processes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parent.parent

# A small, fast workload: 4 prompts x 4 samples per step; every run of it takes a few seconds. W&B is off: an
# offline run costs 1-2 s a job, so the tests of W&B (and of every file a run writes) add wandb.mode=offline. So is
# timeline.png (~0.5 s of each run's end, on 2 cores): the tests of the picture add run.draw_timeline=true.
SMALL = [
    "num_rollout=2",
    "rollout_batch_size=4",
    "n_samples_per_prompt=4",
    "global_batch_size=16",
    "micro_batch_size=4",
    "rollout_max_response_len=6",
    "pipeline.peer_timeout_s=10",
    "pipeline.heartbeat_s=0.5",
    "wandb.mode=disabled",
    "run.draw_timeline=false",
]
DENSE_REWARD = ["reward.name=letter_fraction", "reward.import_modules=[tests.fixtures.dense_rewards]"]


REQUIRED_BY_CI = {"slurm": "RP_REQUIRE_SLURM"}
"""Extras whose tests fail instead of skipping when the variable is 1 (.ci/run sets RP_REQUIRE_SLURM=1), so CI
cannot pass without having run them."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing (hydra_plugins.hydra_submitit_launcher)
        return False


def missing_extra(extra: str, *modules: str) -> str | None:
    """Why a test that imports ``modules``, which the project's ``extra`` installs, cannot run here; None if it can."""
    missing = [m for m in modules if not _installed(m)]
    return f"needs the {extra} extra ({', '.join(missing)} missing): pip install -e '.[{extra}]'" if missing else None


def _required(extra: str) -> str | None:
    variable = REQUIRED_BY_CI.get(extra)
    return variable if variable and os.environ.get(variable) == "1" else None


def needs_extra(extra: str, *modules: str) -> pytest.MarkDecorator:
    """Mark a test (or a module, as ``pytestmark``) that needs ``modules`` of the project's ``extra``: without them
    it skips, naming the extra, before any fixture runs (a session fixture may run a whole job); under the extra's
    REQUIRED_BY_CI variable it fails instead."""
    return pytest.mark.needs_extra(extra, *modules)


SLURM_EXTRA = ("submitit", "torchx", "hydra_plugins.hydra_submitit_launcher")
"""What the slurm extra installs: every test marked ``slurm`` (the local cluster's) needs all of it."""


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's worker reads the groups
def pytest_collection_modifyitems(items) -> None:
    for item in items:
        slurm = item.get_closest_marker("slurm") is not None
        # pytest-xdist's groups (-n 2 --dist loadgroup: docs/testing.md): a module's tests run in one worker, so a
        # module-scoped fixture (a reference run) runs once; the cluster tier's in one, one Slurm job at a time
        item.add_marker(pytest.mark.xdist_group("slurm" if slurm else item.nodeid.split("::")[0]))
        # a skip marker: reported at the test's own line, and before its fixtures
        if slurm:
            item.add_marker(needs_extra("slurm", *SLURM_EXTRA))
        for mark in item.iter_markers("needs_extra"):
            if (why := missing_extra(*mark.args)) is not None and not _required(mark.args[0]):
                item.add_marker(pytest.mark.skip(reason=why))


def pytest_runtest_setup(item) -> None:
    for mark in item.iter_markers("needs_extra"):  # (missing here only if required: it fails, before the fixtures)
        if (why := missing_extra(*mark.args)) is not None:
            pytest.fail(f"{why} ({_required(mark.args[0])}=1: these tests must run here)", pytrace=False)


@pytest.fixture(autouse=True, scope="session")
def _simulator_build_cache(tmp_path_factory):
    """The compiled simulator (rolloutpipe/sim/compiled.py) is built once per test session, not in ~/.cache: in the
    folder pytest-xdist's workers share (their own temporary folders' parent; a concurrent build is harmless)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    (cache := root / "rolloutpipe-cache").mkdir(exist_ok=True)
    os.environ.setdefault("ROLLOUTPIPE_CACHE", str(cache))


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


def run_jobs(jobs: dict[str, tuple[Path, list[str], dict[str, str] | None]], *, timeout_s: float = 240,
             at_once: int = 2) -> dict[str, subprocess.CompletedProcess]:
    """``run_job`` for each of ``jobs`` (name: run directory, overrides, more variables), ``at_once`` of them side by
    side: for runs that mostly wait (an environment's delays), not for runs that compute. Measured on 2 cores: two
    parity runs at once took the time of one after the other, with 10-15% more CPU."""
    with ThreadPoolExecutor(max_workers=at_once) as pool:
        futures = {name: pool.submit(run_job, run_dir, *overrides, timeout_s=timeout_s, environ=environ)
                   for name, (run_dir, overrides, environ) in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


def assert_import_pulls_none_of(modules: list[str], heavy: list[str]) -> None:
    """Import ``modules`` in a fresh interpreter and check that none of ``heavy`` got imported with them."""
    code = (f"import sys; import {', '.join(modules)}; "
            f"heavy = [m for m in {heavy!r} if m in sys.modules]; print(heavy); sys.exit(bool(heavy))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (Linux: /proc/<pid>/task/<tid>/children)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        try:  # a process may end between being listed and being read: it has no children left to find
            threads = list(Path(f"/proc/{current}/task").glob("*/children"))
        except OSError:
            continue
        for children in threads:
            try:
                todo += [int(c) for c in children.read_text().split()]
            except OSError:
                pass
    return found


def listening_addresses(*pids: int) -> list[str]:
    """``host:port`` of every TCP socket these processes listen on (Linux: /proc), e.g. ``127.0.0.1:31337``."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                try:
                    target = os.readlink(fd)
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:["):-1])
        except OSError:  # the process has exited
            continue
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)
                if width == 8:
                    host = ".".join(str(b) for b in reversed(raw))
                else:  # four little-endian 32-bit words
                    import ipaddress

                    host = str(ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))))
                found.append(f"{host}:{int(port, 16)}")
    return found


def wait_for(condition: Callable[[], object], what: str, *, timeout_s: float = 300.0,
             running: Iterable[subprocess.Popen] = (), details: Callable[[], object] = lambda: "") -> None:
    """Poll ``condition`` until it holds. Fails naming ``what`` if a process of ``running`` ends first, or, as a
    guard against a hang (far above the usual time, not a check of speed), after ``timeout_s``; ``details()`` (the
    processes' output, a log) goes into the message."""
    deadline = time.monotonic() + timeout_s
    running = list(running)
    while not condition():
        ended = [p.returncode for p in running if p.poll() is not None]
        assert not ended, f"the run ended (exit codes {ended}) before {what}\n{details()}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f}s\n{details()}"
        time.sleep(0.1)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def read_samples(run_dir: Path) -> list[dict]:
    rows = []
    for path in sorted((run_dir / "rollouts").glob("step=*.jsonl")):
        rows.extend(json.loads(line) for line in path.read_text().splitlines())
    return rows


def final_weights(run_dir: Path) -> dict:
    return load_file(str(run_dir / "checkpoints" / "final" / "model.safetensors"))


def samples(run_dir: Path) -> dict[str, list[int]]:
    return {s["id"]: s["response_ids"] for s in read_samples(run_dir)}


def start_nodes(run_dir: Path, *overrides: str, commands: dict[str, list[str]] | None = None,
                capture: bool = True, roles: tuple[str, ...] = ("rollout", "trainer"),
                port: int | None = None, environ: dict[str, str] | None = None) -> dict[str, subprocess.Popen]:
    """Start the two node groups by hand with the launcher's environment contract (no launcher watching): run id
    ``bytest``, secret ``b"k" * 32``. Every trainer rank of ``trainer.num_ranks`` starts (``trainer``, then
    ``trainer1``, ... in the result); the rollout group is its manager alone.

    ``commands`` replaces a role's ``-m rolloutpipe.launch.node`` (the fault suite runs a role under a wrapper);
    ``roles`` and ``port`` start one group now and the other later, on the same store port; ``environ``: more
    variables (e.g. SLURM_RESTART_COUNT).
    """
    from omegaconf import OmegaConf

    from rolloutpipe.config import load_config, save_config
    from rolloutpipe.control.env import NodeEnv, Role, free_port

    if not (run_dir / "config.yaml").exists():
        cfg = load_config(OmegaConf.from_dotlist([*overrides, f"run.dir={run_dir}", "run.id=bytest"]))
        save_config(cfg, run_dir / "config.yaml")
    num_trainer_ranks = OmegaConf.load(run_dir / "config.yaml").trainer.num_ranks
    port = port or free_port()
    procs = {}
    for role in map(Role, roles):
        for rank in range(num_trainer_ranks if role is Role.trainer else 1):
            env = NodeEnv(role=role, rank=rank, world_size=num_trainer_ranks if role is Role.trainer else 1,
                          store_host="127.0.0.1", store_port=port, run_id="bytest", secret=b"k" * 32, run_dir=run_dir)
            command = (commands or {}).get(role.value, ["-m", "rolloutpipe.launch.node"])
            pipe = subprocess.PIPE if capture else subprocess.DEVNULL
            procs[role.value + (str(rank) if rank else "")] = subprocess.Popen(
                [sys.executable, *command], cwd=REPO, env={**node_environ(), **env.to_environ(), **(environ or {})},
                stdout=pipe, stderr=pipe, text=True)
    return procs


def outputs_of(procs: dict[str, subprocess.Popen], timeout_s: float) -> dict[str, tuple[str, str]]:
    """Each started node's (stdout, stderr) once it exits; one still running when that fails (a hung run, a timeout)
    is killed, not left beside the next tests."""
    try:
        return {role: p.communicate(timeout=timeout_s) for role, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()


def four_engine_workload(data: Path) -> list[str]:
    """3 steps in float64 with two trainer ranks and four embedded engine servers, however many rollout nodes run
    them (tests/multiprocess/test_hosts.py, tests/cluster/test_slurm_hosts.py): the samples and the update are exact."""
    return [*SMALL, *DENSE_REWARD, "model.dtype=float64", "run.save_samples=true", "global_batch_size=8",
            "num_rollout=3", f"data.path={data}", "rollout.engine=embedded_http", "trainer.num_ranks=2",
            "rollout.concurrency=2"]


@pytest.fixture(scope="session")
def four_engine_data(tmp_path_factory) -> Path:
    from rolloutpipe.rollout.tasks import ReversalTaskConfig, write_reversal_jsonl

    return write_reversal_jsonl(ReversalTaskConfig(num_rows=12, seed=3), tmp_path_factory.mktemp("data") / "rows.jsonl")


@pytest.fixture(scope="session")
def one_rollout_node(tmp_path_factory, four_engine_data) -> Path:
    """The reference of the multi-node tests: one rollout node running all four engines."""
    run_dir = tmp_path_factory.mktemp("one-rollout-node") / "run"
    result = run_job(run_dir, *four_engine_workload(four_engine_data), "rollout.num_engines=4",
                     "pipeline.peer_timeout_s=30")
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.fixture
def job_dir(tmp_path: Path):
    def make(name: str) -> Path:
        return tmp_path / name

    return make


def sim_job(**overrides):
    """The simulator tests' small job (8 prompts x 4 samples, 2 engines of 6 slots), with ``overrides`` by dotted
    key (``sim_job(**{"rollout.admission": "fgd"})``)."""
    from rolloutpipe.config import load_config

    base = {"rollout_batch_size": 8, "n_samples_per_prompt": 4, "global_batch_size": 16, "micro_batch_size": 4,
            "rollout_max_response_len": 64, "rollout": {"num_engines": 2, "concurrency": 6}, "num_rollout": 4}
    for key, value in overrides.items():
        node = base
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return load_config(base)
