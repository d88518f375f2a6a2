"""The embedded engine against its contract: batch-invariant samples, exact log-probs, scheduling, weights."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rolloutpipe.model import DType
from rolloutpipe.rollout.engines.embedded import EmbeddedEngine
from rolloutpipe.rollout.engines.sampler import sample_tokens
from rolloutpipe.types import FinishReason, GenerationResult
from tests.helpers.embedded import Results, request, run_all, tiny_model

EOS = 1


def run_among_batch_mates(model, target, *, batch_invariant: bool = True) -> list[GenerationResult]:
    """``target`` among 15 batch-mates with other seeds, prompt lengths and lengths, submitted 8th and then 1st:
    concurrency 4 makes it wait for a slot (8th) and join a batch already decoding, with rows of other widths
    joining and leaving around it, or start in row 0 of the first prefill (1st)."""
    mates = [
        request(i, prompt_len=2 + i % 11, max_new_tokens=5 + 3 * i, temperature=0.5 + 0.1 * i)
        for i in range(16)
        if i != 7
    ]
    eighth = run_all(model, mates[:7] + [target] + mates[7:], concurrency=4, ignore_eos=True,
                     batch_invariant=batch_invariant)
    assert eighth[target.request_id].started_s > min(r.started_s for r in eighth.values())
    first = run_all(model, [target] + mates[::-1], concurrency=4, ignore_eos=True, batch_invariant=batch_invariant)
    return [eighth[target.request_id], first[target.request_id]]


@pytest.mark.parametrize("dtype", [DType.float32, DType.bfloat16, DType.float64])
def test_request_is_bit_identical_alone_and_among_any_batch_mates(dtype):
    """Batch invariance: the target's tokens and every log-prob are the same bits alone (one row, no padding), among
    batch-mates of other lengths and in another row, so sync and cgp sample the same in every dtype."""
    model = tiny_model(dtype)
    target = request(7, prompt_len=9, max_new_tokens=40, top_p=0.9)
    alone = run_all(model, [target], concurrency=1, ignore_eos=True)[target.request_id]
    for among in run_among_batch_mates(model, target):
        assert among.output_ids == alone.output_ids
        assert among.output_logprobs == alone.output_logprobs  # exact: not approx


@pytest.mark.parametrize("dtype", [DType.float32, DType.float64])
def test_request_is_bit_identical_alone_and_in_batches_of_any_size(dtype):
    """Decode batches of 1 to 16 rows and prefills of several joiners: the BLAS takes other kernels by the number of
    rows (on an AMD EPYC a float32 row of 4 differed from the same row of 8), so every row must be computed in the
    same call shape whatever the batch (row_attention.py)."""
    model = tiny_model(dtype)
    target = request(0, prompt_len=5, max_new_tokens=30)
    alone = run_all(model, [target], concurrency=1, ignore_eos=True)[target.request_id]
    mates = [request(i, prompt_len=2 + i % 13, max_new_tokens=3 + 2 * i) for i in range(1, 24)]
    for order in ([target] + mates, mates[:9] + [target] + mates[9:]):
        among = run_all(model, order, concurrency=16, ignore_eos=True)[target.request_id]
        assert among.output_ids == alone.output_ids
        assert among.output_logprobs == alone.output_logprobs  # exact: not approx


def test_without_batch_invariance_tokens_agree_up_to_rounding():
    """``batch_invariant=False`` (one padded attention call per layer) differs from the invariant engine only at
    rounding level."""
    model = tiny_model()
    target = request(7, prompt_len=9, max_new_tokens=40, top_p=0.9)
    alone = run_all(model, [target], concurrency=1, ignore_eos=True)[target.request_id]
    for among in run_among_batch_mates(model, target, batch_invariant=False):
        assert among.output_ids == alone.output_ids
        assert among.output_logprobs == pytest.approx(alone.output_logprobs, abs=1e-5)


@pytest.mark.parametrize(("dtype", "tolerance"), [(DType.float32, 1e-4), (DType.float64, 1e-9)])
def test_logprobs_match_a_full_forward(dtype, tolerance):
    model = tiny_model(dtype)
    temperatures, top_ps = [1.0, 0.7, 0.0, 1.3], [1.0, 0.8]
    requests = [
        request(i, prompt_len=3 + 2 * i, max_new_tokens=12 + i, temperature=temperatures[i % 4], top_p=top_ps[i % 2])
        for i in range(8)
    ]
    results = run_all(model, requests, concurrency=3, ignore_eos=True)
    with torch.inference_mode():
        for r in requests:
            out = results[r.request_id]
            assert len(out.output_logprobs) == len(out.output_ids) == r.max_new_tokens
            ids = torch.tensor([r.input_ids + out.output_ids])
            logits = model(input_ids=ids).logits[0, len(r.input_ids) - 1 : -1].double()
            logprobs = (logits / (r.temperature or 1.0)).log_softmax(-1)
            expected = logprobs.gather(-1, torch.tensor(out.output_ids)[:, None]).squeeze(-1)
            actual = torch.tensor(out.output_logprobs, dtype=torch.float64)
            torch.testing.assert_close(actual, expected, atol=tolerance, rtol=0)
            if r.temperature == 0:
                assert out.output_ids == logits.argmax(-1).tolist()
            # Every token is the seeded sampler's pick from these logits at SGLang's position: the last token fed.
            n = len(out.output_ids)
            positions = torch.arange(len(r.input_ids) - 1, len(r.input_ids) - 1 + n)
            picked, _ = sample_tokens(logits.to(model.dtype), torch.full((n,), r.temperature, dtype=torch.float64),
                                      torch.full((n,), r.top_p, dtype=torch.float64),
                                      torch.full((n,), r.sampling_seed), positions)
            assert out.output_ids == picked.tolist()


def test_concurrency_limit_is_respected():
    results = run_all(tiny_model(), [request(i, max_new_tokens=4 + 5 * (i % 3)) for i in range(12)], concurrency=3)
    # Sweep start/finish events; at equal times a finish comes first (it happened first in the engine thread).
    events = sorted([(r.started_s, 1) for r in results.values()] + [(r.finished_s, -1) for r in results.values()])
    running, most = 0, 0
    for _, delta in events:
        running += delta
        most = max(most, running)
    assert most == 3


def test_waiting_request_joins_when_a_slot_frees():
    long, short, waiting = request(0, max_new_tokens=120), request(1, max_new_tokens=2), request(2, max_new_tokens=2)
    results = run_all(tiny_model(), [long, short, waiting], concurrency=2, ignore_eos=True)
    assert results[waiting.request_id].finished_s < results[long.request_id].finished_s


def test_waiting_requests_start_by_priority_then_submission_order():
    requests = [request(0, priority=0), request(1, priority=1), request(2, priority=0), request(3, priority=-1)]
    results = Results()
    engine = EmbeddedEngine(name="test", model=tiny_model(), concurrency=1, on_result=results)
    for r in requests:
        engine.submit(r)
    results.wait_for(4)
    engine.shutdown()
    # The first one may start before the others arrive; the rest wait and go by (priority, submission order).
    assert results.order[1:] == [requests[i].request_id for i in (3, 2, 1)] or results.order == [
        requests[i].request_id for i in (3, 0, 2, 1)
    ]


def test_finish_reasons_stop_and_length():
    model = tiny_model()
    greedy = run_all(model, [request(0, max_new_tokens=30, temperature=0.0)], concurrency=1)
    free_run = greedy["step=0/group=0/sample=0"].output_ids
    stop_at = 5
    stop_token = free_run[stop_at]
    first = free_run.index(stop_token)

    stopped = run_all(
        model, [request(0, max_new_tokens=30, temperature=0.0, stop_token_ids=[EOS, stop_token])], concurrency=1
    )["step=0/group=0/sample=0"]
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.output_ids == free_run[: first + 1]
    assert len(stopped.output_logprobs) == len(stopped.output_ids)

    # Sampled requests against a stop set of common tokens: each result is STOP exactly when its last token is the
    # first stop token, else LENGTH at max_new_tokens; both happen.
    stop_set = [EOS] + free_run[:3]
    sampled = run_all(model, [request(i, max_new_tokens=20, stop_token_ids=stop_set) for i in range(16)], concurrency=8)
    for out in sampled.values():
        hits = [i for i, t in enumerate(out.output_ids) if t in stop_set]
        if out.finish_reason is FinishReason.STOP:
            assert hits == [len(out.output_ids) - 1]
        else:
            assert out.finish_reason is FinishReason.LENGTH
            assert hits == [] and len(out.output_ids) == 20
    assert {out.finish_reason for out in sampled.values()} == {FinishReason.STOP, FinishReason.LENGTH}


def test_abort_returns_partial_result():
    model = tiny_model()
    short, long, queued = request(0, max_new_tokens=5), request(1, max_new_tokens=400), request(2)
    full_long = run_all(model, [long], concurrency=1, ignore_eos=True)[long.request_id]

    engine_box = []

    def abort_others_when_short_finishes(result):
        if result.request_id == short.request_id:
            engine_box[0].abort(long.request_id)
            engine_box[0].abort(queued.request_id)
            engine_box[0].abort("step=9/group=9/sample=9")  # unknown: ignored

    results = Results(abort_others_when_short_finishes)
    engine = EmbeddedEngine(name="test", model=model, concurrency=2, on_result=results)
    engine_box.append(engine)
    for r in (short, long, queued):
        engine.submit(r, ignore_eos=True)
    out = results.wait_for(3)
    engine.abort(long.request_id)  # already finished: ignored
    assert engine.num_in_flight() == 0
    engine.shutdown()

    aborted = out[long.request_id]
    assert aborted.finish_reason is FinishReason.ABORT
    assert 5 <= len(aborted.output_ids) < 400
    assert aborted.output_ids == full_long.output_ids[: len(aborted.output_ids)]
    assert len(aborted.output_logprobs) == len(aborted.output_ids)
    assert out[queued.request_id].finish_reason is FinishReason.ABORT
    assert out[queued.request_id].output_ids == []
    assert out[short.request_id].finish_reason is FinishReason.LENGTH


def test_shutdown_aborts_and_reports_every_request():
    results = Results()
    engine = EmbeddedEngine(name="test", model=tiny_model(), concurrency=2, on_result=results)
    requests = [request(i, max_new_tokens=400) for i in range(5)]
    for r in requests:
        engine.submit(r)
    engine.shutdown()
    assert sorted(results.by_id) == sorted(r.request_id for r in requests)
    assert all(r.finish_reason is FinishReason.ABORT for r in results.by_id.values())
    with pytest.raises(RuntimeError, match="shut down"):
        engine.submit(request(9))


def test_update_weights_changes_the_policy_version_and_outputs(tmp_path):
    new_policy = tiny_model(init_seed=1)
    new_policy.save_pretrained(tmp_path)  # tied embeddings: lm_head.weight is not in the file
    probe = request(0, max_new_tokens=24)
    expected = run_all(new_policy, [probe], concurrency=1)[probe.request_id]

    model = tiny_model(init_seed=0)
    results = Results()
    engine = EmbeddedEngine(name="test", model=model, concurrency=2, on_result=results)
    engine.submit(probe)
    before = results.wait_for(1)[probe.request_id]
    engine.update_weights_from_disk(str(tmp_path / "model.safetensors"), policy_version=1)
    assert engine.policy_version == 1
    engine.submit(request(0, max_new_tokens=24, request_id="after"))
    after = results.wait_for(2)["after"]
    engine.shutdown()

    assert before.policy_version == 0 and after.policy_version == 1
    assert after.output_ids == expected.output_ids != before.output_ids
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_update_weights_refused_while_requests_are_in_flight(tmp_path):
    """The engine's thread is held in the first result's callback, so the second request is in flight for sure
    (a long request alone may finish before the update is asked for, on a loaded machine)."""
    model = tiny_model()
    model.save_pretrained(tmp_path)
    in_callback, release = threading.Event(), threading.Event()

    def hold(result: GenerationResult) -> None:
        in_callback.set()
        release.wait(timeout=60)

    engine = EmbeddedEngine(name="test", model=model, concurrency=1, on_result=Results(on_result=hold))
    engine.submit(request(0, max_new_tokens=1))
    engine.submit(request(1, max_new_tokens=1))
    try:
        assert in_callback.wait(timeout=60)
        with pytest.raises(RuntimeError, match="1 requests in flight"):
            engine.update_weights_from_disk(str(tmp_path / "model.safetensors"), policy_version=1)
        assert engine.policy_version == 0
    finally:
        release.set()
        engine.shutdown()


def test_scheduler_crash_is_raised_not_swallowed():
    calls = []

    def broken_consumer(result):
        calls.append(result.request_id)
        raise ValueError("consumer bug")

    engine = EmbeddedEngine(name="e0", model=tiny_model(), concurrency=2, on_result=broken_consumer)
    for i in range(3):
        engine.submit(request(i, max_new_tokens=3))
    deadline = time.monotonic() + 20
    while engine.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert isinstance(engine.error, ValueError)
    with pytest.raises(RuntimeError, match="engine e0 crashed: ValueError"):
        engine.submit(request(5))
    with pytest.raises(RuntimeError, match="engine e0 crashed"):
        engine.num_in_flight()
    engine.shutdown()
    assert len(calls) == 1
