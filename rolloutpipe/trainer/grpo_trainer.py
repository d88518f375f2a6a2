"""The GRPO update every trainer backend makes, written once: micro-batches as groups arrive, one optimizer step
per training batch. A backend (torch_backend.py, megatron/) subclasses ``GRPOTrainer`` and supplies only what
differs: the log-prob function, the module whose parameters are trained, how the gradients are summed, clipped
and stepped, and the context its framework calls run in.

Gradient accumulation works on loss *sums* (see ``grpo``): each micro-batch backpropagates the sum of its samples'
losses (``forward_backward``); when a training batch is complete, ``finish_batch`` sums the token and sample counts
over the data-parallel ranks, and the backend sums the gradients over them, divides them by the batch normaliser,
clips and steps. Which rank trained which group, and in what order, changes only the order of floating-point
additions, and with trainer.exact_accumulation not even that (exact_sum.py: the sum is taken in integers).

Old log-probs. With one optimizer step per rollout the weights at training time are the rollout's policy_version
k, so the old log-probs are the current ones, detached (ratio = 1, exact). With ``num_steps_per_rollout > 1`` the
trainer keeps a copy of version k's parameters taken at the start of the step and recomputes old log-probs with it,
so batches trained after the first optimizer step still clip against version k. ``old_logprobs=engine`` uses the
engine's log-probs instead (cheaper on large models; differs from the trainer's by the numerics of the two
implementations). The trainer's own recomputation is the default because it is exact: the ratio is 1 to the last
bit on the first batch, so the clipped objective sees no engine/trainer mismatch. ``async_one_step`` always uses the
engine's log-probs, the only record of the stale policy that generated its samples.

Rollout correction (``grpo.rollout_correction``) weighs the loss by the trainer/engine ratio of policy k: the
trainer's side is the old log-probs above, or with ``old_logprobs=engine`` the current ones detached (slime's
fallback); the engine's are the samples' own. KL to a reference (``grpo.kl_loss_coef``) takes the reference's
log-probs from the policy's own ``_logprobs`` under the reference's parameters, which ``load_reference`` keeps
(the hook ``_reference_params``: each backend's layout and sharding of an HF model's weights).

The step's last update, bucket by bucket. Weight sync sends the policy bucket by bucket right after the step's last
optimizer update. Trainer rank 0 defers that update (``finish_batch(defer_update=True)``: the gradients are summed,
scaled and clipped, but not yet applied), and ``hf_buckets`` applies it to each bucket's parameters just before it
takes that bucket's tensors, on a thread one bucket ahead of weight sync: while bucket j is written or broadcast,
bucket j + 1 is updated and gathered, so the last bucket leaves a bucket's time after the update instead of a whole
model's. The update is the same to the bit (AdamW is elementwise; each parameter is stepped once, from the same
gradient, clipped by the same global norm), and ``apply_deferred_update`` applies whatever is left (the node calls
it on every rank before anything else reads the weights). The other ranks apply their update whole, before rank 0
reads theirs (an FSDP gather), except where a collective finishes it (``deferred_on_every_rank``: Megatron's
distributed optimizer all-gathers each bucket group's updated shards; its ranks finish the same groups in step with
rank 0's reads). A backend that cannot step part of its parameters (FusedAdam counts its steps per call) applies the
whole update before the first bucket.

Precision. Token counts come from the response mask's non-zeros (exact integers in every dtype); log-probs, the
loss and its sums are float32 at least, whatever the model's dtype.
"""

from __future__ import annotations

import abc
import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from rolloutpipe.control.weights.buckets import Bucket, plan_buckets
from rolloutpipe.trainer.config import GRPOConfig, OldLogprobSource, TrainerConfig
from rolloutpipe.trainer.exact_sum import ExactGradientSum
from rolloutpipe.trainer.grpo import BatchTotals, LossSums, normaliser, policy_loss_sums
from rolloutpipe.types import CompleteGroup


@dataclass(kw_only=True, slots=True)
class TrainSample:
    """One sample as the trainer sees it."""

    prompt_ids: list[int]
    response_ids: list[int]
    engine_logprobs: list[float]
    advantage: float
    response_mask: list[int] | None = None
    """An episode's: 1 on the model's tokens, 0 on the environment's (never trained). None: all the model's."""


def sequence_len(sample: TrainSample) -> int:
    """Its row's length in ``pack`` before padding: prompt + response tokens."""
    return len(sample.prompt_ids) + len(sample.response_ids)


def train_samples(group: CompleteGroup) -> list[TrainSample]:
    return [
        TrainSample(prompt_ids=group.prompt_ids, response_ids=s.response_ids, engine_logprobs=s.logprobs,
                    advantage=a, response_mask=s.response_mask)
        for s, a in zip(group.samples, group.advantages, strict=True)
    ]


@dataclass(kw_only=True, slots=True)
class BatchResult:
    loss: float
    grad_norm: float
    num_tokens: int
    num_clipped_tokens: int
    entropy_sum: float = 0.0
    """Sum over the batch's response tokens of the policy's entropy (train/entropy is its mean)."""
    totals: BatchTotals | None = None
    """Every sum of the batch over the data-parallel ranks (KL, rollout correction statistics)."""
    num_exact_sum_unrepresented: int = 0
    """trainer.exact_accumulation: gradient elements whose exact sum dropped bits below its window (exact_sum.py;
    train/exact_sum_unrepresented), over all ranks."""


class GRPOTrainer(abc.ABC):
    """The micro-batch body and the batch's one update; subclasses fill in the hooks below ``# -- hooks``.

    A subclass's ``__init__`` calls this one first, then sets ``optimizer``, ``data_parallel_rank``,
    ``data_parallel_size`` and ``all_reduce`` (an in-place sum over the data-parallel ranks, or None alone)."""

    optimizer: object
    data_parallel_rank: int
    data_parallel_size: int
    all_reduce: Callable[[torch.Tensor], object] | None
    collective_micro_batches = False
    """Whether every forward/backward is a collective (backend.PolicyBackend); FSDP's are."""
    bucket_bytes = 512 << 20
    """How much of the unsharded policy a sharded backend gathers at once (the node sets
    pipeline.weight_sync_bucket_mb)."""
    sharded_checkpoint = False
    """Whether each rank checkpoints its own shards (backend.PolicyBackend); FSDP's do."""
    updates_by_bucket = False
    """Whether ``_update`` can step part of the parameters (module docstring: the step's last update)."""
    deferred_on_every_rank = False
    """Whether every rank defers the step's last update, not only trainer rank 0 (module docstring)."""

    def __init__(self, *, cfg: TrainerConfig, grpo: GRPOConfig, temperature: float, pad_id: int, multi_step: bool,
                 old_logprobs: OldLogprobSource) -> None:
        self.cfg = cfg
        self.grpo = grpo
        self.temperature = temperature
        self.pad_id = pad_id
        self.multi_step = multi_step
        self.old_logprobs = old_logprobs
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        self._snapshot: dict[str, torch.Tensor] | None = None
        """policy_version k's parameters, when batches after the step's first optimizer step clip against them."""
        self._reference: dict[str, torch.Tensor] | None = None
        """The frozen reference's parameters under the policy's names (``load_reference``), for grpo.kl_loss_coef."""
        self._totals = BatchTotals()
        self._exact: ExactGradientSum | None = None
        """With trainer.exact_accumulation: each micro-batch's gradient, summed as integers (``sum_exactly``)."""
        self._deferred = False
        """Whether a batch's update is summed, scaled and clipped but not applied yet (``apply_deferred_update``)."""

    def sum_exactly(self, num_samples_per_batch: int) -> None:
        """trainer.exact_accumulation: from now on each micro-batch's gradient goes into an exact integer sum
        (exact_sum.py), which the backend's ``_optimizer_step`` takes; a backend that cannot refuses here."""
        raise ValueError(f"trainer.exact_accumulation=true is not supported by {type(self).__name__}; use "
                         "trainer.backend=torch, fsdp or megatron.")

    def begin_step(self) -> None:
        """Remember policy_version k's parameters when later batches must clip against them."""
        if self.multi_step and self.old_logprobs is OldLogprobSource.trainer:
            # named_parameters lists tied weights once; functional_call re-ties them
            self._snapshot = {k: v.detach().clone() for k, v in self._policy().named_parameters()}

    def forward_backward(self, samples: list[TrainSample], *, first_batch_of_step: bool) -> LossSums:
        input_ids, targets, mask = (t if self.device is None else t.to(self.device)
                                    for t in pack(samples, pad_id=self.pad_id))  # [B, L], [B, L-1] x 2
        with self._framework_calls():
            logprobs, entropy = self._logprobs(input_ids, targets, mask)  # [B, L-1] x 2
            old = self._old_logprobs(samples, input_ids, targets, logprobs, mask, first_batch_of_step)
            advantages = torch.tensor([s.advantage for s in samples], dtype=logprobs.dtype, device=logprobs.device)
            terms = {}
            if self.grpo.kl_loss_coef > 0:
                with torch.no_grad():
                    terms["ref_logprobs"] = self._logprobs(input_ids, targets, mask, params=self._reference)[0]
            if self.grpo.corrects_rollout:
                terms["engine_logprobs"] = engine_logprobs(samples, like=logprobs, complete=True)
                terms["trainer_old_logprobs"] = (old if self.old_logprobs is OldLogprobSource.trainer
                                                 else logprobs.detach())
            sums = policy_loss_sums(logprobs, old, advantages, mask, self.grpo, entropy=entropy, **terms)
            sums.entropy_sum = float((entropy.detach() * mask).sum())
            # into the backend's gradients (Megatron: DDP's buffers); nothing is communicated until finish_batch
            sums.loss.backward()
            if self._exact is not None:  # this micro-batch's gradient, exactly, into the integer sums
                self._exact.add()
        self._totals.add(sums)
        return sums

    def finish_batch(self, *, defer_update: bool = False) -> BatchResult:
        """Sum over the data-parallel ranks, normalise once, clip and step: the batch's one optimizer update.
        ``defer_update``: the step's last batch on the rank that sends the weights; the update is applied bucket by
        bucket as ``hf_buckets`` yields (module docstring), where the backend can."""
        with self._framework_calls():
            total = self._totals.reduce(self.all_reduce, with_max=self.grpo.corrects_rollout)
            scale = 1.0 / normaliser(self.grpo, num_tokens=total.num_loss_tokens, num_samples=total.num_loss_samples)
            self._deferred = defer_update and self.updates_by_bucket and (self.deferred_on_every_rank
                                                                          or _trainer_rank() == 0)
            try:
                grad_norm = self._optimizer_step(scale)
            except BaseException:
                self._deferred = False  # no update is pending: none was prepared
                raise
        self._totals = BatchTotals()
        return BatchResult(loss=total.loss * scale, grad_norm=grad_norm, num_tokens=total.num_tokens,
                           num_clipped_tokens=total.num_clipped_tokens, entropy_sum=total.entropy_sum, totals=total,
                           num_exact_sum_unrepresented=0 if self._exact is None else self._exact.num_unrepresented)

    def load_reference(self, model: torch.nn.Module) -> None:
        """Keep ``model`` (an HF model: the initial policy, or trainer.ref_model_path) as the frozen reference of
        grpo.kl_loss_coef, on this rank, laid out and sharded as the policy (``_reference_params``)."""
        self._reference = self._reference_params(model)

    def close(self) -> None:
        """Release what the backend holds beyond its Python objects (Megatron: its process groups)."""

    def writer_reads(self) -> contextlib.AbstractContextManager:
        """Around trainer rank 0's reads of the policy, on every rank: nothing to join where rank 0 holds it whole."""
        return contextlib.nullcontext()

    def _old_logprobs(self, samples, input_ids, targets, logprobs, mask, first_batch_of_step):
        if self.old_logprobs is OldLogprobSource.engine:
            return engine_logprobs(samples, like=logprobs)
        if first_batch_of_step or self._snapshot is None:
            return logprobs.detach()
        with torch.no_grad():
            return self._logprobs(input_ids, targets, mask, params=self._snapshot)[0] * mask

    def _reference_params(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Hook: the HF ``model``'s weights as this rank's tensors under the names of ``_policy().named_parameters()``
        (its shard where the policy is sharded), detached, so that ``_logprobs(params=...)`` gives the reference's
        log-probs. A backend without one refuses grpo.kl_loss_coef > 0 here, at start."""
        raise ValueError(f"grpo.kl_loss_coef > 0 needs a reference model, which {type(self).__name__} does not keep "
                         "yet; set grpo.kl_loss_coef=0 or use trainer.backend=torch, fsdp or megatron.")

    def hf_buckets(self) -> tuple[list[Bucket], Iterator[dict[str, torch.Tensor]]]:
        """The policy under HF names by ``plan_buckets`` buckets of ``bucket_bytes``: the plan, and each bucket's
        tensors in turn (a sharded backend gathers one bucket at a time). A deferred update is applied to each
        bucket's parameters before its tensors are taken, one bucket ahead on a thread (module docstring)."""
        if not self._deferred:
            return self._hf_buckets()
        buckets, tensors = self._hf_buckets()
        return buckets, self._updated_ahead(buckets, tensors)

    def apply_deferred_update(self) -> None:
        """Apply what is left of a deferred update (every rank calls it after weight sync; nothing if none)."""
        if self._deferred:
            with self._framework_calls():
                self._update(None)
            self._deferred = False

    def _updated_ahead(self, buckets: list[Bucket],
                       tensors: Iterator[dict[str, torch.Tensor]]) -> Iterator[dict[str, torch.Tensor]]:
        """``tensors``, each bucket's parameters updated first, produced on a thread while the caller sends the
        bucket before (two buckets alive at most besides the caller's: the one it sends, the next one).

        Weights-ahead thread (one per ``hf_buckets`` call)
            consumes   the deferred update, bucket by bucket; the backend's bucket iterator (FSDP: its gathers)
            produces   each bucket's tensors, in order, for the caller
            waits for  room: the caller asking for the next bucket
            shuts down after the last bucket, or when the caller leaves (it finishes the bucket in hand)"""
        ready: queue.SimpleQueue = queue.SimpleQueue()
        room, leaving = threading.Semaphore(2), threading.Event()

        def produce() -> None:
            try:
                if self.device is not None:
                    torch.cuda.set_device(self.device)
                for bucket in buckets:
                    room.acquire()
                    if leaving.is_set():
                        return
                    with self._framework_calls():
                        self._update(list(bucket.names))
                        ready.put((True, next(tensors)))
                ready.put((True, None))
            except BaseException as err:  # noqa: BLE001 - raised in the caller's thread
                ready.put((False, err))

        thread = threading.Thread(target=produce, name="weights-ahead", daemon=True)
        thread.start()
        try:
            while True:
                ok, item = ready.get()
                if not ok:
                    raise item
                if item is None:
                    break
                yield item
                room.release()
        finally:
            leaving.set()
            room.release()
            thread.join()
            if hasattr(tensors, "close"):  # a reader that left early: the gathers the others wait in (lead.py)
                with self._framework_calls():
                    tensors.close()
        self.apply_deferred_update()

    def _hf_buckets(self) -> tuple[list[Bucket], Iterator[dict[str, torch.Tensor]]]:
        """Hook: ``hf_buckets`` without a deferred update. Each bucket's tensors must be taken when it is asked for
        (not before): its parameters are updated just before. The default takes ``hf_state`` whole, so a backend
        using it must not set ``updates_by_bucket``."""
        state = self.hf_state()
        buckets = plan_buckets(state, self.bucket_bytes)
        return buckets, ({name: state[name] for name in bucket.names} for bucket in buckets)

    def _update_unless_deferred(self) -> None:
        """The end of ``_optimizer_step``: the gradients are in place, summed, scaled and clipped; step, unless
        ``finish_batch`` defers the update to ``hf_buckets``."""
        if not self._deferred:
            self._update(None)

    def _update(self, names: list[str] | None) -> None:
        """Hook (``updates_by_bucket`` backends): step the optimizer on the parameters of HF ``names`` (None:
        every one) that still hold a gradient, and drop their gradients (``step_only``)."""
        raise NotImplementedError(f"{type(self).__name__} steps its optimizer in _optimizer_step")

    def hf_on_gpu(self) -> bool:
        """Whether ``hf_state``'s tensors are CUDA tensors (broadcast weight sync then uses NCCL)."""
        return next(iter(self.hf_state().values())).is_cuda

    # -- hooks: what a backend supplies ----------------------------------------------------------------------
    @abc.abstractmethod
    def hf_state(self) -> dict[str, torch.Tensor]:
        """The policy under HF names, full tensors on the CPU (tied lm_head left out, as save_pretrained does)."""

    @abc.abstractmethod
    def hf_model(self) -> torch.nn.Module:
        """The policy as an HF model with the trained weights (for save_pretrained)."""

    @abc.abstractmethod
    def _policy(self) -> torch.nn.Module:
        """The module whose parameters are trained: ``_logprobs(params=...)`` takes its ``named_parameters``."""

    @abc.abstractmethod
    def _logprobs(self, input_ids: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
                  params: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """log p of ``targets`` and the entropy [B, L-1] at the response tokens, under the current weights or
        ``params`` (policy_version k's snapshot)."""

    @abc.abstractmethod
    def _optimizer_step(self, scale: float) -> float:
        """Sum the gradients over the data-parallel ranks, multiply them by ``scale`` (1 / normaliser), clip them to
        ``cfg.max_grad_norm``, step the optimizer and zero the gradients; returns the norm before clipping."""

    def _framework_calls(self) -> contextlib.AbstractContextManager:
        """The context the backend's framework calls run in (Megatron without CUDA: ``cpu.cuda_calls_on_cpu``)."""
        return contextlib.nullcontext()


def pack(samples: list[TrainSample], *, pad_id: int) -> tuple[torch.Tensor, ...]:
    """Right-padded token ids [B, L], next-token targets [B, L-1], and the response-token mask [B, L-1] (1 where
    the engine sampled the token: an episode's environment tokens are 0).

    The mask is float32 whatever the model's dtype: it only multiplies the loss, and token counts come from its
    non-zeros (grpo.policy_loss_sums), so they are exact integers in bfloat16 too."""
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    length = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), length - 1), dtype=torch.float32)
    for b, (s, seq) in enumerate(zip(samples, seqs)):
        input_ids[b, : len(seq)] = torch.tensor(seq)
        # logits at position j predict token j + 1: response tokens are predicted from P - 1 .. P + R - 2
        if s.response_mask is None:
            mask[b, len(s.prompt_ids) - 1 : len(seq) - 1] = 1.0
        else:  # an episode: the environment's tokens are context, never trained
            mask[b, len(s.prompt_ids) - 1 : len(seq) - 1] = torch.tensor(s.response_mask, dtype=torch.float32)
    return input_ids, input_ids[:, 1:], mask


def _trainer_rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def engine_logprobs(samples: list[TrainSample], *, like: torch.Tensor, complete: bool = False) -> torch.Tensor:
    """The engine's log-probs of the response tokens, laid out like the trainer's [B, L-1]; ``complete``: refuse a
    sample without one for each of its tokens (rollout correction weighs every token)."""
    old = torch.zeros_like(like)
    for b, s in enumerate(samples):
        if complete and len(s.engine_logprobs) != len(s.response_ids):
            raise ValueError(
                f"grpo.rollout_correction needs the engine's log-prob of every response token, and the engine "
                f"returned {len(s.engine_logprobs)} for {len(s.response_ids)} tokens; use an engine that returns "
                "them (SGLang with return_logprob, as the rollout asks) or set grpo.rollout_correction=none.")
        start = len(s.prompt_ids) - 1
        old[b, start : start + len(s.engine_logprobs)] = torch.tensor(s.engine_logprobs, dtype=old.dtype)
    return old
