"""RolloutPipe: on-policy GRPO with complete-group pipelining across a rollout and a trainer node group.

Importing the package imports nothing heavy (no SGLang, Megatron, W&B or submitit): those live in
their adapters and are imported there.
"""

__version__ = "0.1.0"
