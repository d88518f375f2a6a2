"""Host memory per node: what the trainer ranks and the rollout node keep in a node's RAM, term by term, against
``launcher.<group>.mem_gb`` (what the Slurm launchers ask for with --mem).

    tools/memory_plan.py   prints it after the GPU plan (launch/memory_plan.py)
    launch/preflight.py    warns (never refuses) when a node's estimate exceeds launcher.<group>.mem_gb

Pure arithmetic, like the GPU plan. P: the model's parameters, d: bytes per parameter of model.dtype, N: trainer
ranks, dp x tp: Megatron's data- and tensor-parallel sizes, m = max(d, 4) (float32 master weights and moments).

Trainer rank (launcher.trainer.tasks_per_node on a node; the first node holds rank 0, which holds more)
  process          assumed per GPU process: Python, torch, CUDA's libraries and context (``GPU_PROCESS_BYTES``)
  model load       start: every rank loads the whole HF model on the CPU, then moves it to its GPU or shards it.
                   from_pretrained maps the file (transformers 5): d B/param of page cache, one copy a node however
                   many ranks read it. FSDP converts a 16-bit model to float32 there first (model.float(): 4 B/param
                   of each rank's own); Megatron maps it into its own layout (d / tp). grpo.kl_loss_coef: the
                   reference's file, too
  resume           start, after the model load: a replicated backend (torch, Megatron without its distributed
                   optimizer) reads the whole optimizer.safetensors on every rank; a sharded one a tensor at a time
  restore point    trainer/restore.py, from the first finished step on: rank 0 copies the policy (d B/param);
                   the training state is copied whole on rank 0 (torch, Megatron replicated: 2m, + 4 for a 16-bit
                   model's masters) or by every rank, its own shard (FSDP: 3m / N; Megatron's distributed
                   optimizer: 12 / dp of its tensor-parallel piece). Measured: 12 B/param in float32, 14 in
                   bfloat16 (bench/restore_point.py)
  rank 0's model   FSDP and Megatron: an HF model on the CPU (d), filled bucket by bucket: FSDP's gathered, Megatron's
                   mapped from its parameters where they lie, or with tensor parallelism gathered from the group
  bucket buffers   FSDP and Megatron: the buffers weight sync's buckets are gathered or mapped into in turn
                   (pipeline.weight_sync_bucket_mb each), kept between steps: three, and a fourth where the step's
                   last update is applied a bucket ahead of weight sync (FSDP, Megatron's replicated optimizer)
  step end         rank 0's transients at each step's end (weight sync, the restore point's capture): the torch
                   backend copies the policy to the host (d), FSDP and Megatron with tensor parallelism gather one
                   bucket at a time (pipeline.weight_sync_bucket_mb), Megatron without it none (it maps into the HF
                   model and its bucket buffers)
  weight-sync      pipeline.weight_sync=distributed to CPU engines (gloo): two flat buffers of a bucket, kept
  samples          every rank reads every group of a step: ``SAMPLE_TOKEN_BYTES`` a token
Rollout node (the first: the rollout manager beside its engines)
  process          the manager, a CPU process (``CPU_PROCESS_BYTES``)
  engines          rollout.engines_per_node SGLang servers (GPU engines only): assumed ``SGLANG_HOST_BYTES`` each
  reward workers   reward.num_workers spawned processes (``REWARD_WORKER_BYTES``)
  prompt source    every row of data.path, tokenized (``PROMPT_SOURCE_BYTES_PER_FILE_BYTE`` x its size)
  samples          a step's samples and their payloads (``SAMPLE_TOKEN_BYTES`` a token)

A process's peak is the largest of three moments that never overlap: its start (process + model load), a resume's
optimizer read (process + the file), the steady state (process + what it holds + its largest step-end transient).
A node's is the largest moment summed over its processes, which start, resume and step together.
Validated against RSS on the CPU (bench/host_memory.py); the assumed constants are marked. Disk weight sync's file
sits in the page cache, which the kernel may reclaim: not counted.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field

from rolloutpipe.config import Config, WeightSync
from rolloutpipe.control.weights.buckets import BUCKETS_HELD
from rolloutpipe.launch.memory_plan import GiB, ModelShape, dtype_bytes
from rolloutpipe.launch.model_shapes import sequence_len
from rolloutpipe.trainer.config import TrainerBackend

GPU_PROCESS_BYTES = 3 * GiB
"""Assumed: a trainer rank's resident memory before its model loads (Python, torch, transformers, CUDA's libraries
and its context). On the CPU one measures 0.4-0.5 GiB (bench/host_memory.py); CUDA adds its libraries and context,
not measured here (no GPU)."""
CPU_PROCESS_BYTES = GiB // 2
"""A process that imports torch and transformers but holds no model (the rollout manager): 0.4-0.5 GiB measured."""
SGLANG_HOST_BYTES = 6 * GiB
"""Assumed per SGLang server: its scheduler (torch and a CUDA context), tokenizer manager and detokenizer processes."""
REWARD_WORKER_BYTES = 128 << 20
"""A reward worker: a spawned Python process with the reward's imports (math-verify, sympy)."""
SAMPLE_TOKEN_BYTES = 72
"""A sampled token in Python lists: its id (an 8 B slot and a 28 B int) and its log-prob (8 B and a 24 B float),
rounded up."""
PROMPT_SOURCE_BYTES_PER_FILE_BYTE = 12
"""data.path's rows kept tokenized: each prompt's text, and its token ids (36 B each, about 4 bytes of text a token)."""


class HostPhase(enum.Enum):
    start = "start"
    """While the model loads (before any step)."""
    resume = "resume"
    """After the model load, while a resumed run reads its optimizer state."""
    always = "always"
    """From the first finished step on."""
    step_end = "step end"
    """At each step's end (weight sync, the restore point's capture), on top of what is always held."""


@dataclass(kw_only=True, slots=True)
class HostTerm:
    name: str
    num_bytes: int
    phase: HostPhase
    how: str
    knob: str = ""
    shared: bool = False
    """Pages of a file every process of the node maps (the page cache holds one copy): counted once a node."""


@dataclass(kw_only=True, slots=True)
class Process:
    """One process's host memory; ``count`` of them alike on the node."""

    who: str
    count: int
    terms: list[HostTerm]

    def phase_bytes(self, phase: HostPhase, *, shared: bool = True) -> int:
        return sum(t.num_bytes for t in self.terms if t.phase is phase and (shared or not t.shared))

    def moments(self, *, shared: bool = True) -> tuple[int, int, int]:
        """Bytes held at its start (the model loading), at a resume's optimizer read, and in the steady state (with
        its largest step-end transient): they never overlap. ``shared=False``: without the node's shared pages."""
        return (self.phase_bytes(HostPhase.start, shared=shared), self.phase_bytes(HostPhase.resume, shared=shared),
                self.phase_bytes(HostPhase.always, shared=shared) + self.phase_bytes(HostPhase.step_end, shared=shared))

    @property
    def peak_bytes(self) -> int:
        return max(self.moments())


@dataclass(kw_only=True, slots=True)
class NodeEstimate:
    who: str
    group: str
    """The het group: ``launcher.<group>.mem_gb`` is its capacity."""
    processes: list[Process]
    capacity_bytes: int | None
    """launcher.<group>.mem_gb (None: not set, not checked)."""
    notes: list[str] = field(default_factory=list)

    def moment_bytes(self, i: int) -> int:
        """Moment ``i`` of ``Process.moments`` summed over the processes, each shared file's pages once."""
        shared = {t.name: t.num_bytes for p in self.processes for t in p.terms
                  if t.shared and (t.phase, i) in ((HostPhase.start, 0), (HostPhase.resume, 1), (HostPhase.always, 2))}
        return sum(p.count * p.moments(shared=False)[i] for p in self.processes) + sum(shared.values())

    @property
    def peak_bytes(self) -> int:
        """The largest moment of the node: its processes start, resume and step together."""
        return max(self.moment_bytes(i) for i in range(3))

    @property
    def fits(self) -> bool:
        return self.capacity_bytes is None or self.peak_bytes <= self.capacity_bytes


def trainer_processes(cfg: Config, shape: ModelShape, *, rank_0: bool) -> Process:
    """Trainer rank 0, or any other rank, term by term."""
    tr = cfg.trainer
    d, params = dtype_bytes(cfg.model.dtype), shape.num_params()
    m = max(d, 4)
    policy = params * d
    megatron, fsdp = tr.backend is TrainerBackend.megatron, tr.backend is TrainerBackend.fsdp
    tp = tr.megatron.tensor_parallel_size
    distributed = megatron and tr.megatron.distributed_optimizer is not False  # null: true, on a GPU launch
    gib = f"{params / 1e9:.2f}B params"
    terms = [HostTerm(name="process", num_bytes=GPU_PROCESS_BYTES, phase=p, how="assumed: Python, torch, CUDA")
             for p in (HostPhase.start, HostPhase.resume, HostPhase.always)]

    if fsdp and d < 4:
        terms.append(HostTerm(name="model load", num_bytes=params * 4, phase=HostPhase.start,
                              how=f"{gib} x 4 B: the HF model converted to float32 before sharding"))
    else:
        terms.append(HostTerm(name="model load", num_bytes=policy, phase=HostPhase.start, shared=True,
                              how=f"{gib} x {d} B: the HF model, its file's pages (one copy a node)"))
    if megatron:
        terms.append(HostTerm(name="model mapped", num_bytes=params * d // tp, phase=HostPhase.start,
                              how=f"{d} B / {tp}: the model in Megatron's layout"))
    if cfg.grpo.kl_loss_coef > 0:
        terms.append(HostTerm(name="reference load", num_bytes=policy, phase=HostPhase.start, shared=True,
                              how=f"{gib} x {d} B, the reference's file (one copy a node)", knob="grpo.kl_loss_coef=0"))
    whole_state = params * (2 * m + (4 if d < 4 else 0))  # Adam's moments, a 16-bit model's float32 masters
    if fsdp or distributed:
        shard = (params * 3 * m // tr.num_ranks if fsdp
                 else shape.num_params(tp=tp) * 12 // tr.data_parallel_size)
        how = (f"its shard: 3 x {m} B / {tr.num_ranks} ranks (masters, Adam's moments)" if fsdp else
               f"its shard: 12 B / {tr.data_parallel_size} data-parallel ranks of its tensor-parallel piece")
        terms.append(HostTerm(name="restore point: state", num_bytes=shard, phase=HostPhase.always, how=how,
                              knob="more trainer.num_ranks"))
    elif rank_0:
        terms.append(HostTerm(name="restore point: state", num_bytes=whole_state, phase=HostPhase.always,
                              how=f"the whole optimizer state: 2 x {m} B" + (" + 4 B masters" if d < 4 else ""),
                              knob="trainer.backend=fsdp, or megatron with its distributed optimizer"))
    if not (fsdp or distributed):
        terms.append(HostTerm(name="resume: optimizer file", num_bytes=whole_state, phase=HostPhase.resume,
                              how="a resumed run reads the whole optimizer.safetensors on every rank",
                              knob="trainer.backend=fsdp, or megatron with its distributed optimizer"))
    if rank_0:
        terms.append(HostTerm(name="restore point: policy", num_bytes=policy, phase=HostPhase.always,
                              how=f"{gib} x {d} B"))
        if fsdp or megatron:
            terms.append(HostTerm(name="rank 0's CPU model", num_bytes=policy, phase=HostPhase.always,
                                  how=f"{d} B: an HF model filled by buckets" + (
                                      ", each gathered from the tensor-parallel group" if megatron and tp > 1 else
                                      ", mapped from the parameters where they lie" if megatron else "")))
        bucket = min(cfg.weight_sync().bucket_bytes, policy)
        embedding = shape.vocab_size * shape.hidden_size * d  # the largest tensor
        if megatron or fsdp:  # a tensor larger than a bucket is a bucket of its own
            largest = max(bucket, embedding)
            buffers = BUCKETS_HELD + (fsdp or not distributed)  # one more: the update by bucket takes one ahead
            terms.append(HostTerm(name="rank 0's bucket buffers", num_bytes=min(buffers * largest, policy),
                                  phase=HostPhase.always, knob="lower pipeline.weight_sync_bucket_mb",
                                  how=f"{buffers} buffers weight sync's buckets are "
                                      f"{'mapped' if megatron else 'gathered'} into in turn, kept (each as large as "
                                      "the largest bucket)"))
        if not (megatron or fsdp):
            terms.append(HostTerm(name="step end", num_bytes=policy, phase=HostPhase.step_end,
                                  how=f"the policy copied to the host, {d} B/param"))
        elif fsdp or tp > 1:  # gloo all-gathers Megatron's host tensors through a flat copy of its own
            terms.append(HostTerm(name="step end", num_bytes=bucket + (embedding if megatron else 0),
                                  phase=HostPhase.step_end, knob="lower pipeline.weight_sync_bucket_mb",
                                  how="one bucket of the gathered policy" + (
                                      " + gloo's copy of the largest tensor gathered" if megatron else "")))
        if (sync := cfg.weight_sync()).way is WeightSync.distributed and not sync.engines_on_gpus:
            terms.append(HostTerm(name="weight-sync buffers", num_bytes=2 * sync.bucket_bytes, phase=HostPhase.always,
                                  how="2 flat bucket buffers (gloo), double-buffered",
                                  knob="lower pipeline.weight_sync_bucket_mb"))
    samples = cfg.rollout_batch_size * cfg.n_samples_per_prompt * sequence_len(cfg) * SAMPLE_TOKEN_BYTES
    terms.append(HostTerm(name="a step's samples", num_bytes=samples, phase=HostPhase.always,
                          how=f"{cfg.rollout_batch_size * cfg.n_samples_per_prompt} samples x {sequence_len(cfg)} "
                              f"tokens x {SAMPLE_TOKEN_BYTES} B"))
    who = "trainer rank 0" if rank_0 else "each other trainer rank"
    return Process(who=f"{who} ({tr.backend.value})", count=1, terms=terms)


def rollout_manager(cfg: Config, *, data_bytes: int) -> list[Process]:
    """The first rollout node's processes beside the GPUs' engines: the manager, the reward workers, the servers."""
    requests = cfg.rollout_batch_size * cfg.n_samples_per_prompt
    terms = [
        HostTerm(name="process", num_bytes=CPU_PROCESS_BYTES, phase=HostPhase.always,
                 how="Python, torch, transformers' tokenizer"),
        HostTerm(name="prompt source", num_bytes=data_bytes * PROMPT_SOURCE_BYTES_PER_FILE_BYTE,
                 phase=HostPhase.always, how=f"data.path ({data_bytes / 2**20:.0f} MiB) tokenized, "
                                             f"{PROMPT_SOURCE_BYTES_PER_FILE_BYTE} B a byte"),
        HostTerm(name="a step's samples", num_bytes=requests * sequence_len(cfg) * SAMPLE_TOKEN_BYTES,
                 phase=HostPhase.always,
                 how=f"{requests} samples x {sequence_len(cfg)} tokens x {SAMPLE_TOKEN_BYTES} B, and payloads"),
    ]
    out = [Process(who="rollout manager", count=1, terms=terms),
           Process(who="reward worker", count=cfg.reward.num_workers,
                   terms=[HostTerm(name="worker", num_bytes=REWARD_WORKER_BYTES, phase=HostPhase.always,
                                   how="a spawned Python process", knob="fewer reward.num_workers")])]
    if cfg.rollout.engines_on_gpus:
        out.append(Process(who="SGLang server", count=cfg.rollout.engines_per_node,
                           terms=[HostTerm(name="server", num_bytes=SGLANG_HOST_BYTES, phase=HostPhase.always,
                                           how="assumed: scheduler, tokenizer manager, detokenizer")]))
    return out


def data_file_bytes(cfg: Config) -> int:
    """data.path's size (0 where it is not given or not here)."""
    path = cfg.data.path
    return os.path.getsize(path) if path and os.path.isfile(path) else 0


def plan(cfg: Config, shape: ModelShape, *, data_bytes: int | None = None) -> list[NodeEstimate]:
    """The first trainer node and the first rollout node (the others hold less: no rank 0, no manager)."""
    launcher = cfg.launcher

    def capacity(group) -> int | None:
        return None if group.mem_gb is None else int(group.mem_gb * GiB)

    per_node = min(launcher.trainer.tasks_per_node, cfg.trainer.num_ranks)
    processes = [trainer_processes(cfg, shape, rank_0=True)]
    if per_node > 1:
        others = trainer_processes(cfg, shape, rank_0=False)
        others.count = per_node - 1
        processes.append(others)
    trainer = NodeEstimate(who=f"trainer node 0 ({per_node} rank{'s' if per_node > 1 else ''})", group="trainer",
                           processes=processes,
                           capacity_bytes=capacity(launcher.trainer))
    if cfg.trainer.backend is TrainerBackend.megatron and cfg.trainer.megatron.distributed_optimizer is None:
        trainer.notes.append("distributed_optimizer=null counted as true (a GPU launch)")
    data = data_file_bytes(cfg) if data_bytes is None else data_bytes
    rollout = NodeEstimate(who="rollout node 0", group="rollout", processes=rollout_manager(cfg, data_bytes=data),
                           capacity_bytes=capacity(launcher.rollout))
    if not data:
        rollout.notes.append("data.path not given or not readable here: the prompt source is not counted")
    return [trainer, rollout]


def warnings(nodes: list[NodeEstimate]) -> list[str]:
    """One line per node over its launcher.<group>.mem_gb, naming the largest terms of its largest moment."""
    lines = []
    for node in nodes:
        if node.fits:
            continue
        moment = max(range(3), key=node.moment_bytes)
        phases = ({HostPhase.start}, {HostPhase.resume}, {HostPhase.always, HostPhase.step_end})[moment]
        terms = sorted(((p, t) for p in node.processes for t in p.terms if t.phase in phases),
                       key=lambda pt: -pt[1].num_bytes * (1 if pt[1].shared else pt[0].count))
        largest = "; ".join(f"{p.who}: {t.name} {t.num_bytes / GiB:.1f} GiB"
                            + (f" x {p.count}" if p.count > 1 and not t.shared else "")
                            + (f" (lower it: {t.knob})" if t.knob else "") for p, t in terms[:3])
        when = ("as its ranks load the model", "as a resume reads the optimizer state", "while it trains")[moment]
        lines.append(f"host memory plan: {node.who} needs about {node.peak_bytes / GiB:.1f} GiB of host memory "
                     f"{when}, over launcher.{node.group}.mem_gb={node.capacity_bytes / GiB:g}. Largest: {largest}.")
    return lines


def format_plan(nodes: list[NodeEstimate]) -> str:
    out = []
    for node in nodes:
        out.append(f"host memory of {node.who}")
        width = max(len(t.name) for p in node.processes for t in p.terms)
        for p in node.processes:
            out.append(f"  {p.who}" + (f" (x {p.count})" if p.count > 1 else "")
                       + f": peak {p.peak_bytes / GiB:.2f} GiB")
            for t in p.terms:
                if t.name != "process" or t.phase is HostPhase.always:
                    out.append(f"    {t.name:<{width}}  {t.num_bytes / GiB:>8.2f} GiB  {t.phase.value:<8}  {t.how}")
        limit = ("not checked (launcher." + node.group + ".mem_gb is null)" if node.capacity_bytes is None else
                 f"of launcher.{node.group}.mem_gb={node.capacity_bytes / GiB:g}: "
                 + ("fits" if node.fits else "DOES NOT FIT"))
        out.append(f"  node peak  {node.peak_bytes / GiB:.2f} GiB  {limit}")
        out += [f"  ({note})" for note in node.notes]
        out.append("")
    return "\n".join(out)
