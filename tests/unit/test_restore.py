"""The restore point (trainer/restore.py): a copy of the last finished step that any stop can write, whatever the live
model has done since, with buffers reused from step to step. Pure: one process, no store."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from rolloutpipe.control.checkpoint import Shard, ShardedState, latest_checkpoint, load_optimizer, write_shard
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


def rows_of(tensor: torch.Tensor, rank: int, world_size: int) -> Shard:
    """FSDP2's Shard(0) split: torch.chunk's, a rank past the last chunk holding none."""
    chunk = -(-tensor.shape[0] // world_size)
    offset = min(rank * chunk, tensor.shape[0])
    return Shard(tensor[offset:offset + chunk], offset, tensor.shape[0])


def test_a_sharded_state_reads_back_any_rows_whichever_files_hold_them(tmp_path):
    """Written by 4 ranks (rows 3, 3, 3, 1 of 10), read as 3 ranks need them (4, 4, 2) and whole."""
    full = torch.arange(30, dtype=torch.float64).reshape(10, 3)
    for rank in range(4):
        write_shard(tmp_path, rank=rank, world_size=4, shards={"0.exp_avg": rows_of(full, rank, 4),
                                                               "0.step": Shard(torch.tensor(7.0))})
    with ShardedState(tmp_path) as state:
        assert torch.equal(state.rows("0.exp_avg"), full)
        for rank in range(3):
            wanted = rows_of(full, rank, 3)
            got = state.rows("0.exp_avg", wanted.offset, wanted.offset + wanted.tensor.shape[0])
            assert torch.equal(got, wanted.tensor)
        assert state.whole("0.step") and state.rows("0.step").item() == 7.0
    (tmp_path / "rank-2-of-4.safetensors").unlink()
    with pytest.raises(ValueError, match="rank-<r>-of-<N>"):
        ShardedState(tmp_path)


def test_a_tensor_some_ranks_hold_nothing_of_is_read_from_the_ranks_that_do(tmp_path):
    """Megatron's distributed optimizer: a rank's range of the flattened buffer may miss a parameter entirely, and
    its file then names nothing of it (rank 0 here holds none of "1.exp_avg")."""
    first, second = torch.arange(6.0), torch.arange(4.0) + 10
    write_shard(tmp_path, rank=0, world_size=2, shards={"0.exp_avg": Shard(first[:5], 0, 6)})
    write_shard(tmp_path, rank=1, world_size=2, shards={"0.exp_avg": Shard(first[5:], 5, 6),
                                                        "1.exp_avg": Shard(second, 0, 4)})
    with ShardedState(tmp_path) as state:
        assert state.names() == ["0.exp_avg", "1.exp_avg"] and not state.whole("1.exp_avg")
        assert torch.equal(state.rows("0.exp_avg"), first) and torch.equal(state.rows("1.exp_avg", 1, 3), second[1:3])


def test_rank_0_completes_a_sharded_checkpoint_once_every_rank_wrote_its_file(tmp_path):
    trainer = trained_one_step()
    state = trainer.optimizer.state_dict()
    points = [RestorePoint(run_dir=tmp_path, tokenizer=build_tiny_tokenizer(), config_yaml="", keep_last=2,
                           on_disk=-1, rank=rank, world_size=2, attempt=3) for rank in range(2)]
    for rank, point in enumerate(points):
        point.capture_shards(0, {f"{i}.{name}": rows_of(v, rank, 2) if v.dim() else Shard(v)
                                 for i, moments in state["state"].items() for name, v in moments.items()})
    groups_only = SimpleNamespace(state_dict=lambda: {"state": {}, "param_groups": state["param_groups"]})
    points[0].capture(0, model=trainer.model, optimizer=groups_only, source_state={"cursor": 4})
    assert points[0].write(wait_s=0.2) is None, "rank 1's file is missing"
    assert latest_checkpoint(tmp_path) is None
    assert points[1].write() is None  # rank 1 writes its file only
    assert points[0].write() == 0
    checkpoint = latest_checkpoint(tmp_path)
    assert checkpoint.sharded and not (checkpoint.directory / "optimizer.safetensors").exists()
    assert not list(tmp_path.glob("checkpoints/*.shards-*"))
    resumed = trained_one_step()  # an unsharded backend resumes from it: the rows assembled
    load_optimizer(resumed.optimizer, checkpoint)
    loaded = resumed.optimizer.state_dict()["state"]
    assert all(torch.equal(loaded[i][k], v) for i, s in state["state"].items() for k, v in s.items())


def test_a_stopping_rank_0_gives_up_on_a_missing_shard_within_the_stop_grace(tmp_path, monkeypatch):
    """Trainer rank 0 stopping (trainer/node.py ``stop``) while rank 1's shard never comes (it died, or is stuck):
    rank 0 leaves the step unwritten and still writes the outcome, having waited for the file at most half of
    launcher.stop_grace_s (the launcher SIGKILLs at the end of it). The wait runs on a fake clock: no test sleeps."""
    from rolloutpipe.config import load_config
    from rolloutpipe.control import checkpoint
    from rolloutpipe.trainer.node import TrainerNode

    clock = [0.0]
    monkeypatch.setattr(checkpoint.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(checkpoint.time, "sleep", lambda seconds: clock.__setitem__(0, clock[0] + seconds))
    trainer = trained_one_step()
    point = RestorePoint(run_dir=tmp_path, tokenizer=build_tiny_tokenizer(), config_yaml="", keep_last=2,
                         on_disk=-1, rank=0, world_size=2)
    point.capture_shards(0, {"0.exp_avg": Shard(torch.zeros(3), 0, 6)})
    groups_only = SimpleNamespace(state_dict=lambda: {"state": {}, "param_groups": []})
    point.capture(0, model=trainer.model, optimizer=groups_only, source_state={})
    outcomes = []
    node = NodeParts(cfg=load_config({"num_rollout": 3, "launcher": {"stop_grace_s": 8.0}}), last_step=0,
                     is_writer=True, sharded=True, restore=point, env=SimpleNamespace(rank=0), _finished=False,
                     _write_outcome=lambda **outcome: outcomes.append(outcome))
    node.write_checkpoint = lambda **kwargs: TrainerNode.write_checkpoint(node, **kwargs)
    TrainerNode.stop(node, RuntimeError("a peer failed"))
    assert latest_checkpoint(tmp_path) is None and len(outcomes) == 1  # step 0 is not complete without rank 1
    assert 0 < clock[0] <= 8.0 / 2 + 0.1, f"rank 0 waited {clock[0]}s for a missing shard, with 8s of grace"  # (a poll)


class NodeParts(SimpleNamespace):
    """The parts of a TrainerNode that ``stop`` reads; any other reads as None (unset)."""

    def __getattr__(self, name: str) -> None:
        return None
