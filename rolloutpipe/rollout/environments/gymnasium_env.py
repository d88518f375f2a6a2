"""The gymnasium adapter: any Gymnasium environment with a Discrete action space, played in text.

The model reads each observation as a user message and answers in words; the adapter reads the action out of the
answer and steps the Gymnasium environment with it:

    reset(label, metadata)  env.reset(seed=<the row's seed>)     -> [user: <prompt> <observation>]
    step(response)          env.step(<last action name in it>)   -> Turn(user: <observation>, reward, done)

- The seed is the row's: ``metadata.seed`` (an int), else the label if it is an int. Every sample of a group plays
  the same instance (same map, same start, same random stream), so GRPO compares moves, not luck of the draw; and
  an episode replayed on a fresh worker (pool.py) goes through the same states.
- The action is the last whole-word action name in the reply, case-insensitive (models reason first and answer
  last). A reply without one gets ``invalid action use one of <names>`` and ``invalid_action_reward``; the
  ``max_invalid_actions``-th such reply ends the episode.
- ``done`` is Gymnasium's ``terminated or truncated`` (its TimeLimit included); ``environment.max_turns`` may end
  the episode first. Rewards and done flags are cast to float and bool: they cross a pipe as JSON.
- Observations: ``repr`` writes ``state <str(obs)>`` on one line (whitespace collapsed). With a Discrete observation
  and digit or lowercase action names every message stays in ``0-9 a-z`` and space (our CPU test model's alphabet);
  a Box or Tuple observation brings its brackets, commas and minus signs. ``ansi`` writes ``env.render()`` with
  ``render_mode="ansi"`` (several lines); some environments (FrozenLake) mark the agent with ANSI colour codes,
  kept because they are the only mark of its position.

Limits: Discrete action spaces only (a Box or MultiDiscrete one is refused when the factory runs); one Gymnasium
environment per episode, made by ``gymnasium.make`` in the environment worker; no image observations.

Example (the keys under ``environment.args`` are free-form, so Hydra wants a ``+`` on each):

    python launch.py environment.name=gymnasium +environment.args.id=FrozenLake-v1 \\
        +environment.args.kwargs.is_slippery=false +environment.args.kwargs.map_name=4x4 \\
        '+environment.args.actions=[left,down,right,up]' \\
        '+environment.args.prompt=reach cell 15 without falling in a hole answer left down right or up'

with rows like ``{"prompt": "...", "label": 0, "metadata": {"seed": 7}}``.
"""

# Every error here is a ValueError, also for a value of the wrong type: base.py asks environments for ValueError on
# a bad row or config, as config.py's bind does for config values.
# ruff: noqa: TRY004

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field, fields
from typing import Any

import gymnasium

from rolloutpipe.rollout.environments.base import Message, Turn, register_environment


class Observation(enum.Enum):
    """How an observation becomes text (``environment.args.observation``)."""

    REPR = "repr"
    """``state <str(obs)>`` on one line."""
    ANSI = "ansi"
    """``env.render()`` of an environment made with ``render_mode="ansi"``."""


@dataclass(kw_only=True, slots=True)
class GymnasiumArgs:
    """``environment.args`` of the gymnasium adapter, checked once per episode when the factory runs."""

    id: str
    """A registered Gymnasium id, e.g. ``FrozenLake-v1`` (``gymnasium.pprint_registry()`` lists them)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Passed to ``gymnasium.make`` (e.g. ``{"is_slippery": false, "map_name": "4x4"}``); not ``render_mode``."""
    actions: list[str] | None = None
    """A name per Discrete action, in action order. Null: the action values themselves, ``0`` to ``n-1``."""
    observation: Observation = Observation.REPR
    """How observations are written: ``repr`` or ``ansi``."""
    prompt: str = ""
    """Text put before the opening observation (the rules, the action names)."""
    invalid_action_reward: float = 0.0
    """The reward of a reply that names no action."""
    max_invalid_actions: int = 1
    """Replies naming no action that end the episode (1: the first one does)."""

    @classmethod
    def from_dict(cls, args: dict[str, Any]) -> GymnasiumArgs:
        """``environment.args`` as typed args; raises ValueError naming the key and the fix."""
        known = [f.name for f in fields(cls)]
        if unknown := sorted(set(args) - set(known)):
            raise ValueError(f"unknown environment.args key(s) {unknown} for environment.name=gymnasium; "
                             f"known: {known}.")
        if not isinstance(args.get("id"), str) or not args["id"]:
            raise ValueError("environment.name=gymnasium needs environment.args.id, a Gymnasium id "
                             "(e.g. +environment.args.id=FrozenLake-v1).")
        return cls(**args)

    def __post_init__(self) -> None:
        try:
            self.observation = Observation(self.observation)
        except ValueError:
            raise ValueError(f"environment.args.observation={self.observation!r} must be one of "
                             f"{[o.value for o in Observation]}.") from None
        if not isinstance(self.kwargs, dict):
            raise ValueError(f"environment.args.kwargs={self.kwargs!r} must be a mapping (gymnasium.make's keywords).")
        if "render_mode" in self.kwargs:
            raise ValueError("environment.args.kwargs.render_mode is set by the adapter (ansi for "
                             "environment.args.observation=ansi, none for repr); remove it.")
        if not isinstance(self.prompt, str):
            raise ValueError(f"environment.args.prompt={self.prompt!r} must be a string.")
        if isinstance(self.invalid_action_reward, bool) or not isinstance(self.invalid_action_reward, int | float):
            raise ValueError(f"environment.args.invalid_action_reward={self.invalid_action_reward!r} must be a number.")
        if (isinstance(self.max_invalid_actions, bool) or not isinstance(self.max_invalid_actions, int)
                or self.max_invalid_actions < 1):
            raise ValueError(f"environment.args.max_invalid_actions={self.max_invalid_actions!r} must be an int, "
                             "at least 1 (the invalid replies that end an episode).")


class GymnasiumEnvironment:
    """One episode of a Gymnasium environment, in text (see the module docstring)."""

    def __init__(self, args: GymnasiumArgs) -> None:
        self._args = args
        try:
            gymnasium.spec(args.id)
        except (gymnasium.error.Error, ImportError) as err:
            raise ValueError(f"environment.args.id={args.id!r} is not a Gymnasium environment here: "
                             f"{str(err).splitlines()[0]} Set it to a registered id (gymnasium.pprint_registry() "
                             "lists them).") from None
        render_mode = "ansi" if args.observation is Observation.ANSI else None
        try:
            self._env = gymnasium.make(args.id, render_mode=render_mode, **args.kwargs)
        except TypeError as err:
            raise ValueError(f"environment.args.kwargs={args.kwargs!r} do not fit {args.id}: "
                             f"{str(err).splitlines()[0]}") from None
        space = self._env.action_space
        if not isinstance(space, gymnasium.spaces.Discrete):
            raise ValueError(f"environment.args.id={args.id} has the action space {space}; the gymnasium adapter "
                             "plays Discrete action spaces only (one action name per action).")
        if render_mode is not None and render_mode not in self._env.metadata.get("render_modes", []):
            raise ValueError(f"environment.args.observation=ansi, but {args.id} renders only "
                             f"{self._env.metadata.get('render_modes', [])}; use observation=repr.")
        n, start = int(space.n), int(space.start)
        names = [str(start + i) for i in range(n)] if args.actions is None else args.actions
        if (not isinstance(names, list) or len(names) != n
                or not all(isinstance(a, str) and a and a == a.strip() for a in names)):
            raise ValueError(f"environment.args.actions={names!r} must list {n} names, one per action of {args.id} "
                             f"({space}), non-empty and without surrounding spaces.")
        if len({a.lower() for a in names}) != n:
            raise ValueError(f"environment.args.actions={names!r} repeats a name (case-insensitively): the reply "
                             "could not say which action it means.")
        self._names = names
        self._action_of = {a.lower(): start + i for i, a in enumerate(names)}
        # Longest first, so that a name containing another ("up left", "up") wins where both match.
        alternatives = "|".join(re.escape(a) for a in sorted(names, key=len, reverse=True))
        self._pattern = re.compile(rf"(?<!\w)(?:{alternatives})(?!\w)", re.IGNORECASE)
        self._num_invalid = 0

    def reset(self, label: Any, metadata: dict[str, Any]) -> list[Message]:
        obs, _ = self._env.reset(seed=_row_seed(label, metadata))
        self._num_invalid = 0
        text = self._observation_text(obs)
        if self._args.prompt:
            text = self._args.prompt + ("\n" if self._args.observation is Observation.ANSI else " ") + text
        return [{"role": "user", "content": text}]

    def step(self, response: str) -> Turn:
        matches = list(self._pattern.finditer(response))
        if not matches:
            self._num_invalid += 1
            return Turn(messages=[{"role": "user", "content": "invalid action use one of " + " ".join(self._names)}],
                        reward=float(self._args.invalid_action_reward),
                        done=self._num_invalid >= self._args.max_invalid_actions)
        action = self._action_of[matches[-1].group(0).lower()]
        obs, reward, terminated, truncated, _ = self._env.step(action)
        return Turn(messages=[{"role": "user", "content": self._observation_text(obs)}], reward=float(reward),
                    done=bool(terminated or truncated))

    def _observation_text(self, obs: Any) -> str:
        if self._args.observation is Observation.ANSI:
            return self._env.render().strip("\n")
        return "state " + " ".join(str(obs).split())


def _row_seed(label: Any, metadata: dict[str, Any]) -> int:
    """The episode's seed: ``metadata.seed``, else an int label. Checked here, the row's boundary."""
    if "seed" in metadata:
        seed, where = metadata["seed"], "metadata.seed"
    elif isinstance(label, int) and not isinstance(label, bool):
        seed, where = label, "the label"
    else:
        raise ValueError(f"a gymnasium row needs metadata.seed (an int) or an int label, its episode's seed; this "
                         f"row has neither (label={label!r}). Add \"seed\" to its metadata.")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"a gymnasium row's seed ({where}) must be a non-negative int, got {seed!r}.")
    return seed


@register_environment("gymnasium")
def make_gymnasium_environment(args: dict[str, Any]) -> GymnasiumEnvironment:
    """One episode's Gymnasium environment from ``environment.args`` (see GymnasiumArgs)."""
    return GymnasiumEnvironment(GymnasiumArgs.from_dict(args))
