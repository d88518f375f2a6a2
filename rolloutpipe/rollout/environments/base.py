"""What an environment is: an object with two verbs, ``reset`` and ``step``, driving one episode.

An episode starts from a data row and alternates model turns and environment turns (a tool's output, a game's next
state, a user's feedback) until the environment says it is done, or the turn or token limit ends it. The rollout
node never sees text go back into the engine: the model's turns are the engine's own token ids, and each environment
turn is rendered with the model's chat template and tokenized once (episodes.py). The episode's reward is the sum of
its turns' rewards.

An environment runs in a worker process (pool.py), one episode per object: ``reset`` is called once per episode
with the row's label and metadata, then ``step`` once per model turn with that turn's text. A factory registered
under a name (``@register_environment("name")``) makes one object per episode from ``environment.args``. Our own
environments and each package's adapter (gymnasium_env.py, verifiers_env.py) sit side by side behind this one
Protocol; the rollout loop never knows which it drives. A user's environment lives in a module listed in
``environment.import_modules``; no function is ever loaded by dotted name.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

Message = dict[str, str]
"""One chat message: ``{"role": "user" | "tool" | "system" | ..., "content": "<text>"}``."""


@dataclass(kw_only=True, slots=True)
class Turn:
    """The environment's answer to one model turn."""

    messages: list[Message] = field(default_factory=list)
    """Its reply, appended to the conversation before the next model turn (the model's chat template, tokenized
    once: episodes.py). Ignored when ``done``."""
    reward: float = 0.0
    """This turn's reward; the episode's reward is the sum over its turns (a final reward: 0 until the last)."""
    done: bool = False
    """The episode is over (solved, failed, or the game ended)."""


class Environment(Protocol):
    """One episode's environment (see the module docstring). Runs in a worker process; every value it returns
    crosses a pipe as JSON, so messages are strings and rewards are numbers."""

    def reset(self, label: Any, metadata: dict[str, Any]) -> list[Message]:
        """Start an episode on a data row (its ``label`` and ``metadata`` as in the data set). Returns the messages
        that open the conversation after the row's prompt, often none. They must depend on the row alone (every
        sample of a group answers one prompt), and they are read once per row when the run starts, so a row the
        environment cannot take is named before any engine starts: raise ``ValueError`` saying why."""
        ...

    def step(self, response: str) -> Turn:
        """The model's turn (its text, special tokens skipped): what the environment answers. An exception or a
        call past ``environment.timeout_s`` ends the episode with reward 0, counted (pool.py)."""
        ...


EnvironmentFactory = Callable[[dict[str, Any]], Environment]
"""Makes one episode's environment from ``environment.args``."""

_ENVIRONMENTS: dict[str, EnvironmentFactory] = {}

ADAPTERS: dict[str, tuple[str, str, str]] = {
    "gymnasium": ("rolloutpipe.rollout.environments.gymnasium_env", "gymnasium", "gymnasium"),
    "verifiers": ("rolloutpipe.rollout.environments.verifiers_env", "verifiers", "verifiers"),
}
"""Adapters to other packages' environments: name -> (our module, the package it needs, the extra that installs
it). Imported only where an environment of that name runs."""

BUILT_IN = {"lookup": "rolloutpipe.rollout.environments.lookup"}
"""Our own environments: name -> module (standard library only)."""


def register_environment(name: str) -> Callable[[EnvironmentFactory], EnvironmentFactory]:
    """Decorator: make ``factory`` the environment called ``name`` (``environment.name``)."""

    def register(factory: EnvironmentFactory) -> EnvironmentFactory:
        if name in _ENVIRONMENTS and _ENVIRONMENTS[name] is not factory:
            raise ValueError(f"environment {name!r} is already registered (by {_ENVIRONMENTS[name].__module__}); "
                             "register yours under another name.")
        _ENVIRONMENTS[name] = factory
        return factory

    return register


def missing_extra(name: str) -> str | None:
    """The one-line error for an adapter whose package is not installed (None: nothing missing)."""
    if name not in ADAPTERS:
        return None
    _, package, extra = ADAPTERS[name]
    if importlib.util.find_spec(package) is not None:
        return None
    return (f"environment.name={name} needs the {package} package, which is not installed: "
            f"pip install -e '.[{extra}]' (the {extra} extra).")


def get_environment(name: str, import_modules: list[str] = ()) -> EnvironmentFactory:
    """The factory registered as ``name``, importing our module for it, or ``import_modules``, first."""
    if name in BUILT_IN:
        importlib.import_module(BUILT_IN[name])
    elif name in ADAPTERS:
        if (error := missing_extra(name)) is not None:
            raise ValueError(error)
        importlib.import_module(ADAPTERS[name][0])
    for module in import_modules:
        importlib.import_module(module)
    try:
        return _ENVIRONMENTS[name]
    except KeyError:
        known = sorted({*_ENVIRONMENTS, *BUILT_IN, *ADAPTERS})
        raise ValueError(f"unknown environment {name!r}; known: {known}. Set environment.name to one of them, or "
                         "register yours with @register_environment in a module listed in "
                         "environment.import_modules.") from None
