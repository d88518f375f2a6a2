"""Reward functions by name, and the pool of worker processes that runs them.

A reward function is ``fn(response, label, metadata) -> float``: the decoded response (special
tokens skipped), the row's label as it appears in the data, and the row's metadata. Built in:

- ``synthetic``: the reversal task's partial credit (rolloutpipe.rollout.tasks.reversal_reward).
- ``math``: the response's final answer (rolloutpipe.rollout.answers.final_math_answer: after the
  thinking, the last ``Answer:`` line if it follows every ``\\boxed{}``, else all the boxes together)
  checked against the label with math-verify, with its own timeouts on in a worker: 1 if equivalent, else 0.
- ``gpqa``: the option the response answers with (answers.chosen_letter: the last explicit ``Answer: X``
  or boxed letter after the thinking, else the last ``(X)`` mentioned there) against the label given as a
  letter, a 0-based index or the answer text.

A user adds a reward by decorating it with ``@register_reward("name")`` in a module of their own
and listing that module in ``reward.import_modules``; no function is ever loaded by dotted name.

Rewards run in ``reward.num_workers`` persistent processes started with "spawn" (safe from a
process with threads). A worker imports this module and the listed modules, then answers one call
at a time over a Pipe with JSON bytes; callables never cross the pipe. A call that raises, runs
past ``reward.timeout_s``, returns a non-number or kills its worker scores 0 with the reason in
``RewardOutcome.error``; a worker that timed out or died is replaced before its next call. A timeout
is marked as such (``RewardOutcome.timed_out``): it may come from the response or from the machine's
load, which cannot be told apart, so ``reward.on_timeout`` decides whether its group is trained
(``OnTimeout``). An exception, a non-number and a dead worker always score 0.

Worker imports stay light: math-verify (sympy) is imported on the first ``math`` call only.
"""

from __future__ import annotations

import enum
import functools
import importlib
import json
import math
import multiprocessing
import numbers
import os
import queue
import signal
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from rolloutpipe.control.lifetime import die_with_parent
from rolloutpipe.rollout.answers import chosen_letter, final_math_answer, label_math_text
from rolloutpipe.rollout.tasks import reversal_reward
from rolloutpipe.rollout.workers import JsonWorker


class RewardFn(Protocol):
    def __call__(self, response: str, label: Any, metadata: dict[str, Any]) -> float: ...


_REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make ``fn`` the reward called ``name`` (``reward.name``)."""

    def register(fn: RewardFn) -> RewardFn:
        if name in _REWARDS:
            raise ValueError(
                f"reward {name!r} is already registered (by {_REWARDS[name].__module__}); "
                "register yours under another name."
            )
        _REWARDS[name] = fn
        return fn

    return register


def get_reward(name: str) -> RewardFn:
    try:
        return _REWARDS[name]
    except KeyError:
        raise ValueError(
            f"unknown reward {name!r}; known: {sorted(_REWARDS)}. Set reward.name to one of them, or register "
            "yours with @register_reward in a module listed in reward.import_modules."
        ) from None


register_reward("synthetic")(reversal_reward)


# ---- math -------------------------------------------------------------------------------------

_math_call_timeout_s: int | None = None
"""math-verify's own time limit for each of its parse and compare calls, set by a reward worker
(``limit_math_verify_time``); None (the default, and off a main thread) leaves math-verify's timeouts off."""


def limit_math_verify_time(reward_timeout_s: float) -> None:
    """Turn math-verify's own timeouts on, so that one call stays below ``reward_timeout_s``.

    math-verify times its calls with SIGALRM, which only the main thread may use: a reward worker runs its calls
    on its main thread, so it calls this once. A call makes at most three slow math-verify calls (parse the
    label, parse the answer, compare them; the label's parse is cached), so each gets a third of 90% of the
    reward's timeout, in whole seconds (SIGALRM's unit), at least 1. A parse or compare that runs out is
    math-verify's "no answer" or "not equal": the sample scores 0 and the worker lives on; only a reward
    timeout under 3 s can still be reached first (the pool then stops the call as for any slow reward).
    """
    global _math_call_timeout_s
    _math_call_timeout_s = max(1, int(0.9 * reward_timeout_s / 3))


def _math_verify_timeout_s() -> int | None:
    return _math_call_timeout_s if threading.current_thread() is threading.main_thread() else None


@functools.cache
def _math_verify():
    import logging

    from math_verify import parse, verify

    # Off the worker's main thread math-verify runs without its timeouts and warns once that it does.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return parse, verify


@functools.lru_cache(maxsize=256)
def _parse_label(text: str, timeout_s: int | None) -> list:
    parse, _ = _math_verify()
    return parse(text, parsing_timeout=timeout_s)


@register_reward("math")
def math_reward(response: str, label: Any, metadata: dict[str, Any]) -> float:
    answer = final_math_answer(response)
    if answer is None:
        return 0.0
    parse, verify = _math_verify()
    timeout_s = _math_verify_timeout_s()
    gold = _parse_label(label_math_text(label), timeout_s)
    if not gold:
        raise ValueError(f"math-verify cannot parse the label {label!r}; write it as LaTeX or a plain number")
    predicted = parse(answer, parsing_timeout=timeout_s)
    return 1.0 if verify(gold, predicted, timeout_seconds=timeout_s) else 0.0


# ---- gpqa -------------------------------------------------------------------------------------

_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _choices(metadata: dict[str, Any]) -> tuple[str, list[str]]:
    """(letters, their answer texts) of ``metadata["choices"]``: a list (A, B, ... in order) or a dict keyed
    by letter (``{"A": ..., "(B)": ...}``; other keys: A, B, ... in the dict's order). At least A-D."""
    choices = metadata.get("choices") or []
    if isinstance(choices, dict):
        keys = [_letter_of(str(key)) for key in choices]
        texts = [str(text).strip() for text in choices.values()]
        if all(keys) and len(set(keys)) == len(keys):
            ordered = sorted(zip(keys, texts))
            return "".join(k for k, _ in ordered), [t for _, t in ordered]
    else:
        texts = [str(text).strip() for text in choices]
    return _LETTERS[: max(4, len(texts))], texts


def _letter_of(text: str) -> str | None:
    """``C``, ``c``, ``(C)``, ``C.``, ``C)`` -> ``C``; anything else -> None."""
    text = text.strip().rstrip(".):").lstrip("(").strip()
    return text.upper() if len(text) == 1 and text.upper() in _LETTERS else None


def choice_letters(metadata: dict[str, Any]) -> str:
    """A..D, or the letters of ``metadata["choices"]`` if it has more (or is a dict keyed by letter)."""
    return _choices(metadata)[0]


def label_letter(label: Any, metadata: dict[str, Any]) -> str:
    """The right letter from a label: a letter (``C``, ``(C)``), a 0-based index (``2``, ``"2"``, ``2.0``), or
    the answer text among ``metadata["choices"]`` (checked before a numeric string is taken for an index)."""
    letters, texts = _choices(metadata)
    index: Any = None
    if isinstance(label, bool):
        pass
    elif isinstance(label, int):
        index = label
    elif isinstance(label, float) and label.is_integer():
        index = int(label)
    elif isinstance(label, str):
        text = label.strip()
        letter = _letter_of(text)
        if letter is not None and letter in letters:
            return letter
        if text in texts:
            return letters[texts.index(text)]
        if text.isdigit():
            index = int(text)
    if index is not None and 0 <= index < len(letters):
        return letters[index]
    raise ValueError(
        f"label {label!r} is not a letter {letters[0]}-{letters[-1]}, a 0-based index below {len(letters)} "
        "or one of metadata['choices']"
    )


@register_reward("gpqa")
def gpqa_reward(response: str, label: Any, metadata: dict[str, Any]) -> float:
    right = label_letter(label, metadata)
    return 1.0 if chosen_letter(response, choice_letters(metadata)) == right else 0.0


# ---- the pool ---------------------------------------------------------------------------------


class OnTimeout(enum.Enum):
    """What a reward call that runs past ``reward.timeout_s`` does to its sample's group."""

    zero = "zero"
    """The sample scores 0 and its group is trained with it (veRL's prime reward manager does this): no
    rollout work is lost, but the reward then depends on the machine's load, and a right answer scored 0
    gets a negative advantage against its group."""
    drop_group = "drop_group"
    """The group is not trained: it is dropped and replaced as dynamic sampling drops a zero-variance
    group (rollout/schedule.py, within ``rollout.max_groups_per_step``), so every reward the trainer sees
    is one the reward function returned. Costs the group's generation and one more group's."""


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    name: str = "synthetic"
    """A registered reward: synthetic, math, gpqa, or one registered by ``import_modules``."""
    timeout_s: float = 10.0
    """A call running longer is stopped (its worker is replaced) and ``on_timeout`` decides what follows."""
    on_timeout: OnTimeout = OnTimeout.drop_group
    """``drop_group`` (default): the sample's group is not trained, and another group takes its place;
    ``zero``: the sample scores 0 and is trained. The default keeps every trained reward one the reward
    function returned: a timeout says how busy the reward worker was, not how good the response is, and
    training it as 0 (a wrong label, a negative advantage for a right answer) lets the machine's load change
    the rewards a run trains on, so the same seed on a busier machine trains other rewards for the same
    samples. Under ``drop_group`` load can change which prompts a step trains (the replacement), never a
    reward value, and no short batch is trained. The price is the group's generation and a replacement's,
    small while timeouts are rare; timed-out samples still count toward ``max_failure_fraction``, so a
    reward that mostly times out stops the run rather than replacing group after group, and a step that
    cannot be refilled within ``rollout.max_groups_per_step`` stops with the count of groups dropped.
    ``zero`` is what veRL does (its prime reward manager scores a timed-out row 0.0 and trains it)."""
    num_workers: int = 1
    import_modules: list[str] = field(default_factory=list)
    """Modules each worker imports before serving, so that their @register_reward rewards exist."""
    max_failure_fraction: float = 0.5
    """The run stops, rather than train on garbage, once more than this fraction of a step's samples
    have failed rewards (exceptions, timeouts, non-numbers)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_failure_fraction <= 1.0:
            raise ValueError(f"reward.max_failure_fraction={self.max_failure_fraction} must be in [0, 1].")
        if not self.timeout_s > 0:
            raise ValueError(f"reward.timeout_s={self.timeout_s} must be positive (seconds per reward call).")
        if self.num_workers < 1:
            raise ValueError(f"reward.num_workers={self.num_workers} must be at least 1.")


@dataclass(kw_only=True, slots=True)
class RewardOutcome:
    reward: float
    error: str | None
    """Why the reward is 0 when the call failed: exception, timeout, non-number or worker death."""
    timed_out: bool = False
    """The call ran past ``reward.timeout_s`` (``error`` says so too); ``reward.on_timeout`` decides."""
    elapsed_s: float
    """From sending the call to its answer (worker start-up excluded)."""


class RewardPool:
    """Scores responses in ``cfg.num_workers`` worker processes; ``score`` is thread-safe and never raises.

    Each call takes an idle worker (waiting for one if all are busy), so a worker serves one call
    at a time. ``close`` waits for calls in flight, then stops the workers; call it after the last
    ``score``. A worker dies with this process (control/lifetime.py), or with the thread that started it, which
    is the one that made the pool or, for a replaced worker, the one whose ``score`` replaced it: call ``score``
    from threads that live as long as the pool (the reward threads, the eval scoring thread).
    """

    def __init__(self, cfg: RewardConfig) -> None:
        self._cfg = cfg
        context = multiprocessing.get_context("spawn")
        workers = [JsonWorker(context, serve=_serve, args=(cfg.name, list(cfg.import_modules), cfg.timeout_s,
                                                           os.getpid()), name="rolloutpipe-reward")
                   for _ in range(cfg.num_workers)]
        try:
            for worker in workers:
                worker.wait_ready()
        except RuntimeError as err:
            for worker in workers:
                worker.kill()
            raise ValueError(
                f"reward workers could not start (reward.name={cfg.name!r}, "
                f"reward.import_modules={list(cfg.import_modules)}): {err}"
            ) from None
        self._idle: queue.Queue[JsonWorker] = queue.Queue()
        for worker in workers:
            self._idle.put(worker)
        self._closed = False

    def score(self, response: str, label: Any, metadata: dict[str, Any]) -> RewardOutcome:
        if self._closed:
            return RewardOutcome(reward=0.0, error="the reward pool is closed", elapsed_s=0.0)
        try:
            request = json.dumps({"response": response, "label": label, "metadata": metadata}).encode()
        except (TypeError, ValueError) as err:
            return RewardOutcome(reward=0.0, error=f"the reward's inputs are not JSON data: {err}", elapsed_s=0.0)
        worker = self._idle.get()
        try:
            reply = worker.call(request, self._cfg.timeout_s, what="the reward worker")
        finally:
            self._idle.put(worker)
        if reply.value is None:
            return RewardOutcome(reward=0.0, error=reply.error, timed_out=reply.timed_out, elapsed_s=reply.elapsed_s)
        return RewardOutcome(reward=reply.value["reward"], error=reply.value["error"], elapsed_s=reply.elapsed_s)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for _ in range(self._cfg.num_workers):
            self._idle.get().stop()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _serve(conn, name: str, import_modules: list[str], timeout_s: float, parent_pid: int) -> None:
    """Worker process: import, look the reward up, then answer calls one at a time until the pipe closes.

    Calls run on this process's main thread, where math-verify's signal-based timeouts work.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the parent decides
    # the pipe's end tells an idle worker that its parent is gone, but not one stuck in a reward call
    die_with_parent(signal.SIGKILL, parent_pid)
    limit_math_verify_time(timeout_s)
    try:
        for module in import_modules:
            importlib.import_module(module)
        fn = get_reward(name)
    except Exception as err:
        conn.send_bytes(json.dumps({"error": f"{type(err).__name__}: {err}"}).encode())
        return
    conn.send_bytes(json.dumps({"ready": True}).encode())
    while True:
        try:
            request = json.loads(conn.recv_bytes())
        except EOFError:
            return
        conn.send_bytes(json.dumps(_call(fn, request)).encode())


def _call(fn: RewardFn, request: dict[str, Any]) -> dict[str, Any]:
    try:
        value = fn(request["response"], request["label"], request["metadata"])
    except Exception as err:
        return {"reward": 0.0, "error": f"{type(err).__name__}: {err}"}
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        shown = f"{repr(value)[:200]} ({type(value).__name__})"
        return {"reward": 0.0, "error": f"the reward returned {shown}, not a finite number"}
    return {"reward": float(value), "error": None}
