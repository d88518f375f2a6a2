"""trainer.pack_sequences: a micro-batch's sequences as one row without padding give the padded micro-batch's
log-probs, entropy, loss and update (float64: to rounding), and no token attends across a sequence boundary."""

from __future__ import annotations

import copy

import pytest
import torch

from rolloutpipe.model import DType, ModelConfig, build_tiny_tokenizer, load_model
from rolloutpipe.trainer.backend import trainer_class
from rolloutpipe.trainer.config import GRPOConfig, OldLogprobSource, TrainerBackend, TrainerConfig
from rolloutpipe.trainer.grpo_trainer import TrainSample, pack
from rolloutpipe.trainer.packing import packed_row
from rolloutpipe.trainer.torch_backend import logprob_head
from tests.helpers.trainer import use_float64_hf_norm


def samples() -> list[TrainSample]:
    """Rows of unequal lengths, one without a response token (nothing of it is trained)."""
    g = torch.Generator().manual_seed(0)
    shapes = [(5, 9), (3, 2), (7, 0), (4, 13), (6, 1)]  # (prompt, response) tokens
    return [TrainSample(prompt_ids=torch.randint(5, 40, (p,), generator=g).tolist(),
                        response_ids=torch.randint(5, 40, (r,), generator=g).tolist(),
                        engine_logprobs=[0.0] * r, advantage=float(torch.randn((), generator=g)))
            for p, r in shapes]


def test_the_packed_row_holds_each_sequence_once_with_its_own_positions():
    batch = samples()
    input_ids, _, mask = pack(batch, pad_id=0)
    row = packed_row(input_ids, mask)
    kept = [s for s in batch if s.response_ids]
    assert row.input_ids[0].tolist() == [t for s in kept for t in s.prompt_ids + s.response_ids]
    assert row.position_ids[0].tolist() == [i for s in kept for i in range(len(s.prompt_ids) + len(s.response_ids))]
    assert row.bounds[-1] == row.input_ids.shape[1] and len(row.bounds) == len(kept) + 1
    # every response token is predicted from the position before it, and nothing across a boundary
    predicted = row.input_ids[0, 1:][row.response[0]].tolist()
    assert predicted == [t for s in kept for t in s.response_ids] == input_ids[:, 1:][mask > 0].tolist()


def trainer(model, *, backend: TrainerBackend, packed: bool):
    """The torch backend, or FSDP on a world of one rank of its own (``close`` ends it)."""
    return trainer_class(backend)(
        model=copy.deepcopy(model), cfg=TrainerConfig(backend=backend, lr=1e-2, pack_sequences=packed),
        grpo=GRPOConfig(entropy_coef=0.01), temperature=0.8, pad_id=0, multi_step=False, process_group_active=False,
        old_logprobs=OldLogprobSource.trainer)


@pytest.mark.parametrize("backend", [TrainerBackend.torch, TrainerBackend.fsdp])
def test_a_packed_micro_batch_makes_the_padded_one_s_log_probs_and_update(monkeypatch, backend):
    use_float64_hf_norm(monkeypatch)
    model = load_model(ModelConfig(dtype=DType.float64), len(build_tiny_tokenizer()))
    out = {}
    for packed in (False, True):
        policy = trainer(model, backend=backend, packed=packed)
        try:
            assert policy._head.packed is packed
            input_ids, targets, mask = pack(samples(), pad_id=0)
            logp, entropy = policy._logprobs(input_ids, targets, mask)
            sums = policy.forward_backward(samples(), first_batch_of_step=True)
            result = policy.finish_batch()
            out[packed] = (logp.detach(), entropy.detach(), float(sums.loss.detach()), result.grad_norm,
                           {k: v.detach().clone() for k, v in policy.hf_state().items()})
        finally:
            policy.close()
    (logp, entropy, loss, norm, weights), (p_logp, p_entropy, p_loss, p_norm, p_weights) = out[False], out[True]
    torch.testing.assert_close(p_logp, logp, rtol=0, atol=1e-12)
    torch.testing.assert_close(p_entropy, entropy, rtol=0, atol=1e-12)
    assert (p_loss, p_norm) == pytest.approx((loss, norm), rel=1e-12)
    for k, v in weights.items():
        torch.testing.assert_close(p_weights[k], v, rtol=0, atol=1e-12)


def test_packing_is_the_gpu_default_and_needs_the_chunked_log_probs():
    model = load_model(ModelConfig(), len(build_tiny_tokenizer()))
    assert logprob_head(model, TrainerConfig(), 1.0, cuda=True).packed
    assert not logprob_head(copy.deepcopy(model), TrainerConfig(), 1.0, cuda=False).packed
    assert logprob_head(model, TrainerConfig(logprob_chunk_tokens=0), 1.0, cuda=True) is None
    with pytest.raises(ValueError, match="trainer.pack_sequences=true.*logprob_chunk_tokens > 0"):
        logprob_head(model, TrainerConfig(logprob_chunk_tokens=0, pack_sequences=True), 1.0, cuda=False)
