"""A trainer node-group process (het group 1, one per rank): its parts, and the bookkeeping around each step.

pipeline.py runs the rank's main loop and the step itself (``pipeline.train_step``, ``pipeline.sync_weights``);
this class owns what they use: the trainer backend (``trainer_class``), the process group of the trainer
ranks, the weight publisher (rank 0), the span recorder, and rank 0's outputs: metrics.jsonl, the W&B run,
checkpoints, the final policy and the merged trace.

Trainer main loop (pipeline.run_trainer, on each rank's main thread)
    consumes   the step's group handles in publish order (every rank reads every handle and trains its
               share: batching.BatchConsumer), then, on rank 0, the rollout's stats of the step
    produces   optimizer steps; on rank 0 policy k+1 for the engines, a metrics record per step,
               checkpoints, and at the end the final policy and the merged trace; once every rank has
               consumed a step, rank 0 deletes its handles, payloads and records (Transport.forget_step)
    waits for  the next handle (store.wait in slices with liveness checks), the all-reduces of its batch,
               and on rank 0 the engines serving the new policy (sync and cgp)
    shuts down healthy: rank 0 sets ``trainer/done`` after the final checkpoint and the trace, so the
               rollout keeps hosting the store until then; on any error (a stop signal too: launch/node.py)
               pipeline.run_node writes ``abort``, rank 0 writes the last finished step's checkpoint from its
               restore point (``stop``, trainer/restore.py) and the attempt's outcome (control/attempt.py),
               and the process exits non-zero. Either way run_node then closes the node (``close``: the
               requeue watch joined, the process group destroyed) and stops the heart-beats, so nothing that
               holds a store client or C++ threads runs into teardown

Requeue watch (rank 0, a thread of its own: ``_requeue_watch``)
    consumes   the batch script's sealed ``requeue`` record (launch/requeue.py: Slurm warned of the time limit)
    produces   at once, the last finished step's checkpoint; then either the stop after the step in progress
               (``end_step`` checkpoints it and the main loop raises RunRequeued) or, if that step does not end
               two margins before the grace period does, an ``abort`` with ``requeue``: the step in progress is
               dropped, every finished one is on disk
    waits for  the record (0.5 s polls on a store client of its own), then the step's end
    shuts down on ``close`` (healthy or not, joined), or when the store is gone
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.distributed.nn  # before any process group exists: see TrainerNode.close

from rolloutpipe.config import Config, PipelineMode, ResumeMode
from rolloutpipe.control.attempt import Outcome, write_outcome
from rolloutpipe.control.checkpoint import (
    ShardedState,
    latest_checkpoint,
    load_optimizer,
    optimizer_groups,
    save_final,
)
from rolloutpipe.control.clock import sync_clock
from rolloutpipe.control.env import NodeEnv, trainer_process_group_backend
from rolloutpipe.control.lifetime import requeue_margin_s, stop_deferred
from rolloutpipe.control.transport import ABORT_S, PeerGone, RunRequeued, SealedStore, Transport, TransportError
from rolloutpipe.control.weights import WeightSender, WeightSync, sender
from rolloutpipe.model import load_model, load_tokenizer
from rolloutpipe.observe.metrics import RolloutStats, SpanRecorder, TrainStats, reduce_step, summary_line
from rolloutpipe.observe.timeline import finish_run
from rolloutpipe.observe.tracking import open_tracker
from rolloutpipe.trainer.backend import PolicyBackend, trainer_class
from rolloutpipe.trainer.config import OldLogprobSource
from rolloutpipe.trainer.restore import RestorePoint

SHARD_WAIT_SHARE = 0.5
"""Sharded checkpoints: rank 0 waits for the other ranks' files (written at the same step's end, or as each rank
stops) up to this share of ``launcher.stop_grace_s`` before it leaves the step unwritten, so that a stop keeps the
rest of the grace for the policy and the outcome before the launcher's SIGKILL."""


class TrainerNode:
    def __init__(self, cfg: Config, env: NodeEnv, transport: Transport) -> None:
        self.cfg = cfg
        self.env = env
        self.transport = transport
        self.is_writer = env.rank == 0
        """Rank 0 publishes weights and writes the run's outputs."""
        self.spans = SpanRecorder(role="trainer", rank=env.rank,
                                  path=env.run_dir / "spans" / f"trainer-{env.rank}.jsonl", clock=sync_clock(transport))
        self.resumed = latest_checkpoint(env.run_dir) if cfg.run.resume is ResumeMode.auto else None
        self.first_step = 0 if self.resumed is None else self.resumed.step + 1
        self.metrics_path = env.run_dir / "metrics.jsonl"
        kept, redone = self._metrics_to_keep() if self.is_writer else ([], False)
        self.tracker = open_tracker(cfg.wandb, run_dir=env.run_dir, run_id=env.run_id, config=cfg,
                                    enabled=self.is_writer, redo_history=kept if redone else None)
        self.distributed = env.world_size > 1
        self.trainer: PolicyBackend | None = None
        self._closing = threading.Event()
        self._watch: threading.Thread | None = None
        if self.distributed:
            pg_store = SealedStore(transport.connect_another(), transport.key("trainer_pg"))
            dist.init_process_group(trainer_process_group_backend(), store=pg_store, rank=env.rank,
                                    world_size=env.world_size)
        try:
            self._build(cfg, env, transport, redone)
        except BaseException:  # a start that fails (a bad model file; a stop during the model load) releases what
            self.close()  # it made: the process group and its threads, the backend's groups
            raise

    def _build(self, cfg: Config, env: NodeEnv, transport: Transport, redone: bool) -> None:
        self.tokenizer = load_tokenizer(cfg.model)
        model_cfg = cfg.model if self.resumed is None else replace(cfg.model, path=str(self.resumed.directory))
        self.trainer = trainer_class(cfg.trainer.backend)(
            model=load_model(model_cfg, len(self.tokenizer)), cfg=cfg.trainer, grpo=cfg.grpo,
            temperature=cfg.rollout_temperature, pad_id=self.tokenizer.pad_token_id,
            multi_step=cfg.num_steps_per_rollout > 1, process_group_active=self.distributed,
            # async_one_step trains on samples of the previous policy, which only the engine's log-probs describe
            old_logprobs=OldLogprobSource.engine if cfg.pipeline.mode is PipelineMode.async_one_step
            else cfg.trainer.old_logprobs,
        )
        if cfg.trainer.exact_accumulation:  # the exact sum's bins are sized by the batch's sample count
            self.trainer.sum_exactly(cfg.global_batch_size)
        if cfg.grpo.kl_loss_coef > 0:  # the initial policy, also on resume: model.path, not the checkpoint
            reference = replace(cfg.model, path=cfg.trainer.ref_model_path or cfg.model.path)
            self.trainer.load_reference(load_model(reference, len(self.tokenizer)))
        self.trainer.bucket_bytes = cfg.weight_sync().bucket_bytes  # (FSDP gathers the policy by these buckets)
        self.weights: WeightSender = sender(cfg.weight_sync(), transport=transport, run_dir=env.run_dir,
                                            policy=self.trainer)
        """Rank 0's: policy k+1 to the engines, the way pipeline.weight_sync names (control/weights/)."""
        self.sharded = self.trainer.sharded_checkpoint
        """Every rank checkpoints its own shards of the training state (FSDP), not rank 0 the whole of it."""
        if self.resumed is not None and self.resumed.sharded and self.sharded:
            with ShardedState(self.resumed.directory / "optimizer") as state:
                self.trainer.load_training_shards(state, optimizer_groups(self.resumed))
        elif self.resumed is not None:
            load_optimizer(self.trainer.optimizer, self.resumed)
        self.restore = RestorePoint(run_dir=env.run_dir, tokenizer=self.tokenizer,
                                    config_yaml=(env.run_dir / "config.yaml").read_text(),
                                    keep_last=cfg.run.keep_last_checkpoints, on_disk=self.first_step - 1,
                                    rank=env.rank, world_size=env.world_size, attempt=env.restart_count)
        """The copy of the last finished step, rank 0's (and each rank's shards with ``sharded``): every checkpoint
        is written from it (restore.py)."""
        self.last_step = self.first_step - 1
        """The last step whose metrics are written."""
        if cfg.run.resume is ResumeMode.auto:  # the steps from first_step are redone: their old spans go
            self.spans.resume_at(self.first_step)
        if redone:  # cut off the records of the steps that will be redone (appended again); the kept bytes stay
            os.truncate(self.metrics_path, self._kept_bytes)
        self.progress = None
        self._sends_again = (cfg.weight_sync().way is WeightSync.distributed
                             and cfg.pipeline.mode is not PipelineMode.async_one_step)
        """Whether the rollout node may ask for the current policy again mid-step (``send_again_before``)."""
        self._num_again = (self.first_step, 0)
        """The step, and the requests of it served."""
        self._stopping = False
        """Rank 0: the step just ended is where the run stops for a requeue (``end_step`` decided it)."""
        self._finished = False
        """Rank 0: the final policy and the finished outcome are written (``finish``)."""
        self._requeue_requested_s: float | None = None
        """When the batch script asked the run to stop for a requeue (``_requeue_watch``)."""

    def send_again_before(self, step: int, seq: int) -> None:
        """Every rank, before it takes group handle ``seq`` of ``step`` and while it waits for it: the rollout node's
        requests to send the current policy again that it put there (it lost its last engine in service mid-step:
        control/weights/distributed.py ``Receiver.send_again``), in turn. Rank 0 sends the policy; the others join
        its gathers (a sharded policy). Only requests placed before the step's first optimizer step come."""
        if not self._sends_again:
            return
        from rolloutpipe.control.weights.distributed import again_key

        index = self._num_again[1] if self._num_again[0] == step else 0
        while (request := self.transport.read_record(again_key(self.transport, step, index))) is not None \
                and request["before_seq"] == seq:
            with self.spans.span("sync/weights_again", step=step, seq=seq, policy_version=request["policy_version"]):
                with self.trainer.writer_reads():
                    if self.is_writer:
                        self.weights.send_again(request)
            index += 1
        self._num_again = (step, index)

    def _metrics_to_keep(self) -> tuple[list[dict], bool]:
        """Rank 0 on resume: the metrics records of the steps before ``first_step``, and whether the file holds
        records of later steps, which the resume redoes (a crash after the last checkpoint); ``_kept_bytes``: where
        they end in the file (metrics.jsonl is appended to, and only ever cut there)."""
        self._kept_bytes = 0
        if self.cfg.run.resume is not ResumeMode.auto or not self.metrics_path.exists():
            return [], False
        kept, lines = [], self.metrics_path.read_bytes().splitlines(keepends=True)
        for line in lines:
            record = json.loads(line)
            if record["step"] >= self.first_step:
                break
            kept.append(record)
            self._kept_bytes += len(line)
        return kept, len(kept) < len(lines)

    def start(self) -> int:
        """Rank 0 opens weight sync and tells the rollout to start; returns the first step to run."""
        from tqdm import tqdm

        with self.trainer.writer_reads():  # (broadcast sync reads the policy's dtype and device)
            if self.is_writer:
                self.weights.open()
        if self.is_writer and self.first_step >= self.cfg.num_rollout:
            print(f"[trainer rank 0] nothing to train: step {self.first_step - 1}'s checkpoint holds the run's last "
                  f"step (num_rollout={self.cfg.num_rollout}); writing the final policy", file=sys.stderr, flush=True)
        if self.is_writer:  # the rollout starts its first step only now, so no step's timings include start-up
            self.transport.put_record(self.transport.key("trainer", "ready"), {"ready": True})
        self.progress = tqdm(total=self.cfg.num_rollout, initial=self.first_step, desc="RL steps", unit="step",
                             disable=not (self.is_writer and sys.stderr.isatty()))
        if self.is_writer:  # Slurm's warning before the time limit (launch/requeue.py): rank 0 decides where to stop
            self._watch = threading.Thread(target=self._requeue_watch, name="requeue-watch", daemon=True)
            self._watch.start()
        return self.first_step

    def requeue_due(self, step: int) -> bool:
        """Rank 0, after step ``step``: whether Slurm warned of the time limit, so the run stops here (the last
        step is finished instead: the run is then complete)."""
        return self.is_writer and self._requeue_requested_s is not None and step + 1 < self.cfg.num_rollout

    def stop_if_requeued(self, step: int) -> None:
        """After ``end_step``: if it kept ``step``'s checkpoint for a requeue, stop every process of the run there
        (RunRequeued); the requeued job resumes from it."""
        if not self._stopping:
            return
        reason = (f"Slurm warned of the job's time limit; trainer rank 0 stopped after step {step}'s checkpoint, "
                  "which the requeued job resumes from")
        self.transport.abort(reason, requeue=True)
        raise RunRequeued(reason)

    def _requeue_watch(self) -> None:
        """Waits for the batch script's sealed ``requeue`` record (launch/requeue.py: Slurm warned of the time limit),
        writes the last finished step's checkpoint at once, then lets the step in progress end if it can well within
        the grace period, or drops it (the requeued job redoes it). Its own store client."""
        transport = self.transport.connect_another()
        key = transport.key("requeue")
        try:
            while (record := transport.read_record(key)) is None:
                if self._closing.wait(0.5):
                    return
        except TransportError:
            return  # the store is gone: the run is over
        grace = self.cfg.launcher.requeue_grace_s
        ago = record.get("warned_s_ago")  # (the grace period counts from Slurm's warning, not from this read)
        ago = min(max(float(ago), 0.0), grace) if isinstance(ago, int | float) and math.isfinite(ago) else 0.0
        self._requeue_requested_s = signalled = time.monotonic() - ago
        ends_within_s = grace - 2 * requeue_margin_s(grace)  # of the warning: else the step is dropped
        written = self.write_checkpoint()  # (sharded: complete only once the other ranks stop or end the step)
        kept = f"step {written}'s checkpoint is written" if written is not None else (
            f"the last finished step ({self.restore.on_disk}) is on disk" if self.restore.on_disk >= 0
            else "no step has finished yet" if self.restore.step is None
            else f"step {self.restore.step}'s checkpoint waits for the other ranks' shards")
        print(f"[trainer rank 0] Slurm warned of the time limit {ago:.0f}s before it read the record: {kept}; stopping "
              f"after the step in progress and its checkpoint if it ends within {ends_within_s:.0f}s of the warning "
              f"(launcher.requeue_grace_s={grace:g} less two margins), else dropping it",
              file=sys.stderr, flush=True)
        while time.monotonic() < signalled + ends_within_s:
            if self._stopping or self._closing.wait(0.5):  # the stop at a checkpoint is under way
                return
        resume = (f"step {self.restore.on_disk}'s checkpoint" if self.restore.on_disk >= 0
                  else "the start (no step has finished)")
        transport.abort(
            f"Slurm warned of the job's time limit and the step in progress did not end within "
            f"launcher.requeue_grace_s={grace:g}s: it is dropped, and the requeued job redoes it from {resume}",
            requeue=True)

    def end_step(self, step: int, stats: TrainStats) -> None:
        """The step's metrics record (rank 0 writes it: metrics.jsonl, the terminal, W&B), which finishes the step,
        and the copy of its state (restore.py); then its checkpoint when one is due.

        Sharded: every rank copies its shards first; rank 0's decision (a checkpoint due, or the stop for a
        requeue) reaches every rank in the step's last collective, and each writes its file when it is yes."""
        record = self.reduce(step, stats)
        if self.sharded:
            self.restore.capture_shards(step, self.trainer.training_shards())
            self._stopping = self.requeue_due(step)
            decision = torch.tensor([self.checkpoint_due(step) or self._stopping], dtype=torch.int64,
                                    device=self.trainer.device)
            if self.distributed:
                dist.broadcast(decision, src=0)
            checkpoint = bool(decision.item())
        with self.trainer.writer_reads():  # the restore point's copy: a sharded backend gathers it for rank 0
            self._end_step_writer(step, record)
        if self.sharded and checkpoint:
            self.write_checkpoint(wait_s=SHARD_WAIT_SHARE * self.cfg.launcher.stop_grace_s)
        if self.is_writer:  # every rank is past the step's all-reduces in reduce(), so all have read its groups
            self.transport.forget_step(step, self.cfg.rollout_batch_size)
        self.spans.flush()

    def _end_step_writer(self, step: int, record: dict) -> None:
        if self.is_writer:
            record["run/requeues"] = self.env.restart_count
            source_state = self.transport.wait_record(self.transport.key(f"step={step}", "source_state"),
                                                      what=f"step {step}'s prompt source state")
            with stop_deferred():  # a stop finds the step either not finished or finished and copied
                with self.metrics_path.open("a") as f:
                    f.write(json.dumps(record) + "\n")
                self.tracker.log_step(record)
                self.restore.capture(step, model=self.trainer.hf_model(), optimizer=self.trainer.optimizer,
                                     source_state=source_state)
                self.last_step = step
            self.progress.write(summary_line(record, self.cfg.num_rollout), file=sys.stdout)
            sys.stdout.flush()
            self.progress.update()
            if not self.sharded:
                self._stopping = self.requeue_due(step)  # decided here, once: the checkpoint must be this step's
                if self.checkpoint_due(step) or self._stopping:
                    self.write_checkpoint()

    def reduce(self, step: int, stats: TrainStats) -> dict:
        means = torch.tensor([stats.compute_s, stats.tail_compute_s], dtype=torch.float64)
        padding = torch.tensor([stats.num_padded_tokens, stats.num_padding_tokens], dtype=torch.int64)
        if self.distributed:
            dist.all_reduce(means)
            means /= self.env.world_size
            dist.all_reduce(padding)  # sums
        stats.num_padded_tokens, stats.num_padding_tokens = padding.tolist()
        if not self.is_writer:
            return {}
        rollout = RolloutStats(**self.transport.wait_record(self.transport.key(f"step={step}", "rollout_stats"),
                                                            what=f"step {step}'s rollout stats"))
        record = reduce_step(rollout, stats, mean_compute_s=float(means[0]), mean_tail_compute_s=float(means[1]),
                             lr=self.cfg.trainer.lr)
        if self.cfg.eval.due(step):  # the rollout put it before its stats: eval/<set>/... of the step's policy
            record |= self.transport.wait_record(self.transport.key(f"step={step}", "eval"),
                                                 what=f"step {step}'s evaluation")
        return record

    def checkpoint_due(self, step: int) -> bool:
        every = self.cfg.run.checkpoint_every
        return every > 0 and ((step + 1) % every == 0 or step + 1 == self.cfg.num_rollout)

    def write_checkpoint(self, *, wait_s: float = 0.0) -> int | None:
        """The last finished step's checkpoint, from the restore point, unless it is on disk already (any thread);
        returns the step written (rank 0). Sharded: every rank writes its file, and rank 0 waits up to ``wait_s``
        for the others' (restore.py)."""
        if not (self.is_writer or self.sharded):
            return None
        return self.restore.write(span=lambda step: self.spans.span("checkpoint/save", step=step), wait_s=wait_s)

    def stop(self, err: BaseException) -> None:
        """The run stops before its end (pipeline.run_node, any cause): rank 0 keeps every finished step, writing
        the last one's checkpoint from the restore point, and says how the attempt ended (control/attempt.py). During
        ``finish`` too: the last step's checkpoint is written first there, and a stop before the final policy is
        complete leaves the run to a resume that trains nothing."""
        if self._finished or not (self.is_writer or self.sharded):
            return  # (finished: its outcome says so)
        try:
            written = self.write_checkpoint(wait_s=SHARD_WAIT_SHARE * self.cfg.launcher.stop_grace_s)
            if not self.is_writer:
                return
        except Exception as save_err:  # noqa: BLE001 - the stop's own cause is what the process reports
            if not self.is_writer:
                print(f"[trainer rank {self.env.rank}] could not write its shard of the last finished step while "
                      f"stopping ({type(save_err).__name__}: {save_err})", file=sys.stderr, flush=True)
                return
            print(f"[trainer rank 0] could not write step {self.restore.step}'s checkpoint while stopping "
                  f"({type(save_err).__name__}: {save_err}); a resume continues after step {self.restore.on_disk}",
                  file=sys.stderr, flush=True)
            written = None
        if written is not None:
            print(f"[trainer rank 0] stopping: step {written}'s checkpoint is written (the last finished step); a "
                  "resume continues after it", file=sys.stderr, flush=True)
        self._write_outcome(finished=False, requeue=isinstance(err, RunRequeued | PeerGone),
                            reason=f"{type(err).__name__}: {err}")

    def _write_outcome(self, *, finished: bool, requeue: bool, reason: str) -> None:
        write_outcome(self.env.run_dir, self.env.attempt_key, Outcome(
            attempt=self.env.restart_count, finished=finished, requeue=requeue, last_step=self.last_step,
            checkpoint_step=self.restore.on_disk, reason=reason))

    def close(self) -> None:
        """On every exit path: stop the requeue watch, release the backend's own process groups (Megatron's model
        parallel groups; a world group the backend made itself), then destroy the node's process group, so that
        none of them outlives the node into interpreter teardown.

        A thread still inside a c10d store call when the interpreter finalizes aborts the process when the call
        returns ("terminate called without an active exception": re-taking the GIL ends the thread with
        pthread_exit, whose unwinding cannot cross pybind11's noexcept guard). The watch's store calls run on its
        client's own thread (control/bounded_store.py), and a process that leaves with one in flight skips the
        finalization (launch/node.py), so the watch is joined for ``ABORT_S`` at most. The process group is
        destroyed here rather than only after the last step, and it really goes: torch.distributed.nn binds
        group.WORLD into its functions' default arguments when first imported (transformers' model code imports
        it), so imported after init_process_group it would keep the group, its gloo threads and its store
        client alive until teardown; this module imports it before any group exists."""
        self._closing.set()
        if self._watch is not None:
            self._watch.join(timeout=ABORT_S)  # (a frozen store host holds its read until its deadline)
        if self.trainer is not None:
            self.trainer.close()
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()

    def finish(self) -> None:
        """After the last step: its checkpoint, as every step's (unless run.checkpoint_every wrote it), so that a stop
        from here on loses nothing and a resume trains nothing; then the final policy (control/checkpoint.py
        ``save_final``: complete or absent), the merged trace and W&B (rank 0), the outcome, then ``trainer/done``.

        Every rank's last heart-beat (``Liveness.finish``) comes before ``trainer/done``: once it is written the
        rollout stops hosting the store, and a beat after that fails the rank (lost the store). The other ranks beat
        before the barrier; rank 0 after its final writes, so the rollout watches it until they are done."""
        self.progress.close()
        self.write_checkpoint(wait_s=SHARD_WAIT_SHARE * self.cfg.launcher.stop_grace_s)  # (sharded: each rank its
        # file, rank 0 the step)
        if not self.is_writer:
            self.transport.liveness.finish()
        if self.distributed:
            dist.barrier()
        with self.trainer.writer_reads():
            final = self.trainer.hf_model() if self.is_writer else None
        if self.is_writer:
            save_final(final, self.tokenizer, self.env.run_dir)
            # trace.json, lifecycle.jsonl, timeline.png (run.draw_timeline), W&B
            finish_run(self.env.run_dir, self.tracker, draw=self.cfg.run.draw_timeline)
            self._write_outcome(finished=True, requeue=False, reason="every step trained; the final policy is written")
            self._finished = True
            self.transport.liveness.finish()
            self.transport.put_record(self.transport.key("trainer", "done"), {"done": True})
