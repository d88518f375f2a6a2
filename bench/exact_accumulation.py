"""What trainer.exact_accumulation costs on the torch, FSDP and Megatron backends (CPU): time per training batch
and memory.

    python bench/exact_accumulation.py                                    # the embedded tiny Qwen3, float32
    python bench/exact_accumulation.py --hidden 256 --layers 4 --dtype bfloat16 --repeats 5 --threads 1
    python bench/exact_accumulation.py --backend fsdp --ranks 2 --hidden 256 --layers 4 --threads 1
    python bench/exact_accumulation.py --backend megatron --ranks 2 --hidden 256 --layers 4 --threads 1

Workload: one training batch of --groups GRPO groups of --samples samples (random token ids, fixed seed; each
group one --prompt-tokens prompt, responses of 32 to 64 tokens, random advantages), on a Qwen3 built as
model.load_model builds the embedded one (ModelConfig.tiny: --hidden, --layers, MLP 2 x hidden, hidden / 64 heads
but at least 4, half as many key/value heads; the tiny tokenizer's vocabulary), through PolicyTrainer as
tests/unit/test_exact_sum.py builds it. Four variants, each with its own trainer:

    float 32/mb     the float path with micro-batches of --micro-batch-size samples across groups (the default)
    float group/mb  the float path with micro-batches of one group each: the micro-batch-size effect alone
    grid group/mb   the former exact path, for comparison only (``GridGradientSum`` here): each micro-batch's
                    gradient rounded to a fixed grid of 2^-31 (at 128 samples) into one int64 (torch backend only)
    exact group/mb  trainer.exact_accumulation (sum_exactly, exact_sum.py): one group per micro-batch, gradients
                    summed exactly in int64 bins

Time table: seconds per training batch (every micro-batch's forward/backward, then finish_batch: the normaliser,
clipping and the AdamW step), after one warm-up batch per variant. The variants alternate within each repeat, in
a rotating order, so machine noise hits all alike; cells are medians of --repeats and the ratio is to the float
32/mb median. "add+take" is the time spent in the sum's add (each micro-batch's gradient into the integers) and
take (back to floating point), timed by a subclass patched in here only, as a share of that variant's batch.
That share scales with parameters x micro-batches while the forward/backward scales with parameters x tokens: it
shrinks as groups get longer. ``--backend fsdp --ranks N``: FSDPTrainer on N gloo ranks (processes on this
machine), each training its 1/N of the micro-batches in lockstep, rank 0's seconds; the exact variant reduce-
scatters the int64 bins and gathers whole gradients for the clip norm (fsdp_exact.py). There
add+take is not timed and the memory tables are not made (the torch backend's layout). ``--backend megatron
--ranks N``: MegatronTrainer data parallel over N gloo ranks the same way; the exact variant all-reduces its bins
and writes the sums into rank 0's DDP buffers before Megatron's float reduction (megatron/trainer.py).

On a shared machine pass --threads 1: with other jobs on the cores, torch's default threads oversubscribe them and
a batch's time varies several-fold between repeats.

Memory table: bytes computed from the model's trainable parameters (the exact sums are numel x
exact_sum.BYTES_PER_ELEMENT, the former grid's numel x 8, against parameters, gradients, float32 master copies of a
16-bit model, and AdamW's two float32 moments), then the measured peak RSS growth of each variant in a fresh
process: VmRSS after the trainer is built, the peak reset (/proc/self/clear_refs 5), sum_exactly for the grid and
exact variants, --rss-batches training batches, then VmHWM, with glibc's mmap threshold fixed (MALLOC_ENV). The
growth holds gradients, AdamW state (allocated by the first step), activations and the accumulator. The integer
paths keep no .grad between micro-batches (add frees it), so their peak excess over float group/mb is expected near
the accumulator minus one gradient, (bytes - itemsize) per parameter, plus add's float64 temporaries of the largest
parameter.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from pipeline_bench import aligned_table  # noqa: E402 (bench/ is on sys.path when this script runs)

from rolloutpipe.model import DType, ModelConfig, TinyModelConfig, build_tiny_tokenizer, load_model  # noqa: E402
from rolloutpipe.trainer import torch_backend  # noqa: E402
from rolloutpipe.trainer.backend import PolicyBackend, trainer_class  # noqa: E402
from rolloutpipe.trainer.config import GRPOConfig, OldLogprobSource, TrainerBackend, TrainerConfig  # noqa: E402
from rolloutpipe.trainer.exact_sum import BYTES_PER_ELEMENT, ExactGradientSum  # noqa: E402
from rolloutpipe.trainer.grpo_trainer import TrainSample  # noqa: E402
from rolloutpipe.trainer.torch_backend import PolicyTrainer  # noqa: E402

VOCAB_SIZE = len(build_tiny_tokenizer())
VARIANTS = ("float 32/mb", "float group/mb", "grid group/mb", "exact group/mb")
FLOAT, GRID, EXACT = VARIANTS[0], VARIANTS[2], VARIANTS[3]
MIB = 1 << 20
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
"""For the peak-RSS processes: glibc serves every allocation over 64 KiB by mmap and unmaps it when freed, so RSS
follows the live tensors; with its default (a threshold that rises after the first large free) freed activations
stay resident and hid the accumulator (measured: the exact variant 6.6 MiB *below* float group/mb at hidden 256)."""


class GridGradientSum:
    """The former trainer.exact_accumulation, kept here only to measure against: each micro-batch's gradient
    rounded once to a fixed grid of 2^-(62 - 24 - ceil(log2 samples)) into one int64 per element. It flushed
    elements below half the grid to zero and refused |g| >= 2^24; exact_sum.py replaced it."""

    def __init__(self, params: list[torch.Tensor], *, num_samples_per_batch: int) -> None:
        self.params = params
        self._scale = float(2 ** (62 - 24 - math.ceil(math.log2(max(num_samples_per_batch, 1)))))
        self._sums = [torch.zeros(p.shape, dtype=torch.int64, device=p.device) for p in params]
        self.num_unrepresented = 0  # (never counted: the grid's flush was silent)

    def add(self) -> None:
        for p, total in zip(self.params, self._sums, strict=True):
            if p.grad is not None:
                total.add_(p.grad.double().mul_(self._scale).round_().long())
                p.grad = None

    def reduce(self, all_reduce) -> None:
        assert all_reduce is None, "the grid variant runs on the torch backend, one process"

    def take(self, dtype: torch.dtype, *, scale: float) -> list[torch.Tensor]:
        grads = [s.double().mul_(scale / self._scale).to(dtype) for s in self._sums]
        for s in self._sums:
            s.zero_()
        return grads


class Timed:
    """A sum with the seconds spent in add and take (the bench's own; the trainer's is untimed)."""

    seconds = 0.0

    def add(self) -> None:
        start = time.perf_counter()
        super().add()
        self.seconds += time.perf_counter() - start

    def take(self, dtype: torch.dtype, *, scale: float) -> list[torch.Tensor]:
        start = time.perf_counter()
        grads = super().take(dtype, scale=scale)
        self.seconds += time.perf_counter() - start
        return grads


class TimedExactGradientSum(Timed, ExactGradientSum):
    pass


class TimedGridGradientSum(Timed, GridGradientSum):
    pass


def variants(args) -> tuple[str, ...]:
    """The grid variant on the torch backend only (FSDP's and Megatron's integer paths are exact_sum.py's)."""
    return VARIANTS if args.backend == "torch" else tuple(v for v in VARIANTS if v != GRID)


def model_config(args) -> ModelConfig:
    heads = max(args.hidden // 64, 4)
    return ModelConfig(dtype=DType(args.dtype), tiny=TinyModelConfig(
        num_layers=args.layers, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_attention_heads=heads, num_key_value_heads=heads // 2,
        max_position_embeddings=args.prompt_tokens + 128))


def build_trainer(args) -> PolicyBackend:
    """A fresh policy (same seed, so the same initial weights for every variant) and its trainer; FSDP's and
    Megatron's in the process group ``ranked_time_rows`` started. Megatron's process groups are global, made once
    for the three variants' trainers here (a job has one trainer a process)."""
    backend = TrainerBackend(args.backend)
    with contextlib.ExitStack() as stack:
        if backend is TrainerBackend.megatron:
            from megatron.core import parallel_state

            from rolloutpipe.trainer.megatron import trainer as megatron_trainer
            if parallel_state.model_parallel_is_initialized():
                stack.enter_context(mock.patch.object(megatron_trainer, "init_parallel_state", return_value=False))
        return trainer_class(backend)(
            model=load_model(model_config(args), VOCAB_SIZE), cfg=TrainerConfig(backend=backend),
            grpo=GRPOConfig(), temperature=1.0, pad_id=0, multi_step=False,
            process_group_active=backend is not TrainerBackend.torch, old_logprobs=OldLogprobSource.trainer)


def sum_exactly(policy: PolicyBackend, num_samples: int, variant: str) -> Timed | None:
    """policy.sum_exactly, with the timed accumulator of ``variant`` (the grid or the exact sum) in place of the
    torch backend's (the others' are not timed)."""
    if not isinstance(policy, PolicyTrainer):
        policy.sum_exactly(num_samples)
        return None
    timed = TimedGridGradientSum if variant == GRID else TimedExactGradientSum
    with mock.patch.object(torch_backend, "ExactGradientSum", timed):
        policy.sum_exactly(num_samples)
    return policy._exact


def training_batch(args) -> list[list[TrainSample]]:
    g = torch.Generator().manual_seed(0)
    batch = []
    for _ in range(args.groups):
        prompt = torch.randint(5, VOCAB_SIZE, (args.prompt_tokens,), generator=g).tolist()
        batch.append([TrainSample(prompt_ids=prompt,
                                  response_ids=torch.randint(5, VOCAB_SIZE, (int(torch.randint(32, 65, (1,),
                                                                                               generator=g)),),
                                                             generator=g).tolist(),
                                  engine_logprobs=[], advantage=float(torch.randn((), generator=g)))
                      for _ in range(args.samples)])
    return batch


def micro_batches(variant: str, batch: list[list[TrainSample]], micro_batch_size: int) -> list[list[TrainSample]]:
    """One group each, or micro_batch_size samples in arrival (group) order across groups."""
    if variant != FLOAT:
        return batch
    flat = [s for group in batch for s in group]
    return [flat[i : i + micro_batch_size] for i in range(0, len(flat), micro_batch_size)]


def train(policy: PolicyBackend, micro: list[list[TrainSample]]) -> float:
    """Seconds for one training batch: every micro-batch's forward/backward, then the optimizer step."""
    start = time.perf_counter()
    for samples in micro:
        policy.forward_backward(samples, first_batch_of_step=True)
    policy.finish_batch()
    return time.perf_counter() - start


def time_rows(args, rank: int = 0) -> tuple[list[list[str]], int]:
    batch = training_batch(args)
    num_samples = args.groups * args.samples
    names = variants(args)
    policies = {v: build_trainer(args) for v in names}
    summed = {v: sum_exactly(policies[v], num_samples, v) for v in names if v in (GRID, EXACT)}
    micro = {v: micro_batches(v, batch, args.micro_batch_size)[rank :: args.ranks] for v in names}
    seconds = {v: [] for v in names}
    sum_seconds = {v: [] for v in summed}
    for v in names:  # warm-up
        train(policies[v], micro[v])
    for r in range(args.repeats):
        for v in names[r % len(names):] + names[: r % len(names)]:
            if summed.get(v) is not None:
                summed[v].seconds = 0.0
            seconds[v].append(train(policies[v], micro[v]))
            if summed.get(v) is not None:
                sum_seconds[v].append(summed[v].seconds)
        print(f"  repeat {r + 1}/{args.repeats}: " + ", ".join(f"{v} {seconds[v][-1]:.3f} s" for v in names),
              file=sys.stderr, flush=True)
    base = statistics.median(seconds[FLOAT])
    num_tokens = sum(len(s.prompt_ids) + len(s.response_ids) for group in batch for s in group)
    rows = [["variant", "micro-batches", "s/batch (median)", "min", "max", "ratio to float 32/mb", "tokens/s",
             "add+take s", "add+take share"]]
    for v in names:
        median = statistics.median(seconds[v])
        share = ["-", "-"]
        if sum_seconds.get(v):
            overhead = statistics.median(sum_seconds[v])
            share = [f"{overhead:.4f}",
                     f"{statistics.median(e / s for e, s in zip(sum_seconds[v], seconds[v])):.1%}"]
        rows.append([v, str(len(micro[v]) * args.ranks), f"{median:.3f}", f"{min(seconds[v]):.3f}",
                     f"{max(seconds[v]):.3f}", f"{median / base:.3f}", f"{num_tokens / median:.0f}", *share])
    numel = sum(p.numel() for p in policies[FLOAT]._policy().parameters() if p.requires_grad)
    return rows, numel


def rank_of(rank: int, args, port: int, results) -> None:
    """One FSDP or Megatron rank of ``time_rows``; rank 0 puts the table in ``results``."""
    if args.threads:
        torch.set_num_threads(args.threads)
    store = dist.TCPStore("127.0.0.1", port, args.ranks, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=args.ranks)
    try:
        rows, numel = time_rows(args, rank)
        if rank == 0:
            results.put((rows, numel))
    finally:
        dist.destroy_process_group()


def ranked_time_rows(args) -> tuple[list[list[str]], int]:
    """``time_rows`` on --ranks FSDP or Megatron processes (one, in this process, on a world of its own)."""
    if args.ranks == 1:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            return time_rows(args)
        finally:
            dist.destroy_process_group()
    for v in variants(args):
        count = len(micro_batches(v, training_batch(args), args.micro_batch_size))
        if count % args.ranks:
            raise SystemExit(f"{v}: {count} micro-batches do not split evenly over --ranks {args.ranks}: the ranks run "
                             "them in lockstep; change --groups or --micro-batch-size")
    context = torch.multiprocessing.get_context("spawn")
    results = context.Queue()
    with socket.socket() as s:  # a free port for the ranks' store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.start_processes(rank_of, args=(args, port, results), nprocs=args.ranks,
                                          start_method="spawn")
    return results.get(timeout=5)


def computed_rows(args, numel: int) -> list[list[str]]:
    """Bytes by kind for ``numel`` trainable parameters (torch_backend.PolicyTrainer's layout)."""
    size = DType(args.dtype).torch.itemsize
    sixteen_bit = size < 4
    items = [
        ("parameters", size, f"{args.dtype}"),
        ("gradients (.grad)", size, "float path: accumulate here; exact: one micro-batch's, then freed"),
    ]
    if sixteen_bit:
        items += [("float32 master copies", 4, "mixed precision: what AdamW steps"),
                  ("float32 gradients at the step", 4, "on the master copies, both paths")]
    items += [("AdamW exp_avg + exp_avg_sq", 8, "float32")]
    float_total = sum(b for _, b, _ in items)
    sums = [("former grid (int64)", 8, "numel x 8, grid only"),
            ("exact sums (int64 bins, int8 indices)", BYTES_PER_ELEMENT, f"numel x {BYTES_PER_ELEMENT}, exact only")]
    rows = [["memory (computed)", "MiB", "bytes/param", "note"]]
    rows += [[name, f"{numel * b / MIB:.1f}", str(b), note] for name, b, note in items + sums]
    rows.append(["float path total", f"{numel * float_total / MIB:.1f}", str(float_total), "excluding activations"])
    for name, b in (("grid", 8), ("exact", BYTES_PER_ELEMENT)):
        rows.append([f"{name} - float, between micro-batches", f"{numel * (b - size) / MIB:.1f}", str(b - size),
                     "accumulator minus the .grad the float path keeps"])
        rows.append([f"{name} path total", f"{numel * (float_total + b) / MIB:.1f}", str(float_total + b),
                     f"accumulator = +{b / float_total:.0%}"])
    return rows


def rss_of(variant: str, args) -> dict:
    """In this (fresh) process: the peak RSS growth of --rss-batches training batches of ``variant``, in KiB."""
    policy = build_trainer(args)
    batch = training_batch(args)
    micro = micro_batches(variant, batch, args.micro_batch_size)
    resident = status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # the peak (VmHWM) restarts from what is resident now
        f.write("5")
    if variant in (GRID, EXACT):
        sum_exactly(policy, args.groups * args.samples, variant)
    for _ in range(args.rss_batches):
        train(policy, micro)
    return {"resident_kib": resident, "growth_kib": status_kib("VmHWM") - resident}


def status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def measured_rows(args, numel: int) -> list[list[str]]:
    growth = {}
    for v in variants(args):
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--rss-of", v], check=False,
                             cwd=REPO, capture_output=True, text=True, env={**os.environ, **MALLOC_ENV})
        if out.returncode != 0:
            print(f"peak RSS of {v} not measured:\n{out.stderr[-1500:]}", file=sys.stderr)
            return [["peak RSS growth", "not measured (see stderr); the table above is computed"]]
        growth[v] = json.loads(out.stdout.strip().splitlines()[-1])["growth_kib"] * 1024
    rows = [["peak RSS growth (measured)", "MiB", "bytes/param", "minus float group/mb MiB", "minus, bytes/param"]]
    for v in variants(args):
        excess = growth[v] - growth[VARIANTS[1]]
        rows.append([v, f"{growth[v] / MIB:.1f}", f"{growth[v] / numel:.1f}", f"{excess / MIB:+.1f}",
                     f"{excess / numel:+.1f}"])
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--hidden", type=int, default=TinyModelConfig().hidden_size)
    parser.add_argument("--layers", type=int, default=TinyModelConfig().num_layers)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8, help="samples per group")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--micro-batch-size", type=int, default=32, help="samples per micro-batch, float 32/mb")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rss-batches", type=int, default=2, help="training batches per peak-RSS process")
    parser.add_argument("--no-rss", action="store_true", help="skip the measured peak RSS (four more processes)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--backend", choices=[b.value for b in TrainerBackend], default="torch")
    parser.add_argument("--ranks", type=int, default=1, help="data-parallel ranks (processes; not --backend torch)")
    parser.add_argument("--rss-of", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ranks != 1 and args.backend == "torch":
        parser.error("--ranks needs --backend fsdp or megatron")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.rss_of:
        print(json.dumps(rss_of(args.rss_of, args)))
        return 0
    rows, numel = time_rows(args) if args.backend == "torch" else ranked_time_rows(args)
    print(f"one training batch: {args.groups} groups x {args.samples} samples, prompt {args.prompt_tokens} + "
          f"response 32-64 tokens; Qwen3 hidden {args.hidden}, {args.layers} layers, {numel:,} trainable "
          f"parameters, {args.dtype} on CPU, {torch.get_num_threads()} threads; median of {args.repeats}; "
          f"{args.backend} backend" + (f" on {args.ranks} rank(s)" if args.backend != "torch" else ""))
    print("\n".join(aligned_table(rows)) + "\n")
    if args.backend != "torch":
        return 0
    print("\n".join(aligned_table(computed_rows(args, numel))) + "\n")
    if not args.no_rss:
        print(f"fresh process per variant, {args.rss_batches} training batches")
        print("\n".join(aligned_table(measured_rows(args, numel))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
