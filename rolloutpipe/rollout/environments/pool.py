"""The environment workers: ``environment.num_workers`` processes that run every ``reset`` and ``step``.

Episodes run concurrently, many per worker; an episode's calls go to one worker (chosen by a hash of its id), which
keeps its environment object between turns, so a stateful environment (a game, a sandbox) lives where it runs.
Calls to one worker take turns; a worker is a JsonWorker (rollout/workers.py): JSON over a pipe, nothing unpickled,
a timeout per call (``environment.timeout_s``).

An environment may have a ``close`` (not part of the Protocol: an adapter's processes, a sandbox); the worker calls it
when the episode ends, whichever side ends it (``end``, ``end_step``).

Nothing is lost with a worker. Each ``step`` call carries the episode's row and every response so far, so a worker
that does not hold the episode (its predecessor timed out or crashed and was replaced) rebuilds it: a fresh object,
``reset`` on the row, the earlier responses replayed, then the new one. Environments are deterministic given the row
and the responses (a seed belongs in the row), as every turn's sample is given its seed. The call that timed out or
crashed ends its own episode (reward 0, ``EpisodeEnd.env_timeout`` / ``env_error``); the other episodes of that
worker go on.

``openings`` resets every data row once when the run starts, before any engine: a row the environment rejects is
named then, in one line, and each row's opening messages join its prompt (base.py: they depend on the row alone).
"""

from __future__ import annotations

import importlib
import json
import math
import multiprocessing
import numbers
import os
import signal
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rolloutpipe.control.lifetime import die_with_parent
from rolloutpipe.rollout.environments.base import Message, Turn, get_environment
from rolloutpipe.rollout.environments.config import EnvironmentConfig
from rolloutpipe.rollout.workers import JsonWorker

MAX_KEPT_EPISODES = 4096
"""Environment objects a worker keeps between turns; the least recently used beyond it are closed (an episode of an
aborted group is closed when its step ends: ``end_step``) and rebuilt by replay if they come back."""


@dataclass(kw_only=True, slots=True)
class StepOutcome:
    turn: Turn | None
    """The environment's answer; None when the call failed."""
    error: str | None = None
    timed_out: bool = False


class EnvPool:
    """Runs environment calls in worker processes (see the module docstring); ``step`` is thread-safe and never
    raises. Call it from threads that live as long as the pool (the reward threads)."""

    def __init__(self, cfg: EnvironmentConfig) -> None:
        self.cfg = cfg
        context = multiprocessing.get_context("spawn")
        self._workers = [JsonWorker(context, serve=_serve, args=(cfg.name, cfg.args, list(cfg.import_modules),
                                                                 os.getpid()), name="rolloutpipe-environment")
                         for _ in range(cfg.num_workers)]
        try:
            for worker in self._workers:
                worker.wait_ready()
        except RuntimeError as err:
            for worker in self._workers:
                worker.kill()
            raise ValueError(f"environment workers could not start (environment.name={cfg.name!r}): {err}") from None
        self._locks = [threading.Lock() for _ in self._workers]
        self._closed = False

    def openings(self, rows: list[tuple[Any, dict[str, Any]]], describe: Callable[[int], str]) -> list[list[Message]]:
        """Each row's opening messages (one ``reset`` each, spread over the workers); ValueError naming the first
        row the environment rejects (``describe(i)``: where row i is, e.g. "data.path line 3")."""
        results: list[list[Message] | None] = [None] * len(rows)
        errors: list[tuple[int, str]] = []

        def run(w: int) -> None:
            for i in range(w, len(rows), len(self._workers)):
                label, metadata = rows[i]
                reply = self._call(w, {"op": "open", "label": label, "metadata": metadata})
                if reply.turn is None:
                    errors.append((i, reply.error or ""))
                    return
                results[i] = reply.turn.messages

        threads = [threading.Thread(target=run, args=(w,), daemon=True) for w in range(len(self._workers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            i, error = min(errors)
            raise ValueError(f"environment {self.cfg.name!r} rejects {describe(i)}: {error}. Fix the row (or remove "
                             "it), or the environment's reset.")
        return [r or [] for r in results]

    def step(self, episode: str, label: Any, metadata: dict[str, Any], responses: list[str]) -> StepOutcome:
        """The environment's answer to ``responses[-1]``, the latest of the episode's model turns."""
        if self._closed:
            return StepOutcome(turn=None, error="the environment pool is closed")
        w = zlib.crc32(episode.encode()) % len(self._workers)
        return self._call(w, {"op": "step", "episode": episode, "label": label, "metadata": metadata,
                              "responses": responses})

    def end(self, episode: str) -> None:
        """The episode ended on our side (turn or token limit): its worker closes its environment now."""
        w = zlib.crc32(episode.encode()) % len(self._workers)
        self._call(w, {"op": "end", "prefix": episode})

    def end_step(self, step: int) -> None:
        """Every episode of ``step`` is over (an aborted group's stop mid-way): close what the workers still keep."""
        for w in range(len(self._workers)):
            self._call(w, {"op": "end", "prefix": f"step={step}/"})

    def _call(self, w: int, request: dict[str, Any]) -> StepOutcome:
        try:
            data = json.dumps(request).encode()
        except (TypeError, ValueError) as err:
            return StepOutcome(turn=None, error=f"the environment's inputs are not JSON data: {err}")
        with self._locks[w]:
            reply = self._workers[w].call(data, self.cfg.timeout_s, what="the environment worker")
        if reply.value is None:
            return StepOutcome(turn=None, error=reply.error, timed_out=reply.timed_out)
        if reply.value.get("error") is not None:
            return StepOutcome(turn=None, error=reply.value["error"])
        turn = reply.value["turn"]
        return StepOutcome(turn=Turn(messages=turn["messages"], reward=turn["reward"], done=turn["done"]))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for lock, worker in zip(self._locks, self._workers):
            with lock:
                worker.stop()


# ---- the worker process -------------------------------------------------------------------------------------------


def _serve(conn, name: str, args: dict[str, Any], import_modules: list[str], parent_pid: int) -> None:
    """Worker process: import, look the environment up, then answer calls one at a time until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the parent decides
    die_with_parent(signal.SIGKILL, parent_pid)
    try:
        for module in import_modules:
            importlib.import_module(module)
        factory = get_environment(name, import_modules)
    except Exception as err:
        conn.send_bytes(json.dumps({"error": f"{type(err).__name__}: {err}"}).encode())
        return
    conn.send_bytes(json.dumps({"ready": True}).encode())
    kept: OrderedDict[str, tuple[Any, int]] = OrderedDict()
    """Episode id -> (its environment, model turns it has seen)."""
    while True:
        try:
            request = json.loads(conn.recv_bytes())
        except EOFError:
            return
        try:
            if request["op"] == "open":
                env = factory(args)
                try:
                    opening = _messages(env.reset(request["label"], request["metadata"]), "reset")
                finally:
                    _close(env)
                reply = {"turn": {"messages": opening, "reward": 0.0, "done": False}}
            elif request["op"] == "end":  # (an episode's id, or a step's prefix)
                for episode in [e for e in kept if e == request["prefix"] or e.startswith(request["prefix"])]:
                    _close(kept.pop(episode)[0])
                reply = {"turn": {"messages": [], "reward": 0.0, "done": True}}
            else:
                reply = {"turn": _step(factory, args, kept, request)}
        except Exception as err:
            reply = {"error": f"{type(err).__name__}: {err}"}
        conn.send_bytes(json.dumps(reply).encode())


def _step(factory, args: dict[str, Any], kept: OrderedDict, request: dict[str, Any]) -> dict[str, Any]:
    episode, responses = request["episode"], request["responses"]
    env, seen = kept.pop(episode, (None, -1))
    try:
        if env is None or seen != len(responses) - 1:  # not here (a replaced worker, or evicted): rebuild by replay
            _close(env)
            env = factory(args)
            env.reset(request["label"], request["metadata"])
            for earlier in responses[:-1]:
                env.step(earlier)
        checked = _turn(env.step(responses[-1]))
    except Exception:
        _close(env)
        raise
    if checked["done"]:
        _close(env)
    else:
        kept[episode] = (env, len(responses))
        while len(kept) > MAX_KEPT_EPISODES:
            _close(kept.popitem(last=False)[1][0])
    return checked


def _close(env: Any) -> None:
    """An environment's optional ``close`` (an adapter's processes, a sandbox); its failure is not the episode's."""
    close = getattr(env, "close", None)
    if close is not None:
        try:
            close()
        except Exception:  # noqa: BLE001 - the episode's outcome is already decided
            pass


def _turn(turn: Any) -> dict[str, Any]:
    """A Turn as JSON data, or TypeError saying what is not what the Protocol asks (base.py)."""
    if not isinstance(turn, Turn):
        raise TypeError(f"step returned {type(turn).__name__}, not a Turn")
    reward = turn.reward
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        raise TypeError(f"step returned the reward {reward!r}, not a finite number")
    return {"messages": [] if turn.done else _messages(turn.messages, "step"), "reward": float(reward),
            "done": bool(turn.done)}


def _messages(messages: Any, verb: str) -> list[Message]:
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise TypeError(f"{verb} returned {repr(messages)[:120]}, not a list of messages with text "
                        "({'role': str, 'content': str})")
    return [{"role": m["role"], "content": m["content"]} for m in messages]
