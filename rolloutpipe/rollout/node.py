"""The rollout manager (het group 0, rank 0): its parts, and the bookkeeping around each step's rollout.

(The other rollout ranks are engine hosts only: rollout/engines/hosts.py.)

pipeline.py runs the node's main loop and the step itself (``pipeline.rollout_step``); this class owns what
they use: the engines and their supervisor, the reward threads, the dispatcher thread, the prompt source,
the span recorder, and every store record the rollout side reads or writes between steps.

Rollout main loop (pipeline.run_rollout, on the process's main thread)
    consumes   policy versions (``weights/policy_version=<k>`` records), complete groups and freed engine
               slots (``events``: put by the reward threads and the engines' completion callbacks)
    produces   requests to the engines (eval requests too, in the slots training leaves free:
               evaluation.py), placed groups to the dispatcher; after each step the prompt source's state,
               the step's eval record (on eval steps) and its RolloutStats in the store (for trainer rank 0)
    waits for  the trainer to be ready (once), each step's weights, then events in POLL_S slices, and on
               eval steps the step's eval requests before the next weights are loaded; every
               slice it checks the engines (a failed one is replaced and its requests retried:
               supervisor.py), the reward threads, the dispatcher and the trainer's heart-beats
    shuts down healthy: after the last step it waits for ``trainer/done`` before it stops hosting the
               store; on any error (a stop signal too: launch/node.py) pipeline.run_node writes ``abort``
               with its reason, ``close`` stops the engines, their servers, the threads and the reward
               workers, and the process exits non-zero
"""

from __future__ import annotations

import functools
import json
import queue
import sys
import time
from dataclasses import asdict, dataclass

from rolloutpipe.config import Config, ConfigError, PipelineMode, ResumeMode
from rolloutpipe.control.attempt import FreshStart, Outcome, read_outcome, write_outcome
from rolloutpipe.control.checkpoint import latest_checkpoint
from rolloutpipe.control.clock import sync_clock
from rolloutpipe.control.env import NodeEnv
from rolloutpipe.control.lifetime import call_side_by_side
from rolloutpipe.control.transport import PeerGone, Transport
from rolloutpipe.control.weights import WeightSync, receiver, weights_record_key
from rolloutpipe.model import context_len, load_tokenizer
from rolloutpipe.observe.metrics import RolloutStats, SpanRecorder
from rolloutpipe.observe.progress import Progress
from rolloutpipe.rollout.admission import Admission, AdmissionPolicy
from rolloutpipe.rollout.data import PromptSource, load_prompts, prepare_data_path
from rolloutpipe.rollout.dispatcher import Dispatcher
from rolloutpipe.rollout.drafts import Drafts
from rolloutpipe.rollout.engines.factory import EngineFactory
from rolloutpipe.rollout.engines.supervisor import EngineFailed, EngineSupervisor
from rolloutpipe.rollout.environments.episodes import Episode, EpisodeRunner
from rolloutpipe.rollout.environments.pool import EnvPool
from rolloutpipe.rollout.evaluation import Evaluation
from rolloutpipe.rollout.rewards import RewardPool
from rolloutpipe.rollout.samples import InFlight, RewardThreads, make_requests, sampling_seed
from rolloutpipe.types import GenerationRequest, Prompt, turn_id

POLL_S = 0.5
"""How often the rollout loop checks the engines, threads and peers while it waits."""


@dataclass(frozen=True, slots=True)
class NextTurn:
    """An episode's next model turn, from a reward thread to the rollout loop (which alone drives admission)."""

    group: int
    request: GenerationRequest
    engine: str
    """The engine that served the episode's previous turn (its cache holds the conversation)."""


class PolicyGone(EngineFailed, FreshStart):
    """The last engines in service were lost after trainer rank 0 may have stepped past the step's policy, so their
    replacements cannot be sent it again (``RolloutNode._policy_again``): a fresh start resumes from the last
    finished step's checkpoint, whose policy the new engines load."""


class RolloutNode:
    def __init__(self, cfg: Config, env: NodeEnv, transport: Transport) -> None:
        self.cfg = cfg
        self.env = env
        self.transport = transport
        self.spans = SpanRecorder(role="rollout", rank=env.rank,
                                  path=env.run_dir / "spans" / f"rollout-{env.rank}.jsonl",
                                  clock=sync_clock(transport))
        self.tokenizer = load_tokenizer(cfg.model)
        self.environment = EnvPool(cfg.environment) if cfg.environment.name is not None else None
        """Multi-turn episodes' environment workers (rollout/environments/); None: one response per sample."""
        prompts = load_prompts(cfg.data, self.tokenizer, prepare_data_path(cfg.data, env.run_dir),
                               openings=None if self.environment is None else self.environment.openings)
        check_context(cfg, prompts)  # before any engine starts: SGLang refuses longer requests (HTTP 400)
        self.source = PromptSource(prompts, seed=cfg.seed, shuffle=cfg.data.shuffle)
        self.resumed = latest_checkpoint(env.run_dir) if cfg.run.resume is ResumeMode.auto else None
        if self.resumed is not None:
            self.source.load_state_dict(self.resumed.source_state)
        if cfg.run.resume is ResumeMode.auto:  # the step after the checkpoint is redone: its old spans go
            self.spans.resume_at(0 if self.resumed is None else self.resumed.step + 1)
        episodes = None if self.environment is None else self._episode_runner(self._turn_request,
                                                                               cfg.rollout_max_response_len)
        # an episode's environment calls block a reward thread: twice the workers keep every worker busy
        self.rewards = RewardThreads(pool=RewardPool(cfg.reward) if episodes is None else None,
                                     tokenizer=self.tokenizer, spans=self.spans, episodes=episodes,
                                     num_threads=cfg.reward.num_workers if episodes is None
                                     else 2 * cfg.environment.num_workers)
        self.factory = factory = EngineFactory(cfg.engine_setup(), vocab_size=len(self.tokenizer),
                                               on_result=self.on_result, api_key=env.engine_api_key,
                                               transport=transport, run_dir=env.run_dir)
        self.engines = factory.build_all()  # this node's, and the other rollout nodes' (rollout/engines/hosts.py)
        self.rewards.host_of = factory.host_of
        if (hosts := sorted({factory.host_of(e.name) for e in self.engines} - {None})):
            print(f"[rollout rank 0] {len(self.engines)} engines on {len(hosts)} hosts: " + "; ".join(
                f"{h}: {', '.join(e.name for e in self.engines if factory.host_of(e.name) == h)}" for h in hosts),
                file=sys.stderr, flush=True)
        self.supervisor = EngineSupervisor(  # a failed engine: retry its requests elsewhere, restart it
            engines=self.engines, restart=factory.restart, where_to_look=factory.where_to_look,
            max_failures=cfg.rollout.max_engine_failures, request_timeout_s=cfg.rollout.request_timeout_s,
            spans=self.spans, check_peers=lambda what: transport.liveness.check(waiting_for=what),
            min_engines=cfg.rollout.min_engines)
        self.admission: Admission | None = None
        """The current step's; engine threads tell it which requests finished."""
        self.in_flight: dict[str, InFlight] = {}
        """The current step's requests, by id: what the reward threads need to turn a result into a sample."""
        self.events: queue.Queue = queue.Queue()
        """Complete groups (from the reward threads) and None (an engine slot freed) for the rollout loop."""
        # plain lines, only for steps longer than a minute: trainer rank 0's bar owns the terminal
        self.progress = Progress(label="rollout", tty=False)
        self.dispatcher = Dispatcher(transport=transport.connect_another(), mode=cfg.pipeline.mode,
                                     inline_max_bytes=cfg.pipeline.inline_payload_max_bytes, spans=self.spans)
        self.evaluation = Evaluation(  # eval sets, their reward pools and scoring thread (evaluation.py)
            cfg=cfg.eval, data=cfg.data, reward=cfg.reward, tokenizer=self.tokenizer, engines=self.engines,
            concurrency=cfg.rollout.concurrency, run_seed=cfg.seed, max_response_len=cfg.rollout_max_response_len,
            run_dir=env.run_dir, **({} if self.environment is None else dict(  # eval samples are episodes too
                episodes=self._episode_runner, openings=self.environment.openings,
                num_threads=2 * cfg.environment.num_workers)))
        self.supervisor.also_held = self.evaluation.num_held  # an engine hung on eval requests is failed too
        self.drafts = Drafts(self.engines) if cfg.rollout.speculative else None
        """rollout.speculative: the next step's drafts, made in this step's tail (rollout/drafts.py)."""
        self.weights = receiver(cfg.weight_sync(), transport=transport, run_dir=env.run_dir, engines=self.supervisor,
                                check=self.check_health)
        """Policy k+1 onto every engine between steps, the way pipeline.weight_sync names (control/weights/)."""
        self.supervisor.sends_again = (cfg.weight_sync().way is WeightSync.distributed  # (_policy_again)
                                       and cfg.pipeline.mode is not PipelineMode.async_one_step)

    def start(self) -> tuple[int, int]:
        """Resume (if asked), join the weight-update group (distributed sync), wait for the trainer.
        Returns the first step to run and the policy version the engines serve."""
        serving, first_step = 0, 0
        if self.resumed is not None:  # redo the step after the checkpoint from its start, with its weights
            self.supervisor.load_weights(str(self.resumed.weights_path), self.resumed.policy_version)
            serving, first_step = self.resumed.policy_version, self.resumed.step + 1
        self.weights.open()  # distributed sync: the engines join trainer rank 0's group
        self.transport.wait_record(self.transport.key("trainer", "ready"), what="the trainer to start")
        return first_step, serving

    def load_weights(self, version: int) -> float:
        """Wait for policy ``version`` from the trainer and make every engine serve it."""
        self.weights.prepare(version)  # distributed sync: a replaced engine's new group, before the trainer sends
        record = self.transport.wait_record(weights_record_key(self.transport, version),
                                            what=f"weights of policy_version {version}")
        if self.drafts is not None:  # the engines load weights with nothing in flight
            self.drafts.stop(self.check_health)
        start = time.time()
        self.weights.load(record, version)
        self.transport.put_record(self.transport.key("serving", f"policy_version={version}"),
                                  {"policy_version": version})
        self.spans.add("sync/weights", step=version, start_s=start, end_s=time.time())
        return time.time() - start

    def begin_step(self, step: int) -> Admission:
        """A fresh admission over the engines, and no request of an earlier step in flight."""
        self.in_flight = {}
        self.admission = Admission(policy=self.cfg.rollout.admission, engines=self.engines,
                                   concurrency=self.cfg.rollout.concurrency)
        self.dispatcher.begin_step(step, self.cfg.rollout_batch_size)
        self.supervisor.begin_step(step, self.admission)
        return self.admission

    def requests_for(self, step: int, group: int, prompt: Prompt) -> list[GenerationRequest]:
        """Group ``group``'s requests, seeded by their ids, with their drafts (rollout.speculative); under FGD the
        group index is their priority."""
        if self.rewards.episodes is not None:  # multi-turn: each sample's first turn; the rest follow its results
            episodes = [Episode(prompt=prompt, step=step, group=group, sample=s)
                        for s in range(self.cfg.n_samples_per_prompt)]
            requests = [self.rewards.episodes.first_request(e) for e in episodes]
            for e, r in zip(episodes, requests):
                self.in_flight[r.request_id] = InFlight(prompt=prompt, group=group, sample=e.sample, episode=e)
            return requests
        requests = self._make_requests(step, group, prompt)
        if self.drafts is not None:
            requests = [self.drafts.attach(r) for r in requests]
        for sample, r in enumerate(requests):
            self.in_flight[r.request_id] = InFlight(prompt=prompt, group=group, sample=sample)
        return requests

    def draft_next(self, step: int, num_groups: int) -> None:
        """rollout.speculative: draft step ``step + 1``'s first ``num_groups`` groups (the prompt source is peeked)
        on the engines under the current policy, until its weights load."""
        if self.drafts is None or step + 1 >= self.cfg.num_rollout:
            return
        self.drafts.start([r for group, prompt in enumerate(self.source.peek(num_groups))
                           for r in self._make_requests(step + 1, group, prompt)])

    def _make_requests(self, step: int, group: int, prompt: Prompt) -> list[GenerationRequest]:
        cfg = self.cfg
        return make_requests(
            step=step, group=group, prompt=prompt, n_samples=cfg.n_samples_per_prompt, run_seed=cfg.seed,
            max_new_tokens=cfg.rollout_max_response_len, temperature=cfg.rollout_temperature,
            top_p=cfg.rollout_top_p, stop_token_ids=self._stop_token_ids(),
            priority=group if cfg.rollout.admission is AdmissionPolicy.fgd else 0,
        )

    def _turn_request(self, episode: Episode, turn: int, input_ids: list[int], max_new_tokens: int
                      ) -> GenerationRequest:
        """Turn ``turn`` of an episode: seeded by its id, under FGD its group's priority (as its first turn)."""
        cfg = self.cfg
        return GenerationRequest(
            request_id=turn_id(episode.step, episode.group, episode.sample, turn), input_ids=input_ids,
            max_new_tokens=max_new_tokens, temperature=cfg.rollout_temperature, top_p=cfg.rollout_top_p,
            sampling_seed=sampling_seed(cfg.seed, episode.step, episode.group, episode.sample, turn),
            stop_token_ids=self._stop_token_ids(),
            priority=episode.group if cfg.rollout.admission is AdmissionPolicy.fgd else 0)

    def _episode_runner(self, turn_request, max_response_len: int) -> EpisodeRunner:
        """Advances episodes whose turns ``turn_request`` makes (training's, or an eval set's)."""
        return EpisodeRunner(cfg=self.cfg.environment, pool=self.environment, tokenizer=self.tokenizer,
                             stop_token_ids=self._stop_token_ids(), max_response_len=max_response_len,
                             turn_request=turn_request, on_env_call=self._env_span)

    def _stop_token_ids(self) -> list[int]:
        return [self.tokenizer.eos_token_id]

    def _env_span(self, episode: Episode, start_s: float, end_s: float, error: str | None) -> None:
        self.spans.add("rollout/environment", step=episode.step, start_s=start_s, end_s=end_s, group=episode.group,
                       sample=episode.sample, turn=len(episode.responses) - 1, error=error)

    def next_turn(self, group: int, request: GenerationRequest, engine: str) -> None:
        """An episode's next turn (a reward thread): the rollout loop puts it in line (``next_event``)."""
        self.events.put(NextTurn(group=group, request=request, engine=engine))

    def on_result(self, result) -> None:
        """Engine completion callback (engine thread): reward it, and wake the loop for a free slot."""
        if self.drafts is not None and self.drafts.on_result(result):  # a draft: kept for the next step only
            return
        if self.evaluation.on_result(result):  # an eval request's: scored apart, never trained
            self.supervisor.on_result(result)
            self.events.put(None)
            return
        if not self.admission.finished(result.request_id, result.engine):
            return  # a late result of a failed engine: the request was resubmitted elsewhere
        self.supervisor.on_result(result)
        if self.drafts is not None:
            self.drafts.kept(result)
        self.rewards.on_result(result)
        self.events.put(None)

    def next_event(self):
        """The next complete group, None for a freed engine slot (or an episode's next turn, now in line), or
        ``queue.Empty`` after POLL_S."""
        event = self.events.get(timeout=POLL_S)
        if isinstance(event, NextTurn):
            self.admission.add_turn(event.group, event.request, event.engine)  # (False: its group was aborted)
            return None
        return event

    def drain(self, step: int) -> None:
        """After the step is full: wait for the aborted requests to come back and every group to be published."""
        while self.admission.num_in_flight() or not self.rewards.idle():
            self.check_health(f"step {step}'s aborted requests to come back")
            time.sleep(0.01)
        if self.environment is not None:  # an aborted group's episodes stopped mid-way: their environments close
            self.environment.end_step(step)
        while not self.dispatcher.wait_all_published(step, POLL_S):
            self.check_health(f"step {step}'s groups to be published")
        self.check_health(f"step {step}'s groups to be published")
        while not self.events.empty():
            self.events.get()

    def evaluate(self, step: int, version: int, *, rollout_end_s: float | None) -> None:
        """Wait for step ``step``'s eval (tail: what did not ride in the rollout; phase: all of it, started now)
        and put its record for trainer rank 0, before the step's stats and before policy k+1 is loaded."""
        if rollout_end_s is None:
            self.evaluation.begin(step, version)
        with self.spans.span("eval/wait" if rollout_end_s is not None else "eval/phase", step=step):
            wait_s = self.evaluation.wait(lambda: self.check_health(f"step {step}'s evaluation"))
        self.transport.put_record(self.transport.key(f"step={step}", "eval"),
                                  self.evaluation.metrics(rollout_end_s=rollout_end_s, wait_s=wait_s))

    def end_step(self, step: int, stats: RolloutStats) -> None:
        stats.num_engines = len(self.engines)  # in service; a lost engine host's are not
        if self.drafts is not None:
            stats.num_draft_tokens, stats.num_draft_tokens_kept = self.drafts.take_counts()
        stats.num_engine_hosts = len({self.factory.host_of(e.name) for e in self.engines})
        self.spans.flush()  # before the stats: trainer rank 0 merges the spans once it has the last stats
        self.transport.put_record(self.transport.key(f"step={step}", "source_state"), self.source.state_dict())
        self.transport.put_record(self.transport.key(f"step={step}", "rollout_stats"), asdict(stats))

    def check_health(self, waiting_for: str) -> None:
        self.supervisor.check()  # a failed engine is replaced; past rollout.max_engine_failures it raises
        if (failed := self.supervisor.stranded()) is not None:  # distributed sync: the last engine, mid-step
            self._policy_again(failed)
        for engine in self.engines:
            if engine.request_error is not None:  # a restart or a retry elsewhere would be refused the same way
                raise ConfigError(str(engine.request_error)) from engine.request_error
        for component in (self.rewards, self.dispatcher, self.evaluation):
            if component.error is not None:
                raise RuntimeError(f"{type(component).__name__} failed: {component.error!r}") from component.error
        self.transport.liveness.check(waiting_for=waiting_for)

    def _policy_again(self, failed: str) -> None:
        """The replacements of the last engines in service (``failed`` the last) receive the step's policy from
        trainer rank 0 again (distributed.py ``Receiver.send_again``), then take requests. Trainer rank 0 holds that
        policy until the step's first optimizer step, which comes after the first batch's groups are published: the
        request goes among the group handles before then, or the run stops."""
        step, version = self.supervisor.step, self.supervisor.policy_version

        def before_first_update(write, transport, seq: int) -> None:
            if seq >= self.cfg.groups_per_batch:
                raise PolicyGone(
                    f"engine {failed} failed mid-step. It was the last engine in service, and with "
                    "pipeline.weight_sync=distributed its replacement needs this step's policy from trainer rank 0, "
                    f"which may have updated it by now ({seq} groups of step {step} published, a training batch is "
                    f"{self.cfg.groups_per_batch}); stopping the run to be requeued: a Slurm job resumes from the "
                    "last finished step's checkpoint (launcher.max_requeues), a local run with run.resume=auto. "
                    "More engines in service avoid it.")
            write(transport, seq)

        start = time.time()
        self.weights.send_again(step, version, lambda write: self.dispatcher.at_position(
            step, functools.partial(before_first_update, write),
            check=lambda: self.transport.liveness.check(waiting_for="the dispatcher")))
        self.supervisor.back_in_service()
        self.spans.add("sync/weights_again", step=step, start_s=start, end_s=time.time(), policy_version=version)

    def finish(self) -> None:
        self.transport.wait_record(self.transport.key("trainer", "done"), what="the trainer to finish")
        self.factory.stop_hosts()  # the other rollout nodes stop their engine servers and finish

    def stop(self, err: BaseException) -> None:
        """The run stops before its end (pipeline.run_node). Trainer rank 0 says how the attempt ended
        (control/attempt.py), unless it died without a word (killed, its node lost: its heart-beat stopped): then
        the rollout manager writes that outcome in its place, a lost node that a requeue can fix."""
        if not (isinstance(err, PeerGone) and self.transport.liveness.lost_peer == ("trainer", 0)):
            return
        run_dir, key, attempt = self.env.run_dir, self.env.attempt_key, self.env.restart_count
        if read_outcome(run_dir, key, attempt) is not None:
            return
        checkpoint = latest_checkpoint(run_dir)
        write_outcome(run_dir, key, Outcome(
            attempt=attempt, finished=False, requeue=True, last_step=last_metrics_step(run_dir),
            checkpoint_step=-1 if checkpoint is None else checkpoint.step,
            reason=f"{type(err).__name__}: {err} (written by rollout rank 0: trainer rank 0 wrote none)"))

    def close(self) -> None:
        """Stops what waits for something else side by side: each engine's server, the reward calls in progress
        and the evaluation's (a warned job has a margin of seconds to end in, not their sum); then the rest."""
        call_side_by_side({**{engine.name: engine.shutdown for engine in self.engines},
                           "rewards": self.rewards.close, "evaluation": self.evaluation.close})
        self.dispatcher.close()
        for pool in (self.rewards.pool, self.environment):
            if pool is not None:
                pool.close()
        self.spans.flush()


def last_metrics_step(run_dir) -> int:
    """The last step whose metrics record trainer rank 0 wrote whole (-1: none)."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_bytes().split(b"\n") if path.exists() else []
    return max((json.loads(line)["step"] for line in lines[:-1]), default=-1)  # (a cut-off last line is not whole)


def check_context(cfg: Config, prompts: list[Prompt]) -> None:
    """Every prompt plus rollout_max_response_len must fit the model's context, or the engines refuse it."""
    context = context_len(cfg.model)
    longest = max((len(p.input_ids) for p in prompts), default=0)
    if context is not None and longest + cfg.rollout_max_response_len > context:
        raise ConfigError(
            f"the longest prompt ({longest} tokens) + rollout_max_response_len={cfg.rollout_max_response_len} "
            f"exceeds the model's context of {context} tokens (max_position_embeddings): the engines would refuse "
            "its requests. Lower rollout_max_response_len or data.max_prompt_len (longer prompts are refused when "
            "the data is read), or serve a model with a longer context."
        )
