"""Engine failure: a request whose engine dies or hangs is generated again elsewhere, and nothing is lost.

An engine fails when its ``error`` is set (its scheduler thread raised, its server process exited, an HTTP call
failed) or, with ``rollout.request_timeout_s``, when it holds requests and hands none back for that long. Then:

1. Admission takes it out of service and puts its unfinished requests back in line, unchanged: same request id,
   same ``sampling_seed``. Every engine serves the same policy_version, and a sample's tokens depend only on its
   seed and the weights, so the retried sample is the one the failed engine would have produced: the step's
   samples, and hence the update, are those of a run without the failure.
2. The failed engine is retired (``shutdown`` in a thread of its own: a hung engine must not block the loop) and
   a fresh one is built in its slot under a new name (``engine0-restart1``); it loads the current policy
   version's weights before it is put back into service. Results of the failed one that still arrive name it,
   not the replacement, and Admission ignores them, so no sample is counted twice.
3. A slot that fails more than ``rollout.max_engine_failures`` times stops the run with the engine's name and
   where its log is.

An engine on another rollout node (rollout/engines/hosts.py) is restarted by its host: step 2 becomes a request to it,
and the slot is out of service until the host registers the fresh engine (``check`` polls for it; the loop goes
on meanwhile). A lost host (its heart-beat stopped) retires its engines' slots, and the run goes on while
``rollout.min_engines`` engines remain in service or on their way back. A host whose heart-beat only stalled (a
node paused, a network partition healed) beats again, picks up the restart requests it missed and registers
fresh engines: ``check`` keeps polling the retired slots, and each comes back into service with the current
policy, as after a restart.

With ``pipeline.weight_sync=distributed`` (control/weights/distributed.py) the engines form one process group with
trainer rank 0, whose membership is fixed when it forms: the replacement cannot join it, nor load the current policy
from a file (unless no broadcast brought it: the model's own weights, policy 0, or a resumed run's file; it then
serves at once). Step 2 then differs: the replacement waits out of service for the rest of the step (the others take
its requests); where it replaced the last engine in service, trainer rank 0 sends the current policy again, to it
alone (``stranded``). At the step boundary (``next_group_size``) every engine's server is asked whether it is still
there, so one that died idle is replaced now and not found by the broadcast; if a member failed or a replacement waits,
trainer rank 0 forms a new group, and the engines in service and the replacements join it (``rejoin_weight_group``)
and receive the next policy together. An engine of another rollout node that is still restarting, or whose host is
lost, is left out; it waits as above once its host has registered it, and joins the group after that. The group's
ranks follow the engines in slot order, so a slot out of service leaves no gap. An engine that dies during the
broadcast breaks it for every member: the others are told to leave the group, the dead one (and one stuck in the
broken collective) is recovered as above, and ``load_weights_distributed`` says the policy must go again, to the
new group (``next_group_size``).

The supervisor has no thread: the rollout loop calls ``check`` every poll and ``load_weights`` between steps.
The restart runs on that loop (seconds for a server process), while the other engines keep generating what
they hold; requests wait in Admission until an engine is in service again. Each recovery is logged (warning)
and recorded as a ``rollout/engine_restart`` span.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from rolloutpipe.control.weights.buckets import Bucket, BucketMac, WeightGroup
from rolloutpipe.observe.metrics import SpanRecorder
from rolloutpipe.rollout.admission import Admission
from rolloutpipe.rollout.engines.base import Engine, HoldsWeightsInProcess
from rolloutpipe.types import GenerationResult

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

LEAVE_GRACE_S = 30.0
"""How long an engine may take to give up a broadcast that a dead member broke (``load_weights_distributed``)."""


class EngineFailed(RuntimeError):
    """An engine failed more often than ``rollout.max_engine_failures`` allows, or could not be restarted."""


class EngineSupervisor:
    """Watches the engines and recovers a failed one (see module docstring).

    ``engines`` is the rollout node's list of the engines in service; a failed engine is replaced in it, in
    place, so Admission and Evaluation (which hold the same list) see the replacement; one restarting on another
    node is out of the list until it is back, a retired one until its host beats again. ``restart(slot, name,
    failed)`` builds a
    fresh engine serving policy_version 0, or returns a pending restart (``poll()``: the engine once it is up);
    ``where_to_look(engine)`` says where its log is.
    """

    def __init__(self, *, engines: list[Engine], restart: Callable[[int, str, Engine], Engine],
                 where_to_look: Callable[[Engine], str], max_failures: int, request_timeout_s: float | None,
                 spans: SpanRecorder, check_peers: Callable[[str], None] = lambda what: None,
                 min_engines: int = 1) -> None:
        self.engines = engines
        self.min_engines = min_engines
        self.restart = restart
        self.where_to_look = where_to_look
        self.max_failures = max_failures
        self.request_timeout_s = request_timeout_s
        self.spans = spans
        self.check_peers = check_peers
        """Raises when the run is aborted or a peer is gone (transport.Liveness.check), while engines join or receive
        a broadcast: those calls wait for trainer rank 0."""
        self.weights: tuple[str, int] | None = None
        """The path and policy_version every engine serves; None: the model's own weights (policy_version 0)."""
        self.weight_group: WeightGroup | None = None
        """With distributed weight sync: the process group every engine joined (``join_weight_group``)."""
        self.policy_version = 0
        """What the engines serve."""
        self._awaiting_group: dict[int, tuple[_Pending, Engine]] = {}
        """Distributed weight sync: slots whose replacement waits for the next group, out of service."""
        self._member_failed = False
        """Distributed weight sync: an engine of the current group failed (it cannot broadcast to it again)."""
        self.sends_again = False
        """Distributed weight sync: whether trainer rank 0 may send the current policy again mid-step (rollout/node.py
        sets it: ``stranded``); else the last engine in service failing mid-step stops the run."""
        self._back_mid_step: list[tuple[Engine, Engine]] = []
        """Failed engines and the replacements that received the current policy mid-step (``back_in_service``)."""
        self._at_boundary = False
        """Distributed weight sync: the engines are between steps, about to join a new group and receive a policy
        (``_between_steps``)."""
        self.num_failures = [0] * len(engines)
        self._names = [e.name for e in engines]
        self._slot_of = {e.name: slot for slot, e in enumerate(engines)}
        """Each incarnation's slot (its index at the start; the list's order changes when an engine is out)."""
        self._pending: dict[int, _Pending] = {}
        """Slots whose engine is restarting on another node."""
        self._retired: dict[int, _Pending] = {}
        """Slots whose host is lost; their restart is polled again in case the host beats again."""
        self._last_progress_s: dict[str, float] = {}
        """Per engine name: when it last handed a result back or was seen holding nothing."""
        self._admission: Admission | None = None
        self.step = 0
        self.also_held: Callable[[Engine], int] = lambda engine: 0
        """Requests an engine holds that Admission does not count (evaluation.py's), for the hang check."""

    def begin_step(self, step: int, admission: Admission) -> None:
        self.step, self._admission = step, admission
        now = time.monotonic()
        self._last_progress_s = {e.name: now for e in self.engines}  # idle between steps is not hung

    def on_result(self, result: GenerationResult) -> None:
        """A counted result (engine thread): its engine made progress."""
        self._last_progress_s[result.engine] = time.monotonic()

    def check(self) -> None:
        """Recover every engine that failed since the last check, and put back those restarted elsewhere (the
        rollout loop, every poll)."""
        for engine in list(self.engines):
            if (reason := self._failure(engine)) is not None:
                self._recover(self._slot_of[engine.name], engine, reason)
        for slot, pending in list(self._pending.items()):
            self._poll(slot, pending)
        for slot, pending in list(self._retired.items()):
            self._poll(slot, pending)

    @property
    def retired(self) -> list[str]:
        """Base names of the slots out of service while their host is lost."""
        return [self._names[slot] for slot in self._retired]

    def load_weights(self, path: str, policy_version: int) -> None:
        """Serve ``policy_version`` on every engine from now on (between steps); an engine that fails is replaced.
        One restarting on another node loads it when it is back."""
        self.weights, self.policy_version = (path, policy_version), policy_version
        self._load_each(policy_version, lambda engine: engine.update_weights_from_disk(path, policy_version))

    @contextmanager
    def weights_in_place(self, path: str, policy_version: int) -> Iterator[list[dict[str, torch.Tensor]] | None]:
        """Where every engine runs in this process (the embedded engine): their state dicts, held between steps for
        the weights file at ``path`` to fill in one read (control/weights/disk.py ``copy_checked``); they serve
        ``policy_version`` once the block ends without an error. A failed engine is replaced, as in
        ``load_weights``; its replacement reads the file itself. None where they do not run here."""
        if not self.engines or not all(isinstance(engine, HoldsWeightsInProcess) for engine in self.engines):
            yield None
            return
        self.weights, self.policy_version = (path, policy_version), policy_version
        with ExitStack() as held:
            destinations: list[dict[str, torch.Tensor]] = []
            self._load_each(policy_version,
                            lambda engine: destinations.append(held.enter_context(engine.weights_in_place(
                                policy_version))))
            yield destinations

    def _load_each(self, policy_version: int, load: Callable[[Engine], None]) -> None:
        """``load`` on every engine in turn; one that failed before, or whose load raises, is replaced."""
        for engine in list(self.engines):
            reason = self._failure(engine)
            if reason is None:
                try:
                    load(engine)
                    continue
                except Exception as err:  # noqa: BLE001 - e.g. its server died during the load: one more failure
                    reason = f"loading policy_version {policy_version} failed: {err!r}"
            self._recover(self._slot_of[engine.name], engine, reason)

    def join_weight_group(self, group: WeightGroup, ranks_per_engine: int) -> None:
        """Every engine in service joins trainer rank 0's weight-update group, the i-th in slot order as ranks
        1 + i * ranks_per_engine .. (at the start, engine i). The calls run at once (each returns only when the
        whole group has formed)."""
        self.weight_group, self._member_failed = group, False
        slots = sorted(self._slot_of[engine.name] for engine in self.engines)
        first_rank = {slot: 1 + i * ranks_per_engine for i, slot in enumerate(slots)}
        self._on_every_engine(f"the engines to join the weight-update group at {group.master_address}:"
                              f"{group.master_port}",
                              lambda slot, engine: engine.init_weights_update_group(group, first_rank[slot]))

    def load_weights_distributed(self, buckets: list[Bucket], policy_version: int,
                                 macs: Callable[[int], BucketMac] | None) -> bool:
        """Serve ``policy_version`` on every engine from trainer rank 0's broadcast of ``buckets``, each checked
        against its MAC where the engine can (between steps). False if an engine died during the broadcast: it is
        recovered, the others give it up (``leave_weight_group``), and the policy must go again to a new group; an
        engine that does not give it up within ``LEAVE_GRACE_S`` is recovered too (it is stuck in the broken
        broadcast). Any other failure stops the run."""
        group_name = self.weight_group.group_name
        what = f"the engines to receive policy_version {policy_version}"
        calls = self._start_on_every_engine(lambda slot, engine: engine.update_weights_from_distributed(
            buckets, group_name, policy_version, macs))
        left_at, probed = None, set()
        while any(thread.is_alive() for thread, _ in calls.values()):
            self.check_peers(what)
            failed = [e for e, (_, error) in calls.items() if error and e.name not in probed]
            probed.update(e.name for e in failed)
            if left_at is None and failed and self._died(failed):
                left_at = time.monotonic()
                for engine, (thread, _) in calls.items():
                    if thread.is_alive():
                        engine.leave_weight_group(group_name)
            if left_at is not None and time.monotonic() - left_at > LEAVE_GRACE_S:
                break
            time.sleep(0.05)
        errors = {e.name: error[0] for e, (_, error) in calls.items() if error}
        if not errors and left_at is None:
            self.policy_version = policy_version
            return True
        if left_at is None and not self._died([e for e in calls if e.name in errors]):
            self._raise_for(errors, what)
        self._member_failed = True  # the group is broken, whoever died
        for engine, (thread, _) in calls.items():
            if engine.error is not None or thread.is_alive():
                reason = (repr(engine.error) if engine.error is not None else
                          f"it did not give up the broken broadcast of policy_version {policy_version} within "
                          f"{LEAVE_GRACE_S:g}s: stuck")
                log.warning("engine %s failed during the broadcast of policy_version %d (%s); the others gave it up "
                            "and receive the policy again, with its replacement, in a new weight-update group",
                            engine.name, policy_version, reason)
                with self._between_steps():
                    self._recover(self._slot_of[engine.name], engine, reason)
        return False

    @contextmanager
    def _between_steps(self) -> Iterator[None]:
        """Around a recovery at the step boundary, before a new group receives a policy: the replacement joins that
        group now, so the last engine in service may be the one replaced (``_await_group``)."""
        self._at_boundary = True
        try:
            yield
        finally:
            self._at_boundary = False

    def _died(self, engines: list[Engine]) -> bool:
        """Whether any of ``engines`` (whose weight-update call failed) is gone: its server answers no probe."""
        for engine in engines:
            engine.probe()
        return any(engine.error is not None for engine in engines)

    def next_group_size(self) -> int | None:
        """Before a policy is broadcast: every engine in service is asked whether its server is still there (one
        that died idle, on another node above all, is found now, not by the broadcast) and those that are not are
        recovered; then how many engines a new weight-update group needs: those in service and the replacements
        waiting. None: the current group serves (none of its members failed, no replacement waits)."""
        probes = [threading.Thread(target=engine.probe, name=f"probe-{engine.name}", daemon=True)
                  for engine in self.engines]
        for probe in probes:
            probe.start()
        for probe in probes:
            probe.join()
        with self._between_steps():
            self.check()
        if not self._member_failed and not self._awaiting_group:
            return None
        return len(self.engines) + len(self._awaiting_group)

    def rejoin_weight_group(self, group: WeightGroup, ranks_per_engine: int, policy_version: int | None = None
                            ) -> None:
        """Between steps: the replacements that waited come into service, and every engine joins ``group`` (trainer
        rank 0's new one, sized by ``next_group_size``) to receive the next policy. Mid-step (``stranded``): the
        replacements alone join it, to receive the current ``policy_version`` again; they take requests once it has
        loaded (``back_in_service``)."""
        awaiting, self._awaiting_group = self._awaiting_group, {}
        for slot, (failure, replacement) in sorted(awaiting.items()):
            self.engines.append(replacement)
            self._slot_of[replacement.name] = slot
            self._last_progress_s[replacement.name] = time.monotonic()
        self.join_weight_group(group, ranks_per_engine)
        version = self.policy_version + 1 if policy_version is None else policy_version
        for slot, (failure, replacement) in sorted(awaiting.items()):
            log.warning("engine %s restarted as %s in %.1fs; it joined the new weight-update group and receives "
                        "policy_version %d%s.", failure.failed.name, replacement.name, time.time() - failure.start_s,
                        version, " with the others" if policy_version is None else ", sent again mid-step")
            self.spans.add("rollout/engine_restart", step=self.step, start_s=failure.start_s, end_s=time.time(),
                           engine=failure.failed.name, replacement=replacement.name, num_retried=failure.num_retried,
                           reason=failure.reason, policy_version=version)
            if policy_version is not None:
                self._back_mid_step.append((failure.failed, replacement))

    def replacements_waiting(self) -> list[str]:
        return [replacement.name for _, replacement in self._awaiting_group.values()]

    def _on_every_engine(self, what: str, call: Callable[[int, Engine], None]) -> None:
        """``call`` on every engine at once, one thread each; any failure stops the run (see module docstring)."""
        calls = self._start_on_every_engine(call)
        for thread, _ in calls.values():
            while thread.is_alive():
                self.check_peers(what)
                thread.join(timeout=0.5)
        if errors := {e.name: error[0] for e, (_, error) in calls.items() if error}:
            self._raise_for(errors, what)

    def _start_on_every_engine(self, call: Callable[[int, Engine], None]
                               ) -> dict[Engine, tuple[threading.Thread, list[BaseException]]]:
        """``call`` on every engine at once, one thread each: per engine, its thread and the error it raised (if)."""
        calls: dict[Engine, tuple[threading.Thread, list[BaseException]]] = {}

        def run(slot: int, engine: Engine) -> None:
            try:
                call(slot, engine)
            except Exception as err:  # noqa: BLE001 - reported by the caller with the engine's name
                calls[engine][1].append(err)

        for engine in self.engines:
            calls[engine] = (threading.Thread(target=run, args=(self._slot_of[engine.name], engine),
                                              name=f"weights-{engine.name}", daemon=True), [])
        for thread, _ in calls.values():
            thread.start()
        return calls

    def _raise_for(self, errors: dict[str, BaseException], what: str) -> None:
        name, err = next(iter(errors.items()))
        engine = next(e for e in self.engines if e.name == name)
        raise EngineFailed(f"weight sync failed on {sorted(errors)} (waiting for {what}): {name}: {err}. With "
                           f"pipeline.weight_sync=distributed this stops the run. Look at "
                           f"{self.where_to_look(engine)}") from err

    def _failure(self, engine: Engine) -> str | None:
        if engine.error is not None:
            return repr(engine.error)
        if self.request_timeout_s is None or self._admission is None:
            return None
        now = time.monotonic()
        if (num_held := self._admission.num_held(engine) + self.also_held(engine)) == 0:
            self._last_progress_s[engine.name] = now
            return None
        idle_s = now - self._last_progress_s.setdefault(engine.name, now)
        if idle_s <= self.request_timeout_s:
            return None
        return (f"it holds {num_held} requests and handed none back for {idle_s:.1f}s "
                f"(rollout.request_timeout_s={self.request_timeout_s:g}): hung")

    def _recover(self, slot: int, failed: Engine, reason: str) -> None:
        self.num_failures[slot] += 1
        num = self.num_failures[slot]
        base = self._names[slot]
        if num > self.max_failures:
            raise EngineFailed(
                f"engine {failed.name} failed: {reason}. That is failure {num} of engine {base}, more than "
                f"rollout.max_engine_failures={self.max_failures}; stopping the run. Look at "
                f"{self.where_to_look(failed)}")
        start = time.time()
        num_retried = self._admission.take_out(failed) if self._admission is not None else 0
        log.warning("engine %s failed (%s): %d unfinished requests resubmitted with their seeds (failure %d of "
                    "engine %s, rollout.max_engine_failures=%d). See %s.", failed.name, reason, num_retried, num, base,
                    self.max_failures, self.where_to_look(failed))
        threading.Thread(target=failed.shutdown, name=f"retire-{failed.name}", daemon=True).start()
        failure = _Pending(failed=failed, reason=reason, start_s=start, num_retried=num_retried, restart=None)
        try:
            replacement = self.restart(slot, f"{base}-restart{num}", failed)
        except Exception as err:
            raise EngineFailed(f"engine {failed.name} failed ({reason}) and its restart failed: {err}. Look at "
                               f"{self.where_to_look(failed)}") from err
        if self.weight_group is not None:
            self._member_failed = True
        if hasattr(replacement, "poll"):  # on another node: out of service until its host has it up
            self.engines.remove(failed)
            failure.restart = replacement
            self._pending[slot] = failure
            log.warning("engine %s: its node's engine host restarts it as %s; out of service until then.", failed.name,
                        f"{base}-restart{num}")
            self._check_enough(f"engine {failed.name} failed ({reason}) and is restarting on its node")
            return
        if self.weight_group is not None:  # waits for the next group (module docstring)
            self._await_group(slot, failure, replacement)
            return
        self._put_back(slot, failure, replacement)

    def _poll(self, slot: int, pending: _Pending) -> None:
        """A slot restarting on another node, or retired with its host: back in service once the host registered
        the fresh engine; retired while the host is lost."""
        from rolloutpipe.rollout.engines.hosts import HostLost

        try:
            replacement = pending.restart.poll()
        except HostLost as lost:
            if slot in self._pending:  # newly lost (a retired slot stays retired, quietly)
                del self._pending[slot]
                self._retired[slot] = pending
                log.warning("engine %s is out of service until its host beats again: %s. Its requests went to the "
                            "other engines; %d engines remain in service (rollout.min_engines=%d).", self._names[slot],
                            lost, len(self.engines), self.min_engines)
                self.spans.add("rollout/engine_lost", step=self.step, start_s=pending.start_s, end_s=time.time(),
                               engine=pending.failed.name, reason=str(lost))
                self._check_enough(f"engine {pending.failed.name} is lost: {lost}")
            return
        except Exception as err:
            raise EngineFailed(f"engine {pending.failed.name} failed ({pending.reason}) and its restart failed: {err}. "
                               f"Look at {self.where_to_look(pending.failed)}") from err
        if replacement is not None:
            if self._retired.pop(slot, None) is not None:
                log.warning("engine %s: its host beats again and registered %s.", self._names[slot], replacement.name)
            self._pending.pop(slot, None)
            if self.weight_group is not None:
                self._await_group(slot, pending, replacement)
                return
            self.engines.append(replacement)
            self._put_back(slot, pending, replacement)

    def _put_back(self, slot: int, failure: _Pending, replacement: Engine) -> None:
        failed = failure.failed
        try:
            if self.weights is not None:
                replacement.update_weights_from_disk(*self.weights)
        except Exception as err:
            raise EngineFailed(f"engine {failed.name} failed ({failure.reason}) and its restart failed: {err}. Look "
                               f"at {self.where_to_look(failed)}") from err
        if failed in self.engines:
            self.engines[self.engines.index(failed)] = replacement
        self._slot_of[replacement.name] = slot
        self._last_progress_s[replacement.name] = time.monotonic()
        if self._admission is not None:
            self._admission.put_back(failed, replacement)
        version = 0 if self.weights is None else self.weights[1]
        log.warning("engine %s restarted as %s in %.1fs, serving policy_version %d.", failed.name, replacement.name,
                    time.time() - failure.start_s, version)
        self.spans.add("rollout/engine_restart", step=self.step, start_s=failure.start_s, end_s=time.time(),
                       engine=failed.name, replacement=replacement.name, num_retried=failure.num_retried,
                       reason=failure.reason, policy_version=version)

    def _await_group(self, slot: int, failure: _Pending, replacement: Engine) -> None:
        """Distributed weight sync: the replacement cannot join the group; unless it serves at once without the
        trainer (mid-step), it waits out of service for the next new group (``rejoin_weight_group``: at once between
        steps), or, where it was the last engine in service mid-step, for the policy sent again (``stranded``)."""
        failed = failure.failed
        # Mid-step, the model's own weights (policy 0, never sent) or the file the policy came from (a resumed run's
        # first): the replacement serves them at once; a member failed, so the next policy goes to a new group with it
        if not self._at_boundary and self.policy_version == (0 if self.weights is None else self.weights[1]):
            if failed not in self.engines:  # (restarted on another node)
                self.engines.append(replacement)
            self._put_back(slot, failure, replacement)
            return
        if failed in self.engines:
            self.engines.remove(failed)
        if not self.engines and not self._at_boundary and not self.sends_again:
            raise EngineFailed(
                f"engine {failed.name} failed: {failure.reason}. It was the last engine in service, and with "
                "pipeline.weight_sync=distributed its replacement can serve only from the next step's weights, which "
                "wait for this step's samples; stopping the run. Resume it (run.resume=auto), or run more engines. "
                f"Look at {self.where_to_look(failed)}")
        self._awaiting_group[slot] = (failure, replacement)
        self._check_enough(f"engine {failed.name} failed ({failure.reason}) and its replacement waits for the next "
                           "step's weights")
        log.warning("engine %s: its replacement %s waits out of service for the next weight-update group (trainer "
                    "rank 0 forms it before policy_version %d).", failed.name, replacement.name,
                    self.policy_version + 1)

    def stranded(self) -> str | None:
        """With ``sends_again``, mid-step: no engine in service and replacements waiting; the name of the engine that
        failed last. The rollout node then has trainer rank 0 send the current policy again, to the replacements
        alone (distributed.py ``Receiver.send_again``), and puts them back (``back_in_service``)."""
        if self.engines or not self._awaiting_group or self._at_boundary or not self.sends_again:
            return None
        return next(reversed(self._awaiting_group.values()))[0].failed.name

    def back_in_service(self) -> None:
        """The replacements that received the current policy mid-step (``rejoin_weight_group``) take requests."""
        for failed, replacement in self._back_mid_step:
            self._admission.put_back(failed, replacement)
        self._back_mid_step = []

    def _check_enough(self, what: str) -> None:
        """Stop the run when fewer than rollout.min_engines engines are in service or on their way back."""
        if (num := len(self.engines) + len(self._pending) + len(self._awaiting_group)) < self.min_engines:
            raise EngineFailed(f"{what}; {num} engines remain, fewer than rollout.min_engines={self.min_engines}: "
                               "stopping the run. Resume it (run.resume=auto) once the rollout nodes are back.")


@dataclass(kw_only=True, slots=True)
class _Pending:
    """A failure being recovered: the failed engine, why, and (on another node) its restart in progress."""

    failed: Engine
    reason: str
    start_s: float
    num_retried: int
    restart: object | None
