"""The trainer node group (het group 1): consume groups, micro-batch forward/backward, optimizer steps.

    node.py           a trainer rank's parts and its bookkeeping around a step (pipeline.py runs the step)
    config.py         ``trainer.*``: backend, ranks, optimizer, where old log-probs come from
    grpo.py           the GRPO loss as sums, and why the pipelined update equals the synchronous one
    batching.py       pure: which rank trains which group, micro-batches, when a training batch is complete
    backend.py        PolicyBackend, what the node calls on a backend, and trainer_class, which names each one
    grpo_trainer.py   GRPOTrainer: the GRPO micro-batch body and the batch's update, once for every backend
    torch_backend.py  PolicyTrainer: the HF model, torch AdamW, data parallel over gloo
    fsdp_backend.py   FSDPTrainer: the HF model sharded with FSDP2 (parameters, gradients, AdamW state)
    exact_sum.py      trainer.exact_accumulation: the batch's gradient summed exactly in int64 bins, in any order
    fsdp_exact.py     the same on FSDP2: integer reduce-scatters, sums of the shards
    lead.py           reads that rank 0 leads and the other ranks join (a sharded backend's gathers)
    logprobs.py       pure torch: log-probs and entropy from hidden states by chunks, vocabulary parallel
    megatron/         MegatronTrainer: the same GRPOTrainer over Megatron-core (imported only when chosen)

May import: types, model, control/, observe/; node.py also config. Never rollout/: what both sides share is in
control/. Only node.py, the top of the wing, reads the root Config; every other module takes its own section.
"""
