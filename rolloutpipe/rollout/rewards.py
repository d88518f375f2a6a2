"""Reward functions by name, and the pool of worker processes that runs them.

A reward function is ``fn(response, label, metadata) -> float``: the decoded response (special
tokens skipped), the row's label as it appears in the data, and the row's metadata. Built in:

- ``synthetic``: the reversal task's partial credit (rolloutpipe.rollout.tasks.reversal_reward).
- ``math``: the last ``\\boxed{...}`` (else the text after the last ``Answer:``) checked against
  the label with math-verify: 1 if equivalent, else 0.
- ``gpqa``: the multiple-choice letter the response settles on (last ``Answer: X``, ``\\boxed{X}``
  or ``(X)``) against the label given as a letter, a 0-based index or the answer text.

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
import importlib
import json
import math
import multiprocessing
import numbers
import queue
import re
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from rolloutpipe.rollout.tasks import reversal_reward

WORKER_START_TIMEOUT_S = 60.0
"""How long a worker may take to import its modules; a hang there is a bug in the user's module."""


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


def extract_final_answer(response: str) -> str | None:
    """The last balanced ``\\boxed{...}``'s content, else the rest of the line after the last ``Answer:``."""
    boxed = _last_boxed(response)
    if boxed is not None:
        return boxed
    _, found, after = response.rpartition("Answer:")
    if not found:
        return None
    line = after.strip().split("\n", 1)[0].strip()
    return line or None


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed")
    while start != -1:
        open_at = start + len("\\boxed")
        while open_at < len(text) and text[open_at] == " ":
            open_at += 1
        if open_at < len(text) and text[open_at] == "{":
            depth = 0
            for i in range(open_at, len(text)):
                depth += {"{": 1, "}": -1}.get(text[i], 0)
                if depth == 0:
                    return text[open_at + 1 : i]
        # Unbalanced (a truncated response) or not followed by a brace: try the one before.
        start = text.rfind("\\boxed", 0, start)
    return None


def _math_verify():
    import logging

    from math_verify import parse, verify

    # math-verify warns that its own timeout is off; it has to be (it uses signals, main thread
    # only), and the pool enforces reward.timeout_s instead.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return parse, verify


def _as_math(text: str) -> str:
    # math-verify's LaTeX extraction wants a math environment; bare "x^2+1" would parse as "1".
    return text if "$" in text or "\\boxed" in text else f"${text}$"


@register_reward("math")
def math_reward(response: str, label: Any, metadata: dict[str, Any]) -> float:
    answer = extract_final_answer(response)
    if answer is None:
        return 0.0
    parse, verify = _math_verify()
    gold = parse(_as_math(str(label)), parsing_timeout=None)
    if not gold:
        raise ValueError(f"math-verify cannot parse the label {label!r}; write it as LaTeX or a plain number")
    predicted = parse(_as_math(answer), parsing_timeout=None)
    return 1.0 if verify(gold, predicted, timeout_seconds=None) else 0.0


# ---- gpqa -------------------------------------------------------------------------------------

_CHOICE_PATTERNS = [
    re.compile(r"(?i:answer)\s*:\s*[*_]*\s*\(?([A-Z])\b"),
    re.compile(r"\\boxed\{\s*(?:\\text\{\s*)?\(?([A-Z])\b"),
    re.compile(r"\(([A-Z])\)"),
]


def choice_letters(metadata: dict[str, Any]) -> str:
    """A..D, or as many letters as ``metadata["choices"]`` has options if that is more."""
    return "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[: max(4, len(metadata.get("choices") or []))]


def chosen_letter(response: str, letters: str) -> str | None:
    """The letter of the last ``Answer: X``, ``\\boxed{X}`` or ``(X)`` in the response."""
    found = [
        (match.start(1), match.group(1))
        for pattern in _CHOICE_PATTERNS
        for match in pattern.finditer(response)
        if match.group(1) in letters
    ]
    return max(found)[1] if found else None


def label_letter(label: Any, metadata: dict[str, Any]) -> str:
    """The right letter from a letter label, a 0-based index, or the answer text among ``metadata["choices"]``."""
    letters = choice_letters(metadata)
    if isinstance(label, int) and not isinstance(label, bool) and 0 <= label < len(letters):
        return letters[label]
    if isinstance(label, str):
        text = label.strip()
        if len(text) == 1 and text.upper() in letters:
            return text.upper()
        choices = [str(choice).strip() for choice in metadata.get("choices") or []]
        if text in choices:
            return letters[choices.index(text)]
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
    group (rollout/admission.py, within ``rollout.max_groups_per_step``), so every reward the trainer sees
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
    ``score``.
    """

    def __init__(self, cfg: RewardConfig) -> None:
        self._cfg = cfg
        context = multiprocessing.get_context("spawn")
        workers = [_Worker(cfg, context) for _ in range(cfg.num_workers)]
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
        self._idle: queue.Queue[_Worker] = queue.Queue()
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
            return worker.call(request, self._cfg.timeout_s)
        finally:
            self._idle.put(worker)

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


class _Worker:
    """One worker process and the parent's end of its pipe; restarted in place when it dies or hangs."""

    def __init__(self, cfg: RewardConfig, context) -> None:
        self._cfg = cfg
        self._context = context
        self._start()

    def _start(self) -> None:
        self._conn, child_conn = self._context.Pipe()
        self._process = self._context.Process(
            target=_serve,
            args=(child_conn, self._cfg.name, list(self._cfg.import_modules)),
            name="rolloutpipe-reward",
            daemon=True,
        )
        self._process.start()
        child_conn.close()
        self._ready = False

    def wait_ready(self) -> None:
        """Wait for the worker's imports; RuntimeError with the worker's reason if it cannot serve."""
        if self._ready:
            return
        if not self._conn.poll(WORKER_START_TIMEOUT_S):
            raise RuntimeError(f"a worker did not finish its imports within {WORKER_START_TIMEOUT_S:g} s")
        try:
            reply = json.loads(self._conn.recv_bytes())
        except EOFError:
            self._process.join(1.0)
            raise RuntimeError(f"a worker exited during start-up (exit code {self._process.exitcode})") from None
        if "error" in reply:
            raise RuntimeError(reply["error"])
        self._ready = True

    def call(self, request: bytes, timeout_s: float) -> RewardOutcome:
        start, timed_out = time.monotonic(), False
        try:
            if not self._process.is_alive():
                self.kill()
                self._start()
            self.wait_ready()
            start = time.monotonic()
            self._conn.send_bytes(request)
            if self._conn.poll(timeout_s):
                reply = json.loads(self._conn.recv_bytes())
                return RewardOutcome(reward=reply["reward"], error=reply["error"], elapsed_s=time.monotonic() - start)
            error, timed_out = f"timeout after {timeout_s:g} s", True
        except (EOFError, OSError):
            self._process.join(1.0)
            error = f"the reward worker died (exit code {self._process.exitcode})"
        except Exception as err:  # score never raises: a broken worker costs one sample, not the run
            error = f"the reward worker failed: {type(err).__name__}: {err}"
        self.kill()
        return RewardOutcome(reward=0.0, error=error, timed_out=timed_out, elapsed_s=time.monotonic() - start)

    def kill(self) -> None:
        """Stop the process now; the next ``call`` starts a new one."""
        self._process.kill()
        self._process.join()
        self._conn.close()

    def stop(self) -> None:
        """Let the process exit on end-of-pipe; kill it if it does not."""
        self._conn.close()
        self._process.join(1.0)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()


def _serve(conn, name: str, import_modules: list[str]) -> None:
    """Worker process: import, look the reward up, then answer calls one at a time until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the parent decides
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
