"""RolloutPipe: on-policy GRPO with complete-group pipelining across a rollout and a trainer node group.

    types.py  config.py  pipeline.py   the nouns, the typed config, one RL step across both node groups
    model.py                           the policy model and tokenizer loader both node groups use
    control/   what crosses between the node groups: store, signed records, clock, env, weight sync, checkpoints
    rollout/   the rollout node group: admission, engines, rewards, dispatcher
    trainer/   the trainer node group: loss, batching, torch and Megatron backends, weight publishing
    observe/   spans, metrics, trace, timeline, W&B
    launch/    local processes, the Slurm het job, the node entry point
    sim/       the discrete-event simulator

May import: each part only what is below it (tests/unit/test_layout.py checks it): types, model <- control <- observe
<- rollout, trainer (side by side, never importing each other) <- config.py (it binds the section configs that
live beside each component) <- the node modules (rollout/node.py, trainer/node.py: the only readers of the root
Config) <- pipeline <- launch. Importing the package imports nothing heavy (no SGLang, Megatron, W&B or
submitit): those live in their adapters and are imported there.
"""

import os as _os


def _reproducible_mkl_branch() -> str:
    """MKL's conditional numerical reproducibility setting for this CPU (the package's default MKL_CBWR).

    Measured (CPU torch 2.13 and 2.9, oneMKL 2024.0): on Intel CPUs, ``AVX2,STRICT`` (MKL's AVX2 code path, strict:
    a GEMM's bits do not depend on its operands' alignment; on an AVX-512 Sapphire Rapids VM the default path took
    other kernels by the number of rows). MKL honours the branch settings on Intel CPUs only: on an AMD EPYC (Zen 4,
    2026-12-06), ``AVX2,STRICT`` ran as ``AUTO,STRICT`` (MKL_VERBOSE says so), whose float64 GEMM rounded a row of a
    4-row product otherwise than the same row of a 32-row one, and a Megatron update on one data-parallel rank
    differed from the same update on two (tests/multiprocess/test_resume.py); with MKL_CBWR unset, results moved with
    the operands' alignment. ``COMPATIBLE`` (the branch every x86 CPU runs alike) gave the update the same bits on one
    rank and two. Rows in the embedded engine's batch-invariant forward rest on none of these:
    rollout/engines/row_attention.py computes each linear layer in calls of one shape."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            vendor = next((line for line in cpuinfo if line.startswith("vendor_id")), "")
    except OSError:
        vendor = ""
    return "AVX2,STRICT" if "GenuineIntel" in vendor else "COMPATIBLE"


_os.environ.setdefault("MKL_CBWR", _reproducible_mkl_branch())
"""CPU numerics: MKL's conditional numerical reproducibility (unless MKL_CBWR is set already; MKL reads it at its first
call, so importing the package before any matmul is enough, and every process a run starts inherits it), so that the
runs' bit-identical updates (any arrival order, any number of data-parallel ranks) hold on the CPU: the setting for
this CPU's vendor (``_reproducible_mkl_branch``). GPU math is not MKL's. MKL_CBWR=AUTO gives MKL's fastest path back."""

__version__ = "0.1.0"
