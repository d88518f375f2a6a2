"""Trainer rank 0's side of weight sync: policy k+1 out to the engines, as a file or a broadcast.

The two ways, the process group and the engines' side are described in control/weight_sync.py; here is what
trainer rank 0 does: ``WeightPublisher.open`` once (distributed: publish the group and join it as rank 0),
``publish`` after each step's last optimizer step, ``retire`` once no engine can still need a policy's file.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from rolloutpipe.config import Config
from rolloutpipe.control.env import free_port, node_address
from rolloutpipe.control.transport import Transport
from rolloutpipe.control.weight_sync import (
    Bucket,
    WeightGroup,
    WeightSync,
    broadcast_bucket,
    file_digest,
    join_group,
    plan_buckets,
    wait_all,
    weight_sync_backend,
    weights_file,
)


class Broadcaster:
    """Trainer rank 0's side: rank 0 of ``group`` (joined here, blocking until the engines have joined too), then
    one ``send`` per policy version while the rollout node has the engines receive it.

    ``check(what)`` runs every half second while this waits for the engines, and raises when the run is aborted or
    the rollout node stopped heart-beating (transport.Liveness.check), so a lost peer is not a silent hang.
    """

    def __init__(self, *, group: WeightGroup, bucket_bytes: int, timeout_s: float,
                 check: Callable[[str], None]) -> None:
        self.group = group
        self.bucket_bytes = bucket_bytes
        self.device = "cuda" if group.backend == "nccl" else "cpu"
        self._check = check
        joined: dict[str, Any] = {}

        def join() -> None:
            try:
                joined["pg"] = join_group(group, 0, timeout_s=timeout_s)
            except BaseException as err:  # noqa: BLE001 - re-raised below, on the caller's thread
                joined["error"] = err

        thread = threading.Thread(target=join, name="weight-group-join", daemon=True)
        thread.start()
        while thread.is_alive():
            self._check(f"the engines to join the weight-update group at {group.master_address}:{group.master_port}")
            thread.join(timeout=0.5)
        if "error" in joined:
            raise joined["error"]
        self._pg = joined["pg"]

    def plan(self, state: dict[str, torch.Tensor]) -> list[Bucket]:
        return plan_buckets(state, self.bucket_bytes)

    def send(self, state: dict[str, torch.Tensor], buckets: list[Bucket], policy_version: int) -> None:
        what = f"the engines to receive policy_version {policy_version}"
        for bucket in buckets:
            wait_all(broadcast_bucket(self._pg, state, bucket, self.device), lambda: self._check(what))


class WeightPublisher:
    """Trainer rank 0's side of both ways (module docstring): ``open`` once, ``publish`` each new policy.

    ``publish`` returns once the policy is on its way: the file written and announced, or every bucket broadcast
    (which needs the engines to receive them, so it returns after the rollout node has had them loaded).
    """

    def __init__(self, *, cfg: Config, run_dir: Path, transport: Transport, trainer) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.transport = transport
        self.trainer = trainer
        self.broadcaster: Broadcaster | None = None

    def open(self) -> None:
        """distributed: publish the weight-update process group and join it as rank 0 (returns once every engine
        has joined)."""
        cfg = self.cfg
        if cfg.pipeline.weight_sync is not WeightSync.distributed:
            return
        group = WeightGroup(master_address=node_address(self.transport.address.host), master_port=free_port(),
                            world_size=1 + cfg.rollout.num_engines * cfg.rollout.ranks_per_engine,
                            backend=weight_sync_backend(cfg.rollout.engines_on_gpus,
                                                        self.trainer.hf_state()))
        self.transport.put_record(self.transport.key("weight_sync", "group"), group.to_json())
        self.broadcaster = Broadcaster(group=group, bucket_bytes=int(cfg.pipeline.weight_sync_bucket_mb * 2**20),
                                       timeout_s=cfg.rollout.server_start_timeout_s + cfg.pipeline.connect_timeout_s,
                                       check=lambda what: self.transport.liveness.check(waiting_for=what))

    def publish(self, version: int, *, serves: bool) -> None:
        """Send policy ``version``; ``serves`` is False for the last one, which only goes to the final checkpoint."""
        key = self.transport.key("weights", f"policy_version={version}")
        if self.broadcaster is None:
            path = self.run_dir / weights_file(version)
            self.trainer.save_weights(path)
            self.transport.put_record(key, {"path": weights_file(version), "policy_version": version,
                                            "size": path.stat().st_size, "sha256": file_digest(path)})
        elif serves:  # the rollout node has the engines receive the plan's buckets while they are sent
            state = self.trainer.hf_state()
            buckets = self.broadcaster.plan(state)
            self.transport.put_record(key, {"policy_version": version, "buckets": [asdict(b) for b in buckets]})
            self.broadcaster.send(state, buckets, version)

    def retire(self, version: int) -> None:
        """Delete policy ``version``'s file (disk sync) once no engine can still need it."""
        (self.run_dir / weights_file(version)).unlink(missing_ok=True)
