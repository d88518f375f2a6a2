"""GPU check of the production backends: a real SGLang server, the Megatron-core trainer, a tiny model, minutes.

    pip install -e ".[sglang,megatron,dev]"   # sglang 0.5.23 brings its own CUDA torch
    python tools/gpu_check.py --out /tmp/gpu_check [--trainer-backend torch] [--sglang-args --attention-backend triton]

Not run in CI and never run on the CPU machines (sglang does not install there); run it when a GPU is lent.
It prints one line per check and a JSON summary, and exits non-zero if a check fails:

1. ``logprobs``: a tiny Qwen3 (hidden 256, head_dim 64, float32, saved in the HF layout) served by
   ``sglang.launch_server`` through RolloutPipe's client (``SGLangEngine``): sampled tokens' log-probs from the
   engine vs the trainer's recomputation (transformers, CPU, float32) at policy_version 0, then again after
   ``update_weights_from_disk`` to other weights as policy_version 1 (the weight-version check included).
   An abort of a long request is exercised on the way.
2. ``parity``: the whole job (``launch.py rollout.engine=sglang trainer.backend=megatron``) for 2 steps in
   ``sync`` and ``cgp`` modes with ``--enable-deterministic-inference``: the same samples, then the same final
   weights (``--trainer-backend torch`` checks the PyTorch trainer instead). Then ``cgp`` with
   ``pipeline.weight_sync=distributed`` and the PyTorch trainer (its CPU weights broadcast over gloo into SGLang's
   CUDA receive buffers through /init_weights_update_group and /update_weights_from_distributed; nccl would need
   a GPU of its own for the trainer) must match the same run with disk sync.

3. ``trainer_size`` (run first, before any SGLang server holds GPU memory; tools/gpu_check_trainer.py): both
   backends at Qwen3-1.7B's width and vocabulary in bfloat16 with float32 master weights, token-budget micro-batches,
   chunked log-probs, with and without ``trainer.recompute`` (Megatron with Transformer Engine's layer spec when it
   imports): peak memory beside the memory plan's estimate, and the backends' losses in agreement.
   ``--only-trainer-size`` runs just this one and the next (no SGLang needed).
4. ``distributed_optimizer`` (tools/gpu_check_trainer.py ``check_distributed_optimizer``): Megatron's
   DistributedOptimizer (``trainer.megatron.distributed_optimizer=true``) data parallel over every GPU here, one
   process each: a tiny float32 model's first step equals the torch backend's (loss, entropy, grad norm to 1e-4
   relative; the update to 1e-3), its sharded optimizer state survives a checkpoint (the next step within 1e-5 of
   the uninterrupted one), and its peak memory per rank at Qwen3-1.7B's width is within 1.5x of the memory plan's.
   ``--skip-distributed-optimizer`` leaves it out.

Tolerances: log-probs within ``--logprob-atol`` (default 2e-3: float32 on both sides, different kernels);
parity within 1e-5 on the weights (float32 training, only the order of additions differs) once samples match.
"""

from __future__ import annotations

import argparse
import json
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SERVER_ARGS = ["--disable-cuda-graph", "--mem-fraction-static", "0.3"]


def tiny_model_config(init_seed: int = 0):
    from rolloutpipe.model import ModelConfig, TinyModelConfig

    return ModelConfig(init_seed=init_seed, tiny=TinyModelConfig(hidden_size=256, intermediate_size=512,
                                                                 num_attention_heads=4, num_key_value_heads=2))


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
        proc = subprocess.run([sys.executable, str(REPO / "launch.py"), f"run.dir={run_dir}", *args, *overrides],
                              check=False, cwd=REPO, capture_output=True, text=True, timeout=900)
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check_out"))
    parser.add_argument("--logprob-atol", type=float, default=2e-3)
    parser.add_argument("--skip-parity", action="store_true")
    parser.add_argument("--only-trainer-size", action="store_true")
    parser.add_argument("--trainer-size-layers", type=int, default=4)
    parser.add_argument("--skip-distributed-optimizer", action="store_true")
    parser.add_argument("--num-gpus", type=int, default=None,
                        help="data-parallel ranks of the distributed_optimizer check (default: every GPU)")
    parser.add_argument("--trainer-backend", choices=["megatron", "torch"], default="megatron")
    parser.add_argument("--sglang-args", nargs=argparse.REMAINDER, default=[],
                        help="extra sglang.launch_server arguments (last on the line)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from gpu_check_trainer import check_distributed_optimizer, check_trainer_size

    summary = check_trainer_size(args.trainer_size_layers)
    if not args.skip_distributed_optimizer:
        summary |= check_distributed_optimizer(args.trainer_size_layers, args.num_gpus)
    if not args.only_trainer_size:
        import sglang

        summary["sglang_version"] = getattr(sglang, "__version__", "?")
        summary |= check_logprobs(args.out, args.sglang_args, args.logprob_atol)
        if not args.skip_parity:
            summary |= check_parity(args.out, args.sglang_args, args.trainer_backend)
    print(json.dumps(summary, indent=2))
    return 0 if all(v for k, v in summary.items() if k.endswith("_ok")) else 1


if __name__ == "__main__":
    sys.exit(main())
