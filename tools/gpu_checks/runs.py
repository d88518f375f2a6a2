"""Whole jobs through ``python launch.py`` with the trainer on the GPUs: the default run, a Megatron run stopped and
resumed, bfloat16 bit-identity of sync and cgp+FGD on each backend, and FSDP over NCCL.

- ``default_run``: the embedded default (a tiny Qwen3 learning string reversal), fewer steps: it exits 0 and learns
  (the mean reward of its last 5 steps above that of its first 5).
- ``resume``: Megatron's distributed optimizer in bfloat16 with exact accumulation, a checkpoint every step, on
  ``Machine.num_ranks``: 4 steps uninterrupted against 2 steps then ``num_rollout=4 run.resume=auto`` in the same run
  directory: the same weights digest at every step and the same final model.safetensors
  (tests/multiprocess/test_resume.py pins it on the CPU).
- ``bit_identity``: for trainer.backend torch, fsdp and megatron, bfloat16 with exact accumulation and batch-invariant
  engines, sync on one rank against cgp with ``rollout.admission=fgd`` on ``Machine.num_ranks``, the groups' rewards
  delayed so that they arrive in another order: the same weights digest after every step
  (tests/multiprocess/test_pipeline.py pins it on the CPU).
- ``fsdp_nccl``: FSDP on the GPUs (NCCL; one rank per GPU, at most 2) on the float path, cgp: it exits 0, every
  step's loss and gradient norm are finite and the weights move every step. Not compared with the torch backend:
  on the float path the reduction order differs, so bits would (test_fsdp.py compares in float64, to 1e-9).
"""

from __future__ import annotations

import math

from gpu_checks.common import (
    BF16_EXACT,
    WORKLOAD,
    Machine,
    Row,
    Verdict,
    failure,
    launch,
    launch_all,
    same_digests,
    same_final_weights,
    verdict,
)

RESUME = ["trainer.backend=megatron", "trainer.megatron.distributed_optimizer=true", "run.checkpoint_every=1",
          "run.save_samples=true", "pipeline.mode=cgp", "global_batch_size=8"]
NUM_STEPS = {"default_run": 60, "bit_identity": 5, "fsdp_nccl": 3}
"""Steps of each run on a GPU (issue 43's H200: the default run's 60 in 21.6 s)."""
SMOKE_STEPS = {"default_run": 20, "bit_identity": 3, "fsdp_nccl": 3}
"""--cpu-smoke: fewer, for two CPU cores (the default run's reward rises within 20 there too)."""
JITTER = ["reward.name=letter_fraction_jittered", "reward.num_workers=4"]
"""Rewards delayed by $RP_TEST_REWARD_JITTER (tests/fixtures/dense_rewards.py): set for cgp only, so its groups
complete out of order."""


def steps(machine: Machine, part: str) -> int:
    return (SMOKE_STEPS if machine.cpu_smoke else NUM_STEPS)[part]


def default_run(machine: Machine) -> list[Row]:
    from rolloutpipe.observe.timeline import read_metrics

    n = steps(machine, "default_run")
    run_dir = machine.folder("default_run") / "run"
    device = "CPU" if machine.cpu_smoke else "CUDA"
    checked = f"python launch.py num_rollout={n} (the embedded default, trainer on {device})"
    error = failure("default run", launch(run_dir, f"num_rollout={n}", "wandb.mode=disabled"))
    if error is not None:
        return [Row(part="default_run", checked=checked, measured=error, limit="exit 0", verdict=Verdict.miss)]
    rewards = [r["rollout/reward_mean"] for _, r in sorted(read_metrics(run_dir).items())]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    return [Row(part="default_run", checked=checked, measured=f"mean reward {first:.3f} (steps 0-4) -> {last:.3f} "
                f"(last 5) in {len(rewards)} steps", limit="exit 0, last 5 above first 5",
                verdict=verdict(len(rewards) == n and last > first), figures={"rewards": rewards})]


def resume(machine: Machine) -> list[Row]:
    whole, split = machine.folder("resume") / "whole", machine.folder("resume") / "split"
    common = [*WORKLOAD, *BF16_EXACT, *RESUME, f"trainer.num_ranks={machine.num_ranks}"]
    checked = (f"Megatron distributed optimizer on {machine.num_ranks} rank(s), bf16: 4 steps vs 2 steps then "
               "num_rollout=4 run.resume=auto")
    first = launch_all(machine, {"whole": (whole, *common, "num_rollout=4"),
                                 "split": (split, *common, "num_rollout=2")})
    error = failure("whole", first["whole"]) or failure("split", first["split"])
    if error is None:
        error = failure("resumed", launch(split, *common, "num_rollout=4", "run.resume=auto"))
    if error is not None:
        return [Row(part="resume", checked=checked, measured=error, limit="exit 0", verdict=Verdict.miss)]
    same, measured = same_digests(whole, split, 4)
    final = same_final_weights(whole, split)
    return [Row(part="resume", checked=checked, measured=f"{measured}; final weights {'equal' if final else 'differ'}",
                limit="equal at every step, equal final weights", verdict=verdict(same and final))]


def bit_identity(machine: Machine) -> list[Row]:
    n = steps(machine, "bit_identity")
    common = [*WORKLOAD, *BF16_EXACT, *JITTER, f"num_rollout={n}"]
    runs, environ = {}, {}
    for backend in ("torch", "fsdp", "megatron"):
        base = machine.folder("bit_identity") / backend
        runs[f"{backend} sync"] = (base / "sync", *common, f"trainer.backend={backend}", "pipeline.mode=sync")
        runs[f"{backend} cgp"] = (base / "cgp", *common, f"trainer.backend={backend}", "pipeline.mode=cgp",
                                  "rollout.admission=fgd", f"trainer.num_ranks={machine.num_ranks}")
        environ[f"{backend} cgp"] = {"RP_TEST_REWARD_JITTER": "5"}
    results = launch_all(machine, runs, environ)
    rows = []
    for backend in ("torch", "fsdp", "megatron"):
        checked = f"{backend}: bf16 sync on 1 rank vs cgp+fgd on {machine.num_ranks}, {n} steps"
        error = failure(f"{backend} sync", results[f"{backend} sync"]) or failure(f"{backend} cgp",
                                                                               results[f"{backend} cgp"])
        if error is not None:
            rows.append(Row(part="bit_identity", checked=checked, measured=error, limit="exit 0",
                            verdict=Verdict.miss))
            continue
        same, measured = same_digests(runs[f"{backend} sync"][0], runs[f"{backend} cgp"][0], n)
        rows.append(Row(part="bit_identity", checked=checked, measured=measured, limit="equal at every step",
                        verdict=verdict(same)))
    return rows


def fsdp_nccl(machine: Machine) -> list[Row]:
    from rolloutpipe.observe.report import run_digests
    from rolloutpipe.observe.timeline import read_metrics

    if machine.cpu_smoke:
        return [Row(part="fsdp_nccl", checked="FSDP over NCCL", measured="skipped: no GPU (NCCL needs CUDA devices)",
                    limit="-", verdict=Verdict.skipped)]
    n, ranks = steps(machine, "fsdp_nccl"), machine.num_ranks
    run_dir = machine.folder("fsdp_nccl") / "run"
    checked = f"trainer.backend=fsdp on {ranks} GPU(s) over NCCL, bf16 float path, cgp, {n} steps"
    error = failure("fsdp", launch(run_dir, *WORKLOAD, "model.dtype=bfloat16", "trainer.backend=fsdp",
                                   f"trainer.num_ranks={ranks}", "pipeline.mode=cgp", f"num_rollout={n}"))
    if error is not None:
        return [Row(part="fsdp_nccl", checked=checked, measured=error, limit="exit 0", verdict=Verdict.miss)]
    metrics = [r for _, r in sorted(read_metrics(run_dir).items())]
    finite = all(math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"]) for r in metrics)
    digests = run_digests(run_dir)
    moved = len(set(digests.values())) == len(digests) == n
    return [Row(part="fsdp_nccl", checked=checked,
                measured=f"{len(metrics)} steps, loss and grad norm finite: {finite}, new digest every step: {moved}",
                limit="exit 0, finite, weights move", verdict=verdict(len(metrics) == n and finite and moved))]
