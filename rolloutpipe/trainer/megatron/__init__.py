"""The Megatron-core trainer backend (``trainer.backend=megatron``); imported only when it is selected.

    convert.py   HF <-> Megatron parameter mapping (Qwen2 / Qwen3), tensor-parallel shards
    model.py     Megatron's parallel state on the trainer ranks, and GPTModel from an HF config
    trainer.py   MegatronTrainer: GRPOTrainer's hooks over GPTModel, Megatron DDP and optimizer
    optimizer.py Megatron's optimizer, replicated or distributed (sharded); its state in the checkpoint layout
    cpu.py       the one place that lets Megatron run without CUDA (engaged only when CUDA is absent)

May import: types, model, control/, trainer/. Megatron-core only inside this package.
"""
