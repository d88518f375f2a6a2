"""Draft verification in the embedded engine (rollout.speculative): a draft changes how many tokens a forward pass
yields, never which. Every result with a draft must equal the result without one."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from rolloutpipe.model import DType
from rolloutpipe.rollout.drafts import Drafts
from rolloutpipe.rollout.engines.embedded import EmbeddedEngine
from tests.fakes import FakeEngine
from tests.helpers.embedded import Results, request, run_all, tiny_model


def perturbed(model: torch.nn.Module, scale: float, seed: int = 7) -> torch.nn.Module:
    """Another policy near ``model``: every parameter moved by scale x its own std of noise."""
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale * p.std())
    return other


def requests(n: int = 12):
    """Requests of several prompt lengths and budgets; ignore_eos is not used, so drafts end on stop tokens too."""
    return [request(i, prompt_len=3 + i % 5, max_new_tokens=8 + 3 * (i % 4), stop_token_ids=[1]) for i in range(n)]


@pytest.mark.parametrize(("batch_invariant", "dtype"), [
    (True, DType.float64), (True, DType.float32), (True, DType.bfloat16), (False, DType.float64)],
    ids=["batch-invariant-float64", "batch-invariant-float32", "batch-invariant-bfloat16", "padded-float64"])
@pytest.mark.parametrize("drafter", ["near", "unrelated", "own-output-edited"])
def test_a_draft_from_another_policy_yields_exactly_the_result_made_without_it(batch_invariant, dtype, drafter):
    """Batch invariant (what rollout.speculative runs), every dtype: the same bits. Padded (which the config refuses
    with speculation): float64, equal to rounding."""
    model = tiny_model(dtype)
    plain = run_all(model, requests(), concurrency=4, batch_invariant=batch_invariant)
    if drafter == "own-output-edited":  # the policy's own outputs, each with one token changed: kept up to it
        drafts = {rid: r.output_ids[: len(r.output_ids) // 2] + [(r.output_ids[len(r.output_ids) // 2] + 1) % 50]
                  + r.output_ids[len(r.output_ids) // 2 + 1:] for rid, r in plain.items()}
    else:  # a policy one small update away, or another initialisation
        other = perturbed(model, 0.02) if drafter == "near" else tiny_model(dtype, init_seed=1)
        drafted = run_all(other, requests(), concurrency=4, batch_invariant=batch_invariant)
        drafts = {rid: r.output_ids for rid, r in drafted.items()}
    # some requests without a draft, some with a partial one (an aborted draft), among each other
    offered = [replace(r, draft_ids=drafts[r.request_id][: (len(drafts[r.request_id]) if i % 3 else i % 5)])
               for i, r in enumerate(requests())]
    verified = run_all(model, offered, concurrency=4, batch_invariant=batch_invariant)
    kept = 0
    for r in offered:
        got, want = verified[r.request_id], plain[r.request_id]
        assert got.output_ids == want.output_ids, r.request_id
        assert got.finish_reason is want.finish_reason
        if batch_invariant:  # the same computation row by row: the same bits
            assert got.output_logprobs == want.output_logprobs
        else:
            assert got.output_logprobs == pytest.approx(want.output_logprobs, abs=1e-12, rel=0)
        agree = next((j for j, (a, b) in enumerate(zip(r.draft_ids, want.output_ids)) if a != b),
                     min(len(r.draft_ids), len(want.output_ids)))
        assert got.num_draft_kept == agree
        kept += agree
    drafted_tokens = sum(len(r.draft_ids) for r in offered)
    if drafter == "near":  # mostly kept (the noise is keyed by token id: sampler.py)
        assert kept > 0.5 * drafted_tokens
    else:  # some kept, some rejected: both paths ran
        assert 0 < kept < drafted_tokens


@pytest.mark.parametrize("dtype", [DType.float64, DType.float32, DType.bfloat16], ids=lambda d: d.value)
def test_requests_verifying_their_own_outputs_keep_every_token_with_the_bits_of_decoding(dtype):
    """1,024 requests x 48 tokens, each offered its own output as its draft (a draft under an unchanged policy): every
    draft token is kept, and every token and log-prob is the bits of the run without drafts, in each dtype: a draft's
    positions attend as the decode steps that feed them do (verify.py). Prompts of 3 to 13 tokens, top_p 1 and 0.9,
    temperatures 1 and 0.7."""
    model = tiny_model(dtype)
    wanted = [request(i, prompt_len=3 + i % 11, max_new_tokens=48, top_p=0.9 if i % 2 else 1.0,
                      temperature=0.7 if i % 3 == 0 else 1.0) for i in range(1024)]
    plain = run_all(model, wanted, concurrency=64, ignore_eos=True, timeout_s=600)  # (~10-20 s each, idle)
    offered = [replace(r, draft_ids=plain[r.request_id].output_ids) for r in wanted]
    verified = run_all(model, offered, concurrency=64, ignore_eos=True, timeout_s=600)
    other_tokens = [r.request_id for r in wanted if verified[r.request_id].output_ids != plain[r.request_id].output_ids]
    other_logprobs = [r.request_id for r in wanted
                      if verified[r.request_id].output_logprobs != plain[r.request_id].output_logprobs]
    assert (len(other_tokens), len(other_logprobs)) == (0, 0), (other_tokens[:5], other_logprobs[:5])
    assert all(verified[r.request_id].num_draft_kept == 48 for r in wanted)


def test_a_draft_longer_than_the_budget_is_refused_before_it_runs():
    results = Results()
    engine = EmbeddedEngine(name="t", model=tiny_model(DType.float64), concurrency=2, on_result=results)
    try:
        with pytest.raises(ValueError, match="3 draft_ids, more than max_new_tokens=2"):
            engine.submit(request(0, max_new_tokens=2, draft_ids=[5, 6, 7]))
    finally:
        engine.shutdown()


def test_a_draft_rides_only_with_the_request_it_was_made_for_and_stops_before_new_weights():
    engines = [FakeEngine("e0", running_ids=True), FakeEngine("e1", running_ids=True)]
    drafts = Drafts(engines)
    for engine in engines:
        engine.on_result = drafts.on_result
    wanted = [request(i, sampling_seed=10 + i) for i in range(4)]
    drafts.start(wanted)
    assert [r.request_id for e in engines for r in e.submitted] == [
        "draft/" + wanted[i].request_id for i in (0, 2, 1, 3)]  # round robin, behind every other request
    assert all(r.priority > 1000 and r.sampling_seed == w.sampling_seed for r, w in zip(engines[0].submitted,
                                                                                        wanted[::2]))
    for i in (0, 1, 2):
        engines[i % 2].finish("draft/" + wanted[i].request_id)  # its output: the seed (fakes.FakeEngine)
    engines[1].error = RuntimeError("gone")  # draft 3 never comes back: stop does not wait for it
    drafts.stop(lambda what: None)
    assert engines[0].aborted == [] and engines[1].aborted == ["draft/" + wanted[3].request_id]
    assert drafts.attach(wanted[0]).draft_ids == [10]
    assert drafts.attach(wanted[0]).draft_ids == []  # used once
    assert drafts.attach(replace(wanted[1], input_ids=[9, 9])).draft_ids == []  # another prompt: not its draft
    assert drafts.attach(replace(wanted[2], max_new_tokens=1)).draft_ids == [12]
    assert drafts.attach(wanted[3]).draft_ids == []
    assert drafts.take_counts() == (2, 0)


def test_speculation_is_refused_at_start_where_it_cannot_run():
    from rolloutpipe.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"needs rollout.engine=embedded \(not sglang\).*docs/speculative.md"):
        load_config({"rollout": {"speculative": True, "engine": "sglang"}})
    with pytest.raises(ConfigError, match="no tail to draft in"):
        load_config({"rollout": {"speculative": True}, "pipeline": {"mode": "async_one_step"}})
    with pytest.raises(ConfigError, match=r"rollout.batch_invariant=false: in bfloat16 .*docs/speculative.md"):
        load_config({"rollout": {"speculative": True, "batch_invariant": False}, "model": {"dtype": "bfloat16"}})
    cfg = load_config({"rollout": {"speculative": True}})
    assert cfg.rollout.speculative and cfg.rollout.batch_invariant  # (null: on with speculation, else off)
    assert load_config({}).rollout.batch_invariant is False
