"""The synthetic verifiable task for the embedded tiny model: string reversal.

A row asks the model to reverse a short random string: prompt ``"abd="``, label ``"dba"``. Every
character is in the tiny tokenizer's vocabulary, the answer is checkable exactly, and the reward
gives partial credit per position so that a random policy already sees a useful learning signal.
Rows use Slime's format (``prompt``, ``label``, ``metadata``), so the generated file goes through
the same loader as a user's data set.

This module is imported by reward workers: keep it to the standard library.
"""

from __future__ import annotations

import json
import os
import random
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(kw_only=True, slots=True)
class ReversalTaskConfig:
    """The synthetic data set written when ``data.path`` is null."""

    num_rows: int = 2048
    length: int = 3
    """Characters in each string to reverse."""
    alphabet_size: int = 4
    """The strings use the first ``alphabet_size`` letters of a..z."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_rows < 1:
            raise ValueError(f"data.task.num_rows={self.num_rows} must be at least 1; set it to the rows wanted.")
        if self.length < 1:
            raise ValueError(f"data.task.length={self.length} must be at least 1; set it to the string length wanted.")
        if not 1 <= self.alphabet_size <= 26:
            raise ValueError(
                f"data.task.alphabet_size={self.alphabet_size} must be in 1..26 (letters a..z); set it in that range."
            )


def reversal_rows(cfg: ReversalTaskConfig) -> list[dict[str, Any]]:
    rng = random.Random(cfg.seed)
    letters = string.ascii_lowercase[: cfg.alphabet_size]
    rows = []
    for _ in range(cfg.num_rows):
        text = "".join(rng.choice(letters) for _ in range(cfg.length))
        rows.append({"prompt": f"{text}=", "label": text[::-1], "metadata": {"task": "reversal"}})
    return rows


def write_reversal_jsonl(cfg: ReversalTaskConfig, path: Path) -> Path:
    """Write the task as jsonl; the same config always gives a byte-identical file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # Both node groups may generate the same file into a shared run directory: write aside and
    # rename, so that a reader never sees a half-written file.
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    with partial.open("w", encoding="utf-8", newline="\n") as f:
        for row in reversal_rows(cfg):
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
