"""The restore point (trainer/restore.py): a copy of the last finished step that any stop can write, whatever the live
model has done since, with buffers reused from step to step. Pure: one process, no store."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from rolloutpipe.control.checkpoint import latest_checkpoint
from rolloutpipe.model import ModelConfig, build_tiny_tokenizer, load_model
from rolloutpipe.trainer.config import GRPOConfig, OldLogprobSource, TrainerConfig
from rolloutpipe.trainer.grpo_trainer import TrainSample
from rolloutpipe.trainer.restore import RestorePoint
from rolloutpipe.trainer.torch_backend import PolicyTrainer


def trained_one_step() -> PolicyTrainer:
    tokenizer = build_tiny_tokenizer()
    trainer = PolicyTrainer(model=load_model(ModelConfig(), len(tokenizer)), cfg=TrainerConfig(), grpo=GRPOConfig(),
                            temperature=1.0, pad_id=0, multi_step=False, process_group_active=False,
                            old_logprobs=OldLogprobSource.trainer)
    step(trainer)
    return trainer


def step(trainer: PolicyTrainer) -> None:
    samples = [TrainSample(prompt_ids=[5, 6, 7], response_ids=[8, 9, 10, 11], engine_logprobs=[0.0] * 4,
                           advantage=advantage) for advantage in (1.0, -1.0)]
    trainer.forward_backward(samples, first_batch_of_step=True)
    trainer.finish_batch()


def test_the_copy_is_the_finished_steps_state_whatever_the_model_does_next(tmp_path):
    trainer = trained_one_step()
    point = RestorePoint(run_dir=tmp_path, tokenizer=build_tiny_tokenizer(), config_yaml="", keep_last=2, on_disk=-1)
    point.capture(0, model=trainer.model, optimizer=trainer.optimizer, source_state={"cursor": 4})
    expected = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    moments = {i: {k: v.clone() for k, v in s.items()} for i, s in trainer.optimizer.state_dict()["state"].items()}
    step(trainer)  # the next step's optimizer step moves the live weights and moments
    assert any(not torch.equal(expected[k], v) for k, v in trainer.model.state_dict().items())

    assert point.write() == 0 and point.write() is None, "written once"
    checkpoint = latest_checkpoint(tmp_path)
    assert checkpoint.step == 0 and checkpoint.source_state == {"cursor": 4}
    weights = load_file(str(checkpoint.weights_path))
    assert weights.keys() <= expected.keys() and all(torch.equal(weights[k], expected[k]) for k in weights)
    saved = load_file(str(checkpoint.directory / "optimizer.safetensors"))
    assert all(torch.equal(saved[f"{i}.{k}"], v) for i, s in moments.items() for k, v in s.items())


def test_each_capture_reuses_the_buffers_and_keeps_tied_weights_tied(tmp_path):
    trainer = trained_one_step()
    point = RestorePoint(run_dir=tmp_path, tokenizer=build_tiny_tokenizer(), config_yaml="", keep_last=2, on_disk=-1)
    point.capture(0, model=trainer.model, optimizer=trainer.optimizer, source_state={})
    buffers = {k: v.data_ptr() for k, v in point._model_state.items()}  # noqa: SLF001
    point.write()  # (save_pretrained empties the dict it is given: it gets a copy)
    step(trainer)
    point.capture(1, model=trainer.model, optimizer=trainer.optimizer, source_state={})
    state = point._model_state  # noqa: SLF001
    assert {k: v.data_ptr() for k, v in state.items()} == buffers
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    assert all(torch.equal(state[k], v) for k, v in trainer.model.state_dict().items())
