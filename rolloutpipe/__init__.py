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

__version__ = "0.1.0"
