"""What the parity tests share: overrides that make any order give the same bits, and per-step weight digests."""

from __future__ import annotations

import torch

from rolloutpipe.control.weights.digest import file_weights_digest, short
from tests.conftest import read_metrics

EXACT = ["trainer.exact_accumulation=true", "rollout.batch_invariant=true"]
"""The same bits in any order: the trainer sums gradients as integers (trainer/exact_sum.py) and the engine's rows do
not depend on their batch-mates (rollout/engines/row_attention.py)."""


def weights_digests(run_dir) -> list[str]:
    """Each step's train/weights_digest: a new one every step, the last one the final checkpoint's (its file is written
    by save_pretrained, apart from weight sync, in another header order)."""
    digests = [m["train/weights_digest"] for m in read_metrics(run_dir)]
    assert digests[-1] == short(file_weights_digest(run_dir / "checkpoints" / "final" / "model.safetensors"))
    assert len(set(digests)) == len(digests), digests
    return digests


def assert_digests_tell_identical_from_different(runs: dict, final: dict) -> None:
    """Two runs' digests agree at the last step exactly when their final weights are bit-identical, and then at every
    step (a digest names the bits, whatever made them: mode, rank split, weight-sync way)."""
    (a, b), (wa, wb) = runs.values(), final.values()
    identical = wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    da, db = weights_digests(a), weights_digests(b)
    assert (da[-1] == db[-1]) == identical, (identical, da, db)
    if identical:
        assert da == db
