"""The trainer node group (het group 1): consume groups, micro-batch forward/backward, optimizer steps.

    node.py           a trainer rank's parts and its bookkeeping around a step (pipeline.py runs the step)
    config.py         ``trainer.*``: backend, ranks, optimizer, where old log-probs come from
    grpo.py           the GRPO loss as sums, and why the pipelined update equals the synchronous one
    batching.py       pure: which rank trains which group, micro-batches, when a training batch is complete
    torch_backend.py  PolicyTrainer: the HF model, torch AdamW, data parallel over gloo
    logprobs.py       pure torch: log-probs and entropy from hidden states by chunks, vocabulary parallel
    megatron/         MegatronTrainer: the same interface over Megatron-core (imported only when chosen)
    weights.py        rank 0's side of weight sync: policy k+1 as a file or a broadcast

May import: types, model, config, control/, observe/. Never rollout/: what both sides share is in control/.
"""
