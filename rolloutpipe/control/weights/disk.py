"""Weight sync through a file (``pipeline.weight_sync=disk``, the default; every engine kind).

Trainer rank 0 writes ``run_dir/weights/policy_v<k>.safetensors`` and publishes its path, size and sha256 in the
store (a sealed record, control/transport.py); the rollout node checks that the path is that file and the file has
that digest, then has every engine call ``update_weights_from_disk``. Meanwhile rank 0 reads the file back for the
step's weights digest (digest.py: unlike the file's sha256, it does not depend on the header's order). Needs a file
system both node groups see. A replacement engine (after a failure) loads the same file, so engines are replaceable.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path

from rolloutpipe.control.transport import Transport
from rolloutpipe.control.weights import EngineGroup, PolicyWeights, WeightSyncSettings, weights_record_key
from rolloutpipe.control.weights.digest import file_weights_digest

ENGINES_REPLACEABLE = True


def weights_file(version: int) -> str:
    """Where disk sync writes policy ``version``, relative to the run directory."""
    return f"weights/policy_v{version}.safetensors"


def file_digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class Sender:
    def __init__(self, settings: WeightSyncSettings, *, transport: Transport, run_dir: Path,
                 policy: PolicyWeights) -> None:
        self.transport = transport
        self.run_dir = run_dir
        self.policy = policy

    def open(self) -> None:
        pass

    def publish(self, version: int, *, serves: bool) -> str:
        path = self.run_dir / weights_file(version)
        self.policy.save_weights(path)
        self.transport.put_record(weights_record_key(self.transport, version), {
            "path": weights_file(version), "policy_version": version, "size": path.stat().st_size,
            "sha256": file_digest(path)})
        return file_weights_digest(path)  # read back while the engines load it: a sharded policy is not gathered again

    def retire(self, version: int) -> None:
        (self.run_dir / weights_file(version)).unlink(missing_ok=True)


class Receiver:
    def __init__(self, settings: WeightSyncSettings, *, transport: Transport, run_dir: Path, engines: EngineGroup,
                 check: Callable[[str], None]) -> None:
        self.run_dir = run_dir
        self.engines = engines
        self.visible_timeout_s = settings.visible_timeout_s
        self.check = check

    def open(self) -> None:
        pass

    def load(self, record: dict, version: int) -> None:
        self.engines.load_weights(str(self.checked_file(record, version)), version)

    def checked_file(self, record: dict, version: int) -> Path:
        """Policy ``version``'s file, once it is the one the trainer wrote: the run's own file, complete, with its
        digest. A file not there yet or still short (a shared file system that lags behind the trainer's node) is
        waited for, up to pipeline.weights_visible_timeout_s; the engines never see a path that would fail."""
        path = self.run_dir / weights_file(version)
        if record.get("path") != weights_file(version) or record.get("policy_version") != version:
            raise RuntimeError(f"the weights record of policy_version {version} names {record.get('path')!r}, not "
                               f"{weights_file(version)!r}; refusing to load it.")
        deadline = time.monotonic() + self.visible_timeout_s
        while (lag := _not_visible_yet(path, record.get("size"))) is not None:
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"policy_version {version}'s weights {path} {lag} {self.visible_timeout_s:g}s after the trainer "
                    "wrote them. The rollout node loads them from the run directory, which must be on a file system "
                    "both node groups share (run.dir); raise pipeline.weights_visible_timeout_s if it is shared but "
                    "slow, or use pipeline.weight_sync=distributed.")
            self.check(f"policy_version {version}'s weights to show up complete at {path}")
            time.sleep(0.1)
        if file_digest(path) != record.get("sha256"):
            raise RuntimeError(f"{path} does not have the sha256 the trainer published for policy_version "
                               f"{version}: the file was changed after it was written; refusing to load it.")
        return path


def _not_visible_yet(path: Path, size: int | None) -> str | None:
    """Why ``path`` cannot be the trainer's file of ``size`` bytes yet (None: it may be; its digest decides)."""
    try:
        have = path.stat().st_size
    except FileNotFoundError:
        return "were not there"
    if size is not None and have < size:
        return f"had {have} of their {size} bytes"
    return None
