"""The store host's memory over a long run: RSS of rollout rank 0 (which hosts the TCPStore) and the store's key
count at step 100 and at the last step of a small workload, with the run's own checkpoints every 100 steps.

    python bench/store_memory.py                 # 1,000 steps (about 10 minutes on 2 cores)
    python bench/store_memory.py --steps 300 --payload-file   # group payloads through run_dir/payloads

Each consumed step's handles, payloads and records are deleted (Transport.forget_step), so the key count must be
the same at both points and the RSS close to it; the table prints both, and the size of run_dir/payloads.
The job runs as the launcher would run it (two node processes, the RP_* contract), so this script knows the
store's port and can count its keys from outside. Quote the ratio of the two RSS figures, not one of them.
"""

from __future__ import annotations

import argparse
import json
import secrets
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

WORKLOAD = ["rollout_batch_size=4", "n_samples_per_prompt=4", "global_batch_size=16", "micro_batch_size=16",
            "rollout_max_response_len=32", "trainer.lr=1e-7", "pipeline.mode=cgp", "run.checkpoint_every=100",
            "pipeline.heartbeat_s=1", "pipeline.peer_timeout_s=60"]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--payload-file", action="store_true", help="payloads as files (inline_payload_max_bytes=0)")
    args = parser.parse_args()

    import torch.distributed as dist
    from omegaconf import OmegaConf

    from rolloutpipe.config import load_config, save_config
    from rolloutpipe.control.env import NodeEnv, Role, free_port

    run_dir = Path(tempfile.mkdtemp(prefix="rp-store-memory-")) / "run"
    overrides = [*WORKLOAD, f"num_rollout={args.steps}", f"run.dir={run_dir}", "run.id=bench"]
    if args.payload_file:
        overrides.append("pipeline.inline_payload_max_bytes=0")
    save_config(load_config(OmegaConf.from_dotlist(overrides)), run_dir / "config.yaml")
    port, secret = free_port(), secrets.token_bytes(32)
    procs = {}
    for role in (Role.rollout, Role.trainer):
        env = NodeEnv(role=role, rank=0, world_size=1, store_host="127.0.0.1", store_port=port, run_id="bench",
                      secret=secret, run_dir=run_dir)
        procs[role] = subprocess.Popen([sys.executable, "-m", "rolloutpipe.launch.node"], cwd=REPO,
                                       env={**dict(__import__("os").environ), "PYTHONPATH": str(REPO),
                                            **env.to_environ()},
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    store = None
    points = sorted({min(100, args.steps), args.steps})
    rows = []
    start = time.time()
    while points and all(p.poll() is None for p in procs.values()):
        done = steps_done(run_dir)
        if store is None:
            try:
                store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                      timeout=timedelta(seconds=5))
            except RuntimeError:
                store = None
        if store is not None and done >= points[0]:
            payload_bytes = sum(f.stat().st_size for f in (run_dir / "payloads").rglob("*") if f.is_file())
            rows.append((done, rss_mib(procs[Role.rollout].pid), store.num_keys(), payload_bytes / 2**20,
                         time.time() - start))
            points.pop(0)
        time.sleep(0.05 if points and done >= points[0] - 2 else 0.5)
    for proc in procs.values():
        _, err = proc.communicate(timeout=600)
        if proc.returncode != 0:
            print(err[-3000:], file=sys.stderr)
            return 1
    print(f"store host memory, {args.steps} steps of {' '.join(WORKLOAD[:5])} "
          f"({'file' if args.payload_file else 'inline'} payloads)")
    print(f"{'step':>6} {'rollout0 RSS MiB':>17} {'store keys':>11} {'payloads MiB':>13} {'elapsed s':>10}")
    for step, rss, keys, payload, elapsed in rows:
        print(f"{step:>6} {rss:>17.1f} {keys:>11} {payload:>13.2f} {elapsed:>10.0f}")
    if len(rows) == 2:
        print(f"RSS ratio last/step-100: {rows[1][1] / rows[0][1]:.3f}; keys: {rows[0][2]} -> {rows[1][2]}")
    print(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
