"""One RL step, end to end, as the two node groups run it.

    rollout node (one process)                              trainer node (num_ranks processes)
    --------------------------                              ----------------------------------
    engines load policy_version k  <---- weights ---------  (end of step k-1)
    prompts -> requests (seeded per sample)
    admission -> engines -> reward threads
    -> complete group (advantages from its own rewards)
    -> dispatcher thread ------ signed handle, payload ----> consume in publish order (every rank reads
                                (TCPStore)                    every handle, trains its share)
                                                             micro-batch forward/backward (sums)
                                                             batch complete -> all-reduce -> optimizer step
    rollout stats ------------------------------------------> metrics.jsonl (trainer rank 0)
                                                             rank 0 writes policy k+1 -> weight sync

On-policy by construction: every sample of step k comes from policy_version k, because engines load
new weights only between steps and the rollout of step k+1 starts only when every engine serves k+1.
``pipeline.mode`` changes only when the dispatcher releases groups (see dispatcher.py), so ``sync``
and ``cgp`` apply the same update to the same samples.

Main loops
    rollout main  waits for: weights of version k, then all groups complete and published; checks the
                  engines, reward threads, dispatcher and the trainer's heart-beats every poll.
    trainer main  waits for: the next handle (store.wait in slices with liveness checks).
    Shutdown: healthy, the rollout waits for ``trainer/done`` before it stops hosting the store; on any
    error a process writes ``abort`` with its reason and exits non-zero, and the others stop at their
    next wait with that reason.
"""

from __future__ import annotations

import json
import queue
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from rolloutpipe.config import Config
from rolloutpipe.data import PromptSource, load_prompts, prepare_data_path
from rolloutpipe.dispatcher import Dispatcher, PipelineMode
from rolloutpipe.engine.embedded import EmbeddedEngine
from rolloutpipe.env import NodeEnv, Role
from rolloutpipe.metrics import RolloutStats, SpanRecorder, TrainStats, reduce_step, summary_line
from rolloutpipe.model import load_model, load_tokenizer, save_hf_checkpoint
from rolloutpipe.rewards import RewardPool
from rolloutpipe.admission import StepSlots
from rolloutpipe.rollout import Admission, GroupAssembler, InFlight, RewardThreads, is_truncated, make_requests
from rolloutpipe.types import CompleteGroup, Prompt
from rolloutpipe.trainer import OldLogprobSource, PolicyTrainer, train_samples
from rolloutpipe.transport import Liveness, StoreAddress, Transport

POLL_S = 0.5


def open_transport(cfg: Config, env: NodeEnv) -> Transport:
    is_host = env.role is Role.rollout and env.rank == 0
    transport = Transport.open(
        address=StoreAddress(host=env.store_host, port=env.store_port, hosted_by="rollout rank 0"),
        is_host=is_host, run_id=env.run_id, secret=env.secret, run_dir=env.run_dir,
        connect_timeout_s=cfg.pipeline.connect_timeout_s,
    )
    peers = [("rollout", 0)] + [("trainer", r) for r in range(cfg.trainer.num_ranks)]
    transport.liveness = Liveness(
        transport, role=env.role.value, rank=env.rank, peers=[p for p in peers if p != (env.role.value, env.rank)],
        heartbeat_s=cfg.pipeline.heartbeat_s, peer_timeout_s=cfg.pipeline.peer_timeout_s,
        startup_timeout_s=cfg.pipeline.connect_timeout_s,
    ).start()
    return transport


# ================================================================================================
# Rollout node
# ================================================================================================
class RolloutNode:
    def __init__(self, cfg: Config, env: NodeEnv, transport: Transport) -> None:
        self.cfg = cfg
        self.env = env
        self.transport = transport
        self.spans = SpanRecorder(role="rollout", rank=env.rank, path=env.run_dir / "spans" / f"rollout-{env.rank}.jsonl")
        self.tokenizer = load_tokenizer(cfg.model)
        prompts = load_prompts(cfg.data, self.tokenizer, prepare_data_path(cfg.data, env.run_dir))
        self.source = PromptSource(prompts, seed=cfg.seed, shuffle=cfg.data.shuffle)
        self.rewards = RewardThreads(pool=RewardPool(cfg.reward), tokenizer=self.tokenizer,
                                     num_threads=cfg.reward.num_workers, spans=self.spans)
        self.engines = [
            EmbeddedEngine(name=f"engine{i}", model=load_model(cfg.model, len(self.tokenizer)),
                           concurrency=cfg.rollout.concurrency, on_result=self.on_result)
            for i in range(cfg.rollout.num_engines)
        ]
        self.events: queue.Queue = queue.Queue()
        """Complete groups (from the reward threads) and None (an engine slot freed) for the rollout loop."""
        self.dispatcher = Dispatcher(transport=transport.connect_another(), mode=cfg.pipeline.mode,
                                     inline_max_bytes=cfg.pipeline.inline_payload_max_bytes, spans=self.spans)

    def run(self) -> None:
        serving = 0
        for step in range(self.cfg.num_rollout):
            version = self.cfg.pipeline.mode.policy_version_for(step)
            weight_load_s = self.load_weights(version) if version != serving else 0.0
            serving = version
            stats = self.rollout_step(step, version, weight_load_s)
            self.transport.put_json(self.transport.key(f"step={step}", "rollout_stats"), asdict(stats))
            self.spans.flush()
        self.transport.wait_get(self.transport.key("trainer", "done"), what="the trainer to finish")

    def load_weights(self, version: int) -> float:
        """Wait for policy ``version`` from the trainer and make every engine serve it."""
        record = self.transport.wait_json(self.transport.key("weights", f"policy_version={version}"),
                                          what=f"weights of policy_version {version}")
        start = time.time()
        for engine in self.engines:
            engine.update_weights_from_disk(str(self.env.run_dir / record["path"]), version)
        self.transport.set(self.transport.key("serving", f"policy_version={version}"), "1")
        self.spans.add("sync/weights", step=version, start_s=start, end_s=time.time())
        return time.time() - start

    def on_result(self, result) -> None:
        """Engine completion callback (engine thread): reward it, and wake the loop for a free slot."""
        self.rewards.in_flight[result.request_id].finished = True
        self.rewards.on_result(result)
        self.events.put(None)

    def rollout_step(self, step: int, version: int, weight_load_s: float) -> RolloutStats:
        """Admit groups until rollout_batch_size trainable ones are placed in their batches; publish each."""
        cfg, n = self.cfg, self.cfg.n_samples_per_prompt
        slots = StepSlots(rollout_batch_size=cfg.rollout_batch_size, groups_per_batch=cfg.groups_per_batch)
        prompts: list[Prompt] = []  # by group
        in_flight: dict[str, InFlight] = {}
        assembler = GroupAssembler(step=step, policy_version=version, prompts=prompts, n_samples=n,
                                   normalize_std=cfg.grpo.normalize_advantage_std)
        admission = Admission(policy=cfg.rollout.admission, engines=self.engines,
                              concurrency=cfg.rollout.concurrency, in_flight=in_flight)
        self.dispatcher.begin_step(step, cfg.rollout_batch_size)
        self.rewards.begin_step(assembler, in_flight, on_group=self.events.put)

        def admit(num_groups: int) -> None:
            for prompt in self.source.next_batch(num_groups) if num_groups else []:
                group = slots.admit()
                prompts.append(prompt)
                requests = make_requests(
                    step=step, group=group, prompt=prompt, n_samples=n, run_seed=cfg.seed,
                    max_new_tokens=cfg.rollout_max_response_len, temperature=cfg.rollout_temperature,
                    top_p=cfg.rollout_top_p, stop_token_ids=[self.tokenizer.eos_token_id],
                )
                for sample, r in enumerate(requests):
                    in_flight[r.request_id] = InFlight(prompt=prompt, group=group, sample=sample)
                admission.add_group(group, requests)

        start_s = time.time()
        admit(cfg.rollout_batch_size + (cfg.rollout.over_sampling_groups if cfg.rollout.filter_zero_variance else 0))
        admission.pump(slots.frontier())
        complete: dict[int, CompleteGroup] = {}
        num_filtered = 0
        while not slots.full():
            try:
                group = self.events.get(timeout=POLL_S)
            except queue.Empty:
                self.check_health(f"step {step}'s rollout")
                continue
            if group is not None:  # a group is complete: filter it, place what can be placed, publish
                complete[group.group] = group
                trainable = not (cfg.rollout.filter_zero_variance and len({s.reward for s in group.samples}) == 1)
                num_filtered += not trainable
                for placed in slots.resolve(group.group, trainable=trainable):
                    complete[placed.group].batch = placed.batch
                    self.dispatcher.put(complete[placed.group])
                admit(slots.num_to_admit())
            admission.pump(slots.frontier())
        last_group_s = time.time()

        unused = slots.unused()  # over-sampled groups past the last selected one: abort, return their prompts
        num_aborted = admission.abort_groups(unused)
        self.source.give_back([prompts[g] for g in unused])
        while admission.num_in_flight() or not self.rewards.idle():
            self.check_health(f"step {step}'s aborted requests to come back")
            time.sleep(0.01)
        while not self.dispatcher.wait_all_published(step, POLL_S):
            self.check_health(f"step {step}'s groups to be published")
        self.check_health(f"step {step}'s groups to be published")
        while not self.events.empty():
            self.events.get()

        selected = [complete[g] for g in slots.selected()]
        samples = [s for g in complete.values() for s in g.samples]
        rewards = [s.reward for s in samples]
        if cfg.run.save_samples:
            self.save_samples(step, prompts, selected)
        return RolloutStats(
            step=step, policy_version=version, start_s=start_s,
            first_group_s=min(g.completed_s for g in selected), last_group_s=last_group_s,
            weight_load_s=weight_load_s, num_groups=len(selected), num_samples=len(samples),
            num_tokens=sum(len(s.response_ids) for s in samples),
            num_truncated=sum(map(is_truncated, samples)),
            num_reward_errors=sum(s.reward_error is not None for s in samples),
            num_filtered_groups=num_filtered, num_returned_prompts=len(unused), num_aborted_samples=num_aborted,
            reward_mean=statistics.fmean(rewards), reward_std=statistics.pstdev(rewards),
            response_len_mean=statistics.fmean(len(s.response_ids) for s in samples),
        )

    def check_health(self, waiting_for: str) -> None:
        for component in (*self.engines, self.rewards, self.dispatcher):
            if component.error is not None:
                raise RuntimeError(f"{getattr(component, 'name', type(component).__name__)} failed: "
                                   f"{component.error!r}") from component.error
        self.transport.liveness.check(waiting_for=waiting_for)

    def save_samples(self, step: int, prompts, groups) -> None:
        path = self.env.run_dir / "rollouts" / f"step={step}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            for g in sorted(groups, key=lambda g: g.group):
                for s, adv in zip(g.samples, g.advantages):
                    f.write(json.dumps({
                        "id": f"step={step}/group={g.group}/sample={s.index}", "batch": g.batch,
                        "prompt_index": g.prompt_index,
                        "prompt": prompts[g.group].text, "response": s.response_text, "response_ids": s.response_ids,
                        "reward": s.reward, "advantage": adv, "finish_reason": s.finish_reason.value,
                        "reward_error": s.reward_error,
                    }) + "\n")

    def close(self) -> None:
        for engine in self.engines:
            engine.shutdown()
        self.dispatcher.close()
        self.rewards.close()
        self.rewards.pool.close()
        self.spans.flush()


# ================================================================================================
# Trainer node
# ================================================================================================
class TrainerNode:
    def __init__(self, cfg: Config, env: NodeEnv, transport: Transport) -> None:
        self.cfg = cfg
        self.env = env
        self.transport = transport
        self.spans = SpanRecorder(role="trainer", rank=env.rank, path=env.run_dir / "spans" / f"trainer-{env.rank}.jsonl")
        self.distributed = env.world_size > 1
        if self.distributed:
            pg_store = dist.PrefixStore(transport.key("trainer_pg") + "/", transport.connect_another().store)
            dist.init_process_group("gloo", store=pg_store, rank=env.rank, world_size=env.world_size)
        self.tokenizer = load_tokenizer(cfg.model)
        self.trainer = PolicyTrainer(
            model=load_model(cfg.model, len(self.tokenizer)), cfg=cfg.trainer, grpo=cfg.grpo,
            temperature=cfg.rollout_temperature, pad_id=self.tokenizer.pad_token_id,
            multi_step=cfg.num_steps_per_rollout > 1, process_group_active=self.distributed,
            # async_one_step trains on samples of the previous policy, which only the engine's log-probs describe
            old_logprobs=OldLogprobSource.engine if cfg.pipeline.mode is PipelineMode.async_one_step
            else cfg.trainer.old_logprobs,
        )
        self.metrics_path = env.run_dir / "metrics.jsonl"

    def run(self) -> None:
        from tqdm import tqdm

        is_writer = self.env.rank == 0
        progress = tqdm(total=self.cfg.num_rollout, desc="RL steps", unit="step",
                        disable=not (is_writer and sys.stderr.isatty()))
        for step in range(self.cfg.num_rollout):
            stats = self.train_step(step)
            stats.weight_sync_s = self.sync_weights(step + 1) if is_writer else 0.0
            record = self.reduce(step, stats)
            if is_writer:
                with self.metrics_path.open("a") as f:
                    f.write(json.dumps(record) + "\n")
                progress.write(summary_line(record, self.cfg.num_rollout), file=sys.stdout)
                sys.stdout.flush()
                progress.update()
            self.spans.flush()
        progress.close()
        if self.distributed:
            dist.barrier()
        if is_writer:
            save_hf_checkpoint(self.trainer.model, self.tokenizer, self.env.run_dir / "checkpoints" / "final")
            self.transport.set(self.transport.key("trainer", "done"), "1")
        if self.distributed:
            dist.destroy_process_group()

    def train_step(self, step: int) -> TrainStats:
        """Consume the step's groups in publish order and train each batch as soon as it is complete."""
        cfg, trainer, rank, world = self.cfg, self.trainer, self.env.rank, self.env.world_size
        version = cfg.pipeline.mode.policy_version_for(step)
        groups_per_batch, num_batches = cfg.groups_per_batch, cfg.num_steps_per_rollout
        stats = TrainStats(step=step, end_s=0.0, compute_s=0.0, tail_compute_s=0.0, wait_s=0.0, first_forward_s=0.0)
        arrived: list[list] = [[] for _ in range(num_batches)]  # handles per training batch, arrival order
        current, next_in_batch, local = 0, 0, []
        batch_compute_s, last_micro_batch_s, num_clipped = 0.0, 0.0, 0
        trainer.begin_step()

        def run_micro_batch(samples) -> None:
            nonlocal batch_compute_s, last_micro_batch_s, num_clipped
            start = time.time()
            stats.first_forward_s = stats.first_forward_s or start
            sums = trainer.forward_backward(samples, first_batch_of_step=current == 0)
            end = time.time()
            self.spans.add("train/forward_backward", step=step, start_s=start, end_s=end, batch=current,
                           num_samples=len(samples), num_tokens=sums.num_tokens)
            batch_compute_s += end - start
            last_micro_batch_s = end - start
            num_clipped += sums.num_clipped_tokens

        for seq in range(cfg.rollout_batch_size):
            with self.spans.span("train/wait", step=step, seq=seq) as extra:
                start = time.time()
                handle = self.transport.wait_handle(step=step, seq=seq, policy_version=version)
                stats.wait_s += time.time() - start
                extra["group"] = handle.group
            arrived[handle.batch].append(handle)
            while current < num_batches and next_in_batch < len(arrived[current]):
                handle = arrived[current][next_in_batch]
                if next_in_batch % world == rank:  # groups of a batch are dealt round-robin in arrival order
                    local.extend(train_samples(self.transport.load_group(handle)))
                    while len(local) >= cfg.micro_batch_size:
                        run_micro_batch(local[: cfg.micro_batch_size])
                        local = local[cfg.micro_batch_size :]
                next_in_batch += 1
                if next_in_batch == groups_per_batch:  # the training batch is complete
                    if local:
                        run_micro_batch(local)
                        local = []
                    with self.spans.span("train/optimizer_step", step=step, batch=current):
                        start = time.time()
                        result = trainer.finish_batch()
                        optimizer_s = time.time() - start
                        batch_compute_s += optimizer_s
                    stats.losses.append(result.loss)
                    stats.grad_norms.append(result.grad_norm)
                    stats.num_tokens += result.num_tokens
                    stats.compute_s += batch_compute_s
                    stats.tail_compute_s = last_micro_batch_s + optimizer_s
                    current, next_in_batch, batch_compute_s = current + 1, 0, 0.0
        stats.end_s = time.time()
        stats.clip_fraction = num_clipped / max(stats.num_tokens, 1)
        return stats

    def sync_weights(self, version: int) -> float:
        """Write policy ``version`` and wait until every engine serves it (rank 0 only)."""
        start = time.time()
        relative = Path("weights") / f"policy_v{version}.safetensors"
        with self.spans.span("sync/weights", step=version - 1):
            self.trainer.save_weights(self.env.run_dir / relative)
            self.transport.put_json(self.transport.key("weights", f"policy_version={version}"),
                                    {"path": relative.as_posix(), "policy_version": version})
            if version < self.cfg.num_rollout and self.cfg.pipeline.mode is not PipelineMode.async_one_step:
                self.transport.wait_get(self.transport.key("serving", f"policy_version={version}"),
                                        what=f"the engines to serve policy_version {version}")
        (self.env.run_dir / "weights" / f"policy_v{version - 1}.safetensors").unlink(missing_ok=True)
        return time.time() - start

    def reduce(self, step: int, stats: TrainStats) -> dict:
        means = torch.tensor([stats.compute_s, stats.tail_compute_s], dtype=torch.float64)
        if self.distributed:
            dist.all_reduce(means)
            means /= self.env.world_size
        if self.env.rank != 0:
            return {}
        rollout = RolloutStats(**self.transport.wait_json(self.transport.key(f"step={step}", "rollout_stats"),
                                                          what=f"step {step}'s rollout stats"))
        return reduce_step(rollout, stats, mean_compute_s=float(means[0]), mean_tail_compute_s=float(means[1]),
                           lr=self.cfg.trainer.lr)


def run_node(cfg: Config, env: NodeEnv) -> None:
    """Entry of one node-group process: run its loop; on any error tell the others why, then re-raise."""
    transport = open_transport(cfg, env)
    node = None
    try:
        node = RolloutNode(cfg, env, transport) if env.role is Role.rollout else TrainerNode(cfg, env, transport)
        node.run()
    except BaseException as err:
        transport.abort(f"{env.role.value} rank {env.rank} failed: {type(err).__name__}: {err}")
        if transport.is_host:  # keep the store up until every waiter has had a poll to read the reason
            time.sleep(transport.poll_s + 0.5)
        raise
    finally:
        if isinstance(node, RolloutNode):
            node.close()
        transport.liveness.stop()
