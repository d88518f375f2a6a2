"""fsdp_backend's pure parts: the streamed safetensors file and the layers it shards (the jobs: multiprocess)."""

from __future__ import annotations

import torch

from rolloutpipe.control.checkpoint import ShardedState, write_shard
from rolloutpipe.model import DType, ModelConfig, build_tiny_tokenizer, load_model
from rolloutpipe.trainer.config import GRPOConfig, OldLogprobSource, TrainerBackend, TrainerConfig
from rolloutpipe.trainer.fsdp_backend import FSDPTrainer, decoder_layers, hf_names
from rolloutpipe.trainer.grpo_trainer import TrainSample


def test_each_decoder_layer_is_sharded_and_the_tied_head_is_not_sent_twice():
    model = load_model(ModelConfig(dtype=DType.float32), len(build_tiny_tokenizer()))
    assert len(decoder_layers(model)) == model.config.num_hidden_layers
    names = hf_names(model)
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert names.keys() == {k for k in model.state_dict() if k != "lm_head.weight"}


def step(trainer: FSDPTrainer) -> None:
    samples = [TrainSample(prompt_ids=[5, 6, 7], response_ids=[8, 9, 10, 11], engine_logprobs=[0.0] * 4,
                           advantage=advantage) for advantage in (1.0, -1.0)]
    trainer.forward_backward(samples, first_batch_of_step=True)
    trainer.finish_batch()


def fsdp_trainer(model: torch.nn.Module) -> FSDPTrainer:
    return FSDPTrainer(model=model, cfg=TrainerConfig(backend=TrainerBackend.fsdp), grpo=GRPOConfig(),
                       temperature=1.0, pad_id=0, multi_step=False, process_group_active=False,
                       old_logprobs=OldLogprobSource.trainer)


def test_a_bfloat16_policy_resumes_from_its_float32_master_shards_to_the_same_bits(tmp_path):
    """One rank (a world of its own): a step, the checkpoint's parts (the bfloat16 policy, the shard file), a second
    step; then a fresh trainer from those parts takes the second step to the same bits. Loaded from the bfloat16
    policy alone, the master weights would be rounded and the second step would land elsewhere."""
    vocab = len(build_tiny_tokenizer())
    first = fsdp_trainer(load_model(ModelConfig(dtype=DType.bfloat16), vocab))
    step(first)
    write_shard(tmp_path, rank=0, world_size=1, shards=first.training_shards())
    groups = first.optimizer.state_dict()["param_groups"]
    policy = {k: v.clone() for k, v in first.hf_state().items()}
    step(first)
    expected = first.hf_state()
    first.close()

    model = load_model(ModelConfig(dtype=DType.bfloat16), vocab)
    model.load_state_dict(policy, strict=False)  # what load_model reads from the checkpoint's model.safetensors
    resumed = fsdp_trainer(model)
    try:
        with ShardedState(tmp_path) as state:
            resumed.load_training_shards(state, groups)
        step(resumed)
        again = resumed.hf_state()
    finally:
        resumed.close()
    assert next(iter(again.values())).dtype == torch.bfloat16
    assert all(torch.equal(again[k], v) for k, v in expected.items())
