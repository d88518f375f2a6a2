"""Calibrate the simulator's models on this machine: the embedded engine, the PyTorch trainer, a real run.

    engine    EmbeddedEngine (in this process, pinned to one CPU like the rollout node) runs B requests of
              exactly L new tokens (no stop token) after P prompt tokens, for a grid of (B, L, P); the wall
              time of each is linear in the model's coefficients (models.EngineModel), fitted by least squares.
    trainer   PolicyTrainer.forward_backward on micro-batches of B samples padded to L tokens, and
              finish_batch, on one CPU like a trainer rank: fitted to models.TrainerModel.
    overheads from a short real run (launch.py) of the workload: medians of its spans (reward, publish,
              weight sync) and the law of its response lengths.
    in situ   real runs (sync and cgp), simulated: in a real rollout process the engine shares its CPU with the
              reward calls, detokenising and bookkeeping of every finished request, and in cgp the trainer
              computes while the rollout runs on the other core, so both are slower than alone.
              ``fit_in_situ`` fits EngineModel.per_finish_s, a trainer scale and TrainerModel.corun_slowdown
              to them. Only calibration runs are used, never a run the simulator is judged on.

``tools/simulate.py calibrate=true`` runs all three and writes conf/sim/hardware/<name>.yaml.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import numpy as np

from rolloutpipe.sim.models import EngineModel, OverheadModel, TrainerModel

ENGINE_GRID = [(b, length, p) for b in (1, 8, 32, 64) for length in (16, 64) for p in (8, 32)]
TRAINER_GRID = [(b, length) for b in (1, 4, 16) for length in (16, 64, 256)]


def pin_to_one_cpu() -> None:
    import torch

    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)


def calibrate_engine(model_cfg, *, repeats: int = 5) -> EngineModel:
    """Fit EngineModel to the embedded engine's wall time over ENGINE_GRID (the fastest of ``repeats``: on a
    shared machine interference only ever adds time)."""
    import threading

    from rolloutpipe.model import build_tiny_tokenizer, load_model
    from rolloutpipe.rollout.engines.embedded import EmbeddedEngine
    from rolloutpipe.types import GenerationRequest

    vocab = len(build_tiny_tokenizer())
    done = threading.Semaphore(0)
    engine = EmbeddedEngine(name="calibration", model=load_model(model_cfg, vocab), concurrency=1024,
                            on_result=lambda result: done.release())
    rows, times = [], []
    try:
        for b, length, p in ENGINE_GRID:
            samples = []
            for r in range(repeats + 1):  # the first is a warm-up
                start = time.perf_counter()
                for i in range(b):
                    engine.submit(GenerationRequest(request_id=f"{b}/{length}/{p}/{r}/{i}", input_ids=[5] * p,
                                                    max_new_tokens=length, temperature=1.0, sampling_seed=i,
                                                    stop_token_ids=[]))
                for _ in range(b):
                    done.acquire()
                samples.append(time.perf_counter() - start)
            # decode: L iterations with B running and context B*P + B*i at iteration i; prefill: one join of B*P
            rows.append([length, length * b, length * b * p + b * length * (length - 1) / 2, 1.0, b * p])
            times.append(min(samples[1:]))
    finally:
        engine.shutdown()
    a, per_request, per_context, prefill_base, prefill_token = _fit(rows, times)
    return EngineModel(decode_base_s=a, decode_per_request_s=per_request, decode_per_context_token_s=per_context,
                       prefill_base_s=prefill_base, prefill_per_token_s=prefill_token,
                       source=f"sim/calibrate.py on the embedded engine, {time.strftime('%Y-%m-%d')}, "
                              f"fit residual {_residual(rows, times):.1%}")


def calibrate_trainer(cfg, *, repeats: int = 5) -> TrainerModel:
    """Fit TrainerModel to PolicyTrainer's forward/backward over TRAINER_GRID; optimizer step measured apart."""
    from rolloutpipe.model import build_tiny_tokenizer, load_model
    from rolloutpipe.trainer.config import OldLogprobSource
    from rolloutpipe.trainer.grpo_trainer import TrainSample
    from rolloutpipe.trainer.torch_backend import PolicyTrainer

    tokenizer = build_tiny_tokenizer()
    trainer = PolicyTrainer(model=load_model(cfg.model, len(tokenizer)), cfg=cfg.trainer, grpo=cfg.grpo,
                            temperature=cfg.rollout_temperature, pad_id=tokenizer.pad_token_id, multi_step=False,
                            process_group_active=False, old_logprobs=OldLogprobSource.trainer)
    rows, times, optimizer = [], [], []
    for b, length in TRAINER_GRID:
        samples = [TrainSample(prompt_ids=[5] * (length // 2), response_ids=[6] * (length - length // 2),
                               engine_logprobs=[-1.0] * (length - length // 2), advantage=1.0) for _ in range(b)]
        measured = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            trainer.forward_backward(samples, first_batch_of_step=True)
            measured.append(time.perf_counter() - start)
            start = time.perf_counter()
            trainer.finish_batch()
            optimizer.append(time.perf_counter() - start)
        rows.append([1.0, b * length, b * length * length])
        times.append(min(measured[1:]))
    base, per_token, per_token_squared = _fit(rows, times)
    return TrainerModel(micro_batch_base_s=base, per_token_s=per_token, per_token_squared_s=per_token_squared,
                        optimizer_step_s=min(optimizer),
                        source=f"sim/calibrate.py on PolicyTrainer, {time.strftime('%Y-%m-%d')}, "
                               f"fit residual {_residual(rows, times):.1%}")


def overheads_from_run(run_dir: Path) -> OverheadModel:
    """Stage latencies of a real run, medians over its steps after the first (start-up)."""
    import json

    from rolloutpipe.observe.metrics import read_spans

    spans = [s for s in read_spans(run_dir) if s.step > 0]

    def median_of(name: str) -> float:
        durations = [s.end_s - s.start_s for s in spans if s.name == name]
        return statistics.median(durations) if durations else 0.0

    # a trainer rank's time from receiving a handle to its next span: reading the payload, building samples
    trainer = sorted((s for s in spans if s.role == "trainer" and s.rank == 0 and s.name.startswith("train/")),
                     key=lambda s: s.start_s)
    gaps = [b.start_s - a.end_s for a, b in zip(trainer, trainer[1:]) if a.name == "train/wait" and a.step == b.step]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    sync = statistics.median(m["perf/weight_sync_s"] for m in metrics)
    load = statistics.median(m["perf/weight_load_s"] for m in metrics)
    return OverheadModel(reward_s=median_of("rollout/reward"), publish_s=median_of("dispatch/publish"),
                         load_s=statistics.median(gaps) if gaps else 0.0, weight_save_s=max(sync - load, 0.0),
                         weight_load_s=load)


def response_lengths(run_dir: Path) -> list[int]:
    import json

    return [len(json.loads(line)["response_ids"]) for path in sorted((run_dir / "rollouts").glob("*.jsonl"))
            for line in path.read_text().splitlines()]


def _fit(rows: list[list[float]], times: list[float]) -> list[float]:
    """Least squares, weighted by 1/time (relative error), coefficients clipped at 0."""
    x, y = np.asarray(rows, dtype=float), np.asarray(times, dtype=float)
    w = 1.0 / y
    coef, *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
    return [max(float(c), 0.0) for c in coef]


def _residual(rows: list[list[float]], times: list[float]) -> float:
    coef = np.asarray(_fit(rows, times))
    predicted = np.asarray(rows) @ coef
    return float(np.median(np.abs(predicted / np.asarray(times) - 1)))


def fit_in_situ(sim, *, sync_job, sync_records: list[dict], cgp_job, cgp_records: list[dict], num_steps: int = 40):
    """``sim`` with the in-situ parameters fitted to real sync and cgp runs (see module docstring).

    sync run: EngineModel.per_finish_s so that the simulated rollout time equals the run's, and a scale of the
    trainer model so that its compute time does (the trainer runs alone there). cgp run: the trainer's
    corun_slowdown so that its compute time, spent while the rollout generates, does too.
    """
    from dataclasses import replace

    from rolloutpipe.sim.run import simulate

    def median(records: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in records)

    def simulated(job, model, key: str) -> float:
        return median(simulate(job, model, num_steps).records[1:], key)

    def bisect(make, job, key: str, target: float, lo: float, hi: float) -> float:
        for _ in range(25):  # the simulated time grows with the parameter
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if simulated(job, make(mid), key) < target else (lo, mid)
        return lo

    per_finish = bisect(lambda v: replace(sim, engine=replace(sim.engine, per_finish_s=v)), sync_job,
                        "perf/rollout_s", median(sync_records, "perf/rollout_s"), 0.0, 0.05)
    sim = replace(sim, engine=replace(sim.engine, per_finish_s=per_finish,
                                      source=f"{sim.engine.source}; per_finish_s fitted in situ"))
    scale = median(sync_records, "perf/train_compute_s") / simulated(sync_job, sim, "perf/train_compute_s")
    t = sim.trainer
    sim = replace(sim, trainer=replace(t, micro_batch_base_s=t.micro_batch_base_s * scale,
                                       per_token_s=t.per_token_s * scale,
                                       per_token_squared_s=t.per_token_squared_s * scale,
                                       optimizer_step_s=t.optimizer_step_s * scale))
    corun = bisect(lambda v: replace(sim, trainer=replace(sim.trainer, corun_slowdown=v)), cgp_job,
                   "perf/train_compute_s", median(cgp_records, "perf/train_compute_s"), 0.5, 3.0)
    return replace(sim, trainer=replace(sim.trainer, corun_slowdown=corun,
                                        source=f"{t.source}; x{scale:.3f} in situ, corun_slowdown fitted in situ"))


def geometric_mean_tokens(lengths: list[int], max_tokens: int) -> float:
    """Mean of a geometric length distribution fitted to lengths cut at ``max_tokens`` (censored MLE)."""
    num_stopped = sum(n < max_tokens for n in lengths)
    return sum(lengths) / max(num_stopped, 1)


def main(argv: list[str]) -> None:
    """``python -m rolloutpipe.sim.calibrate engine|trainer``: one measurement, pinned, as JSON on stdout."""
    import json
    from dataclasses import asdict

    from rolloutpipe.config import load_config

    pin_to_one_cpu()
    cfg = load_config({})
    model = calibrate_engine(cfg.model) if argv[0] == "engine" else calibrate_trainer(cfg)
    print(json.dumps(asdict(model)))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
