"""The synthetic verifiable task for the embedded tiny model: string reversal.

A row asks the model to reverse a short random string: prompt ``"abd="``, label ``"dba"``. Every
character is in the tiny tokenizer's vocabulary, the answer is checkable exactly, and the reward
gives partial credit per position so that a random policy already sees a useful learning signal.
Rows use Slime's format (``prompt``, ``label``, ``metadata``), so the generated file goes through
the same loader as a user's data set.

This module is imported by reward workers: keep it to the standard library.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import json
import os
import random
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class TaskKind(enum.Enum):
    reversal = "reversal"
    """The prompt shows the string: ``abd=`` -> ``dba``."""
    lookup = "lookup"
    """The string is hidden: the prompt asks the model to look it up with a tool (the ``lookup`` environment,
    rollout/environments/lookup.py) and answer with its reversal; the row's metadata holds it for the tool."""


@dataclass(kw_only=True, slots=True)
class ReversalTaskConfig:
    """The synthetic data set written when ``data.path`` is null."""

    kind: TaskKind = TaskKind.reversal
    num_rows: int = 2048
    length: int = 3
    """Characters in each string to reverse."""
    alphabet_size: int = 4
    """The strings use the first ``alphabet_size`` letters of a..z."""
    seed: int = 0
    eval_fraction: float = 0.125
    """Share of the distinct strings held out: never in the training rows, they make the held-out split that
    the default run evaluates (an eval set with path null). 0: hold nothing out."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"data.task.eval_fraction={self.eval_fraction} must be in [0, 1): the share of the "
                             "strings held out of training for evaluation.")
        if self.num_rows < 1:
            raise ValueError(f"data.task.num_rows={self.num_rows} must be at least 1; set it to the rows wanted.")
        if self.length < 1:
            raise ValueError(f"data.task.length={self.length} must be at least 1; set it to the string length wanted.")
        if not 1 <= self.alphabet_size <= 26:
            raise ValueError(
                f"data.task.alphabet_size={self.alphabet_size} must be in 1..26 (letters a..z); set it in that range."
            )


MAX_ENUMERATED = 1 << 16
"""Up to this many distinct strings the held-out split is exact (every held-out string once); above, by hash."""
MAX_HELDOUT_ROWS = 256


def _hash(cfg: ReversalTaskConfig, text: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{cfg.seed}/heldout/{text}".encode()).digest()[:8], "little")


def heldout_strings(cfg: ReversalTaskConfig) -> set[str] | None:
    """The held-out strings when the task has few enough to list (None: decided by hash, ``is_heldout``).

    The ``eval_fraction`` of them with the smallest hashes, at least one (when there are two or more strings and
    the fraction is not 0) and never all, so both splits are non-empty."""
    letters = string.ascii_lowercase[: cfg.alphabet_size]
    num = cfg.alphabet_size ** cfg.length
    if num > MAX_ENUMERATED:
        return None
    every = sorted(("".join(t) for t in itertools.product(letters, repeat=cfg.length)), key=lambda t: _hash(cfg, t))
    take = min(max(round(cfg.eval_fraction * num), 1 if cfg.eval_fraction > 0 else 0), num - 1)
    return set(every[:take])


def is_heldout(cfg: ReversalTaskConfig, text: str, listed: set[str] | None) -> bool:
    return text in listed if listed is not None else _hash(cfg, text) < cfg.eval_fraction * 2**64


LOOKUP_PROMPT = "lookup then reverse"


def _row(text: str, kind: TaskKind = TaskKind.reversal) -> dict[str, Any]:
    if kind is TaskKind.lookup:
        return {"prompt": LOOKUP_PROMPT, "label": text[::-1], "metadata": {"task": "lookup", "hidden": text}}
    return {"prompt": f"{text}=", "label": text[::-1], "metadata": {"task": "reversal"}}


def reversal_rows(cfg: ReversalTaskConfig) -> list[dict[str, Any]]:
    """The training rows: random strings, none of them held out."""
    rng = random.Random(cfg.seed)
    letters = string.ascii_lowercase[: cfg.alphabet_size]
    listed = heldout_strings(cfg)
    rows = []
    while len(rows) < cfg.num_rows:
        text = "".join(rng.choice(letters) for _ in range(cfg.length))
        if not is_heldout(cfg, text, listed):
            rows.append(_row(text, cfg.kind))
    return rows


def heldout_rows(cfg: ReversalTaskConfig) -> list[dict[str, Any]]:
    """The held-out split: every held-out string once (at most MAX_HELDOUT_ROWS), in a fixed order."""
    listed = heldout_strings(cfg)
    if listed is not None:
        return [_row(t, cfg.kind) for t in sorted(listed)[:MAX_HELDOUT_ROWS]]
    rng, letters, found = random.Random(f"{cfg.seed}/heldout"), string.ascii_lowercase[: cfg.alphabet_size], {}
    while len(found) < MAX_HELDOUT_ROWS:
        text = "".join(rng.choice(letters) for _ in range(cfg.length))
        if is_heldout(cfg, text, None):
            found[text] = None
    return [_row(t, cfg.kind) for t in found]


def write_reversal_jsonl(cfg: ReversalTaskConfig, path: Path) -> Path:
    """Write the task's training rows as jsonl; the same config always gives a byte-identical file."""
    return _write_jsonl(reversal_rows(cfg), path)


def write_heldout_jsonl(cfg: ReversalTaskConfig, path: Path) -> Path:
    """Write the task's held-out split as jsonl (the default run's eval set)."""
    if cfg.eval_fraction == 0:
        raise ValueError("an eval set with path null reads the synthetic task's held-out split, but "
                         "data.task.eval_fraction=0 holds nothing out; set it above 0 or give the set a path.")
    return _write_jsonl(heldout_rows(cfg), path)


def _write_jsonl(rows: list[dict[str, Any]], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Both node groups may generate the same file into a shared run directory: write aside and
    # rename, so that a reader never sees a half-written file.
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    with partial.open("w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(partial, path)
    return path


def reversal_reward(response: str, label: str, metadata: dict[str, Any]) -> float:
    """Fraction of positions answered right: matches at i < len(label) / max(len(label), len(response)).

    Extra characters cost as much as missing ones, so "dbaa" scores 3/4 for "dba".
    """
    response = response.strip()
    num_right = sum(1 for got, want in zip(response, label) if got == want)
    return num_right / max(len(label), len(response), 1)
