"""logprobs and parity: a real SGLang server against the trainer (needs sglang: ``pip install -e ".[sglang]"``).

1. ``logprobs``: a tiny Qwen3 (hidden 256, head_dim 64, float32, saved in the HF layout) served by
   ``sglang.launch_server`` through RolloutPipe's client (``SGLangEngine``): sampled tokens' log-probs from the
   engine vs the trainer's recomputation (transformers, CPU, float32) at policy_version 0, then again after
   ``update_weights_from_disk`` to other weights as policy_version 1 (the weight-version check included).
   An abort of a long request is exercised on the way.
2. ``parity``: the whole job (``launch.py rollout.engine=sglang trainer.backend=megatron``) for 2 steps in
   ``sync`` and ``cgp`` modes with ``--enable-deterministic-inference``: the same samples, then the same final
   weights (``--trainer-backend torch`` checks the PyTorch trainer instead). Then ``cgp`` with
   ``pipeline.weight_sync=distributed`` and the PyTorch trainer (its weights broadcast into SGLang's CUDA receive
   buffers through /init_weights_update_group and /update_weights_from_distributed) must match the same run with
   disk sync.

Tolerances: log-probs within ``--logprob-atol`` (default 2e-3: float32 on both sides, different kernels);
parity within 1e-5 on the weights (float32 training, only the order of additions differs) once samples match.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from pathlib import Path

from gpu_checks.common import Machine, Row, launch, tiny_model_config, verdict

SERVER_ARGS = ["--disable-cuda-graph", "--mem-fraction-static", "0.3"]


def save_tiny(directory: Path, init_seed: int) -> None:
    from rolloutpipe.model import build_tiny_tokenizer, load_model, save_hf_checkpoint

    tokenizer = build_tiny_tokenizer()
    save_hf_checkpoint(load_model(tiny_model_config(init_seed), len(tokenizer)), tokenizer, directory)


def trainer_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> list[float]:
    import torch

    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double()
    logp = (logits / temperature).log_softmax(-1)
    return logp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1).tolist()


def check_logprobs(out: Path, sglang_args: list[str], atol: float) -> dict:
    from safetensors.torch import save_file

    from rolloutpipe.model import build_tiny_tokenizer, load_model
    from rolloutpipe.rollout.engines import server_process
    from rolloutpipe.rollout.engines.http_client import SGLangEngine
    from rolloutpipe.types import FinishReason, GenerationRequest

    model_dir = out / "tiny-hf"
    save_tiny(model_dir, init_seed=0)
    server = server_process.sglang_server(name="check0", model_path=str(model_dir), dtype="float32",
                                          concurrency=16, seed=0, base_gpu_id=0, priority_scheduling=False,
                                          extra_args=SERVER_ARGS + sglang_args, log_dir=out / "engines",
                                          api_key=secrets.token_hex(16))
    start = time.time()
    server.start().wait_ready(timeout_s=600)
    print(f"sglang server ready in {time.time() - start:.0f}s at {server.url}", flush=True)
    results, done = {}, threading.Condition()

    def on_result(r):
        with done:
            results[r.request_id] = r
            done.notify_all()

    engine = SGLangEngine(name="check0", endpoint=server.endpoint, concurrency=16, on_result=on_result,
                          server_error=server.exit_reason, stop_server=server.stop)
    vocab = len(build_tiny_tokenizer())
    summary = {}
    try:
        for version, seed in ((0, 0), (1, 1)):
            if version:
                weights = out / "weights" / f"policy_v{version}.safetensors"
                weights.parent.mkdir(exist_ok=True)
                state = load_model(tiny_model_config(seed), vocab).state_dict()
                state.pop("lm_head.weight")  # tied, as the trainer writes it
                save_file({k: v.contiguous() for k, v in state.items()}, str(weights))
                engine.update_weights_from_disk(str(weights), version)
            model = load_model(tiny_model_config(seed), vocab)
            requests = [GenerationRequest(request_id=f"v{version}/r{i}", input_ids=[4 + (i * 5 + j) % 40
                                                                                    for j in range(4 + i)],
                                          max_new_tokens=32, temperature=1.0, sampling_seed=1000 + i,
                                          stop_token_ids=[1]) for i in range(8)]
            for r in requests:
                engine.submit(r)
            with done:
                assert done.wait_for(lambda ids=[r.request_id for r in requests]: all(i in results for i in ids), 120)
            diffs = []
            for r in requests:
                got = results[r.request_id]
                assert got.policy_version == version
                want = trainer_logprobs(model, r.input_ids, got.output_ids, r.temperature)
                diffs += [abs(a - b) for a, b in zip(got.output_logprobs, want)]
            summary[f"policy_v{version}_max_abs_logprob_diff"] = max(diffs)
            summary[f"policy_v{version}_num_tokens"] = len(diffs)
            print(f"policy_version {version}: max |engine - trainer| log-prob = {max(diffs):.2e} over "
                  f"{len(diffs)} tokens", flush=True)
        long = GenerationRequest(request_id="long", input_ids=[5, 6, 7], max_new_tokens=400, temperature=1.0,
                                 sampling_seed=1, stop_token_ids=[])
        engine.submit(long)
        time.sleep(0.05)
        engine.abort("long")
        with done:
            assert done.wait_for(lambda: "long" in results, 60)
        summary["abort_finish_reason"] = results["long"].finish_reason.value
        summary["abort_num_tokens"] = len(results["long"].output_ids)
        summary["abort_ok"] = results["long"].finish_reason in (FinishReason.ABORT, FinishReason.LENGTH)
    finally:
        engine.shutdown()
    summary["logprobs_ok"] = all(v <= atol for k, v in summary.items() if k.endswith("logprob_diff"))
    return summary


def check_parity(out: Path, sglang_args: list[str], trainer_backend: str) -> dict:
    from safetensors.torch import load_file

    model_dir = out / "tiny-hf"
    save_tiny(model_dir, init_seed=0)
    args = ["num_rollout=2", "rollout_batch_size=4", "n_samples_per_prompt=4", "global_batch_size=16",
            "micro_batch_size=4", "rollout_max_response_len=8", "run.save_samples=true", "rollout.engine=sglang",
            f"trainer.backend={trainer_backend}",
            f"model.path={model_dir}", "model.dtype=float32",
            # rollout.sglang_deterministic_inference (default true) adds --enable-deterministic-inference
            "rollout.sglang_launch_args=[" + ",".join(SERVER_ARGS + sglang_args) + "]"]
    samples, weights = {}, {}
    runs = {"sync": ["pipeline.mode=sync"], "cgp": ["pipeline.mode=cgp"],
            "disk": ["pipeline.mode=cgp", "trainer.backend=torch"],
            "distributed": ["pipeline.mode=cgp", "trainer.backend=torch", "pipeline.weight_sync=distributed"]}
    for mode, overrides in runs.items():
        run_dir = out / f"run-{mode}"
        start = time.time()
        proc = launch(run_dir, *args, *overrides)
        print(f"{mode} run: exit {proc.returncode} in {time.time() - start:.0f}s", flush=True)
        if proc.returncode != 0:
            return {"parity_ok": False, f"{mode}_stderr_tail": proc.stderr[-3000:]}
        samples[mode] = [(row["id"], row["response_ids"], row["reward"])
                         for path in sorted((run_dir / "rollouts").glob("step=*.jsonl"))
                         for row in map(json.loads, path.read_text().splitlines())]
        weights[mode] = load_file(str(run_dir / "checkpoints" / "final" / "model.safetensors"))
    same_samples = samples["sync"] == samples["cgp"]
    difference = max((weights["sync"][k] - weights["cgp"][k]).abs().max().item() for k in weights["sync"])
    print(f"parity: same samples {same_samples}, max |sync - cgp| weight = {difference:.2e}", flush=True)
    same_distributed = samples["distributed"] == samples["disk"]
    distributed_difference = max((weights["distributed"][k] - weights["disk"][k]).abs().max().item()
                                 for k in weights["disk"])
    print(f"distributed weight sync: same samples {same_distributed}, max |distributed - disk| weight = "
          f"{distributed_difference:.2e}", flush=True)
    return {"parity_same_samples": same_samples, "parity_max_weight_diff": difference,
            "parity_ok": same_samples and difference < 1e-5,
            "distributed_same_samples": same_distributed, "distributed_max_weight_diff": distributed_difference,
            "distributed_ok": same_distributed and distributed_difference < 1e-5}


def logprobs(machine: Machine, sglang_args: list[str], atol: float) -> list[Row]:
    got = check_logprobs(machine.folder("logprobs"), sglang_args, atol)
    diffs = {k: v for k, v in got.items() if k.endswith("logprob_diff")}
    return [Row(part="logprobs", checked="SGLang vs trainer log-probs at policy_version 0 and 1",
                measured=", ".join(f"{k.split('_')[1]} {v:.1e}" for k, v in diffs.items()), limit=f"<= {atol:g}",
                verdict=verdict(got["logprobs_ok"]), figures=got),
            Row(part="logprobs", checked="abort of a long request", measured=got["abort_finish_reason"],
                limit="abort or length", verdict=verdict(got["abort_ok"]))]


def parity(machine: Machine, sglang_args: list[str], trainer_backend: str) -> list[Row]:
    got = check_parity(machine.folder("parity"), sglang_args, trainer_backend)
    if "parity_max_weight_diff" not in got:
        return [Row(part="parity", checked="launch.py rollout.engine=sglang", measured=next(
            v for k, v in got.items() if k.endswith("stderr_tail"))[-200:], limit="exit 0", verdict=verdict(False))]
    return [Row(part="parity", checked=f"sync vs cgp with SGLang, trainer {trainer_backend}, 2 steps",
                measured=f"same samples {got['parity_same_samples']}, weights differ by "
                         f"{got['parity_max_weight_diff']:.1e}", limit="same samples, 1e-5",
                verdict=verdict(got["parity_ok"]), figures=got),
            Row(part="parity", checked="distributed vs disk weight sync (torch trainer)",
                measured=f"same samples {got['distributed_same_samples']}, weights differ by "
                         f"{got['distributed_max_weight_diff']:.1e}", limit="same samples, 1e-5",
                verdict=verdict(got["distributed_ok"]))]
