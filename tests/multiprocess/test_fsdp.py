"""trainer.backend=fsdp as whole jobs: the sharded update equals the replicated backend's and the synchronous one.

Four runs of one float64 workload, shared by the tests (about 2 minutes on 2 cores): FSDP sync on 1 rank, FSDP cgp on
2 and on 4 ranks, and the replicated torch backend in cgp on 2 ranks. Every run trains the same samples (seeded by
their ids) in the same training batches; what differs is the arrival order (cgp's reward delays), the rank split,
the micro-batches, the sharding, and the order of the reductions. So float64 results agree to rounding (1e-9), while
a real difference in the update (another normaliser, another sample) moves them by ~lr = 1e-3.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rolloutpipe.control.checkpoint import ShardedState
from rolloutpipe.model import DType, ModelConfig, build_tiny_tokenizer, load_model
from rolloutpipe.observe.metrics import read_spans
from tests.conftest import SMALL, read_metrics, read_samples, run_job
from tests.helpers.parity import hold_first_group, publish_order

pytestmark = pytest.mark.multiprocess

WORKLOAD = [*SMALL, "model.dtype=float64", "rollout_batch_size=6", "global_batch_size=12", "micro_batch_size=3",
            "grpo.kl_loss_coef=0.1", "pipeline.weight_sync_bucket_mb=0.05",
            "reward.name=letter_fraction_jittered", "reward.import_modules=[tests.fixtures.dense_rewards]",
            "run.save_samples=true", "rollout.concurrency=6", "rollout.num_engines=2", "reward.num_workers=8",
            "trainer.max_grad_norm=1e9", "rollout_max_response_len=8"]
"""Two training batches of three groups of 4 a step, micro-batches of 3: on 2 ranks, rank 0 trains two groups of a
batch (3 micro-batches) and rank 1 one (2); on 4 ranks, ranks 0-2 one group (2) and rank 3 none. So FSDP's lockstep
pads, the second batch clips against policy k's shards (swapped in), and KL takes the reference's shards. Two
engines and jittered rewards make cgp's arrival order differ from sync's, and by construction: the cgp runs' rewards
hold back the group the sync run published first (tests/helpers/parity.py ``hold_first_group``). Buckets of 50 KB:
FSDP gathers the 0.6 MB policy in about a dozen of them, for the engines' file (step 1's samples come from it) and
the final policy."""
RUNS = {"fsdp-sync-1": ("fsdp", "sync", 1, "1"), "fsdp-cgp-2": ("fsdp", "cgp", 2, "5"),
        "fsdp-cgp-4": ("fsdp", "cgp", 4, "5"), "torch-cgp-2": ("torch", "cgp", 2, "5")}
"""name: backend, pipeline.mode, trainer.num_ranks, the reward jitter seed. fsdp-cgp-4 stops after step 0 and its
checkpoint, and resumes on 1 rank for step 1 (RESUMED_ON)."""
EXTRA = {"fsdp-cgp-2": ["rollout.engine=embedded_http", "pipeline.weight_sync=distributed"]}
"""fsdp-cgp-2 broadcasts the policy to the engines' servers, each bucket as it is gathered."""
RESUMED_ON = {"fsdp-cgp-4": 1}


class Runs:
    """The runs of RUNS, each made the first time a test asks for it (``-k`` runs only what its tests need)."""

    def __init__(self, base) -> None:
        self.base = base
        self.done: dict[str, object] = {}

    def __getitem__(self, name: str):
        if name not in self.done:
            backend, mode, num_ranks, jitter = RUNS[name]
            run_dir = self.base / name
            common = [*WORKLOAD, f"trainer.backend={backend}", f"pipeline.mode={mode}", *EXTRA.get(name, [])]
            environ = {"RP_TEST_REWARD_JITTER": jitter}
            if mode == "cgp":  # (the sync run first: its first group is held back here, so the orders differ)
                environ |= hold_first_group(self["fsdp-sync-1"], self.base / f"{name}-held")[1]
                common.append("reward.timeout_s=60")
            if name in RESUMED_ON:
                first = run_job(run_dir, *common, f"trainer.num_ranks={num_ranks}", "num_rollout=1",
                                "run.checkpoint_every=1", environ=environ)
                assert first.returncode == 0, f"{name}: {first.stderr[-3000:]}"
                num_ranks = RESUMED_ON[name]
                common.append("run.resume=auto")
            result = run_job(run_dir, *common, f"trainer.num_ranks={num_ranks}", environ=environ)
            assert result.returncode == 0, f"{name}: {result.stderr[-3000:]}"
            self.done[name] = run_dir
        return self.done[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("fsdp"))


def final_weights(run_dir):
    return load_file(str(run_dir / "checkpoints" / "final" / "model.safetensors"))


def assert_same_update(runs, reference: str, other: str) -> None:
    """Step 0 (common weights, common samples) first, then the samples step 1 drew from the updated weights."""
    ref_m, m = read_metrics(runs[reference]), read_metrics(runs[other])
    assert len(m) == len(ref_m) == 2
    for step, (r, o) in enumerate(zip(ref_m, m)):
        for key in ("train/num_tokens", "train/loss", "train/grad_norm", "train/entropy"):
            assert o[key] == pytest.approx(r[key], rel=1e-9, abs=1e-12), f"{other}: step {step}'s {key}"
    ref_samples, samples = read_samples(runs[reference]), read_samples(runs[other])
    assert len(ref_samples) == 2 * 6 * 4
    assert [(s["id"], s["batch"], s["response_ids"]) for s in ref_samples] == [
        (s["id"], s["batch"], s["response_ids"]) for s in samples], f"{other}: other samples than {reference}"
    ref_w, w = final_weights(runs[reference]), final_weights(runs[other])
    assert ref_w.keys() == w.keys()
    difference = max((ref_w[k] - w[k]).abs().max().item() for k in ref_w)
    assert difference < 1e-9, f"{reference} and {other} weights differ by {difference}"


def test_sharded_update_equals_the_replicated_backends(runs):
    """``launch.py trainer.backend=fsdp trainer.num_ranks=2`` ends with the torch backend's weights (float64)."""
    assert_same_update(runs, "torch-cgp-2", "fsdp-cgp-2")
    init = load_model(ModelConfig(dtype=DType.float64), len(build_tiny_tokenizer())).state_dict()
    final = final_weights(runs["fsdp-cgp-2"])
    assert max((final[k] - init[k]).abs().max().item() for k in final) > 1e-5, "training must change the weights"


@pytest.mark.parametrize("cgp_run", ["fsdp-cgp-2", "fsdp-cgp-4"])
def test_sharded_pipelined_update_equals_synchronous_update(runs, cgp_run):
    """FSDP cgp on 2 and 4 ranks against FSDP sync on 1: another arrival order, rank split and sharding."""
    publish = [publish_order(runs[r]) for r in ("fsdp-sync-1", cgp_run)]
    assert publish[0] != publish[1], "the groups must arrive in other orders"
    assert_same_update(runs, "fsdp-sync-1", cgp_run)


def test_lockstep_pads_the_ranks_with_fewer_micro_batches(runs):
    """Ranks train 3 and 2 micro-batches a batch (2 ranks), or 2 and none (4 ranks); the jobs ending with the
    synchronous update (above) is what says the padding passes matched FSDP's collectives and added nothing."""
    for run, expected in (("fsdp-cgp-2", {0: 6, 1: 4}), ("fsdp-cgp-4", {0: 4, 1: 4, 2: 4})):
        per_rank: dict[int, int] = {}
        for span in read_spans(runs[run]):
            if span.name == "train/forward_backward" and span.step == 0:
                per_rank[span.rank] = per_rank.get(span.rank, 0) + 1
        assert per_rank == expected, (run, per_rank)


def test_each_rank_checkpoints_its_shards_and_a_resume_onto_another_rank_count_reads_them(runs):
    """fsdp-cgp-4's step-0 checkpoint: four files of rows, no whole optimizer state; the resume on 1 rank read them
    back (its update equals the synchronous one: test_sharded_pipelined_update_equals_synchronous_update)."""
    checkpoint = runs["fsdp-cgp-4"] / "checkpoints" / "step=0"
    assert sorted(p.name for p in (checkpoint / "optimizer").iterdir()) == [
        f"rank-{r}-of-4.safetensors" for r in range(4)]
    assert not (checkpoint / "optimizer.safetensors").exists()
    assert not list(checkpoint.parent.glob("*.shards-*")), "every shard directory was moved into its checkpoint"
    with ShardedState(checkpoint / "optimizer") as state:
        weights = load_file(str(checkpoint / "model.safetensors"))
        embedding = state.rows("0.param")  # float64 master weights: the HF weights themselves
        assert torch.equal(embedding, weights["model.embed_tokens.weight"])
        assert state.rows("0.exp_avg_sq").abs().sum() > 0 and state.whole("0.step")

