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

_os.environ.setdefault("MKL_CBWR", "AVX2,STRICT")
"""CPU numerics: MKL's conditional numerical reproducibility, its AVX2 code path, strict (unless MKL_CBWR is set
already; MKL reads it at its first call, so importing the package before any matmul is enough, and every process a
run starts inherits it), so that the runs' bit-identical updates (any arrival order, any number of data-parallel
ranks) hold on the CPU. Measured with oneMKL 2024.0 (CPU torch 2.13 and 2.9): on an Intel AVX-512 Sapphire Rapids
VM (2026-12-05) MKL's default path took other kernels by the number of rows, and this one gave a row the same bits at
every multiple of 4 rows. MKL honours the branch on Intel CPUs only: on an AMD EPYC (Zen 4,
2026-12-06) it runs as ``AUTO,STRICT`` (MKL_VERBOSE says so): float32 still independent of alignment and thread
count, float64 not of the thread count, and a row's bits depend on the number of rows of its call on both CPUs
(rollout/engines/row_attention.py, which no longer rests on MKL for that). There a Megatron update on one
data-parallel rank differed from the same update on two (tests/multiprocess/test_resume.py pins ``COMPATIBLE`` off
Intel, which gave them the same bits but made float32 depend on the thread count). GPU math is not MKL's.
MKL_CBWR=AUTO gives MKL's fastest path back."""

__version__ = "0.1.0"
