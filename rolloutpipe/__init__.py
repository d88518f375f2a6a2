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
"""CPU numerics: MKL's conditional numerical reproducibility, pinned to its AVX2 code path, strict (unless MKL_CBWR is
set already; MKL reads it at its first call, so importing the package before any matmul is enough, and every process
a run starts inherits it). On AVX-512 CPUs MKL's float32 GEMM picks other kernels by the number of rows (measured on a
Sapphire Rapids VM: a row of a 4-row matmul and of an 8-row one differ whenever K >= 128), which breaks what the
embedded engine's batch invariance and the runs' bit-identical updates rest on (rollout/engines/row_attention.py);
this path gives every row the same bits at every multiple of 4 rows on every x86 CPU seen so far. GPU math is not
MKL's. MKL_CBWR=AUTO gives MKL's fastest path back."""

__version__ = "0.1.0"
