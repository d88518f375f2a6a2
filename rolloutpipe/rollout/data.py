"""Prompts: read and validate a data set in Slime's row format, and hand prompts out step by step.

A row is one JSON object (a jsonl line or a parquet row)::

    {"prompt": "abd=" | [{"role": "user", "content": "..."}], "label": <any JSON>, "metadata": {...}}

Every row is checked once, here, and a bad row stops the run with its file, line and the fix:
a data set is never trained on with rows silently missing. Prompts are tokenized without special
tokens; a message-list prompt (or any prompt with ``apply_chat_template``) goes through the
tokenizer's chat template with the generation prompt appended.

The order in which prompts are used is a pure function of (seed, epoch): epoch e is a fixed
permutation of the rows, so a resumed run sees the same prompts as an uninterrupted one.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rolloutpipe.rollout.tasks import ReversalTaskConfig, write_reversal_jsonl
from rolloutpipe.types import Prompt

DATA_SUFFIXES = (".jsonl", ".parquet")
SYNTHETIC_DATA_FILE = "data/reversal.jsonl"
"""Where the synthetic task is written, relative to the run directory."""


@dataclass(kw_only=True, slots=True)
class DataConfig:
    path: str | None = None
    """A ``.jsonl`` or ``.parquet`` file in Slime's format. Null: the synthetic reversal task (``task``)."""
    prompt_key: str = "prompt"
    label_key: str = "label"
    metadata_key: str = "metadata"
    apply_chat_template: bool = False
    """Wrap string prompts in the tokenizer's chat template. Message-list prompts always use it."""
    system_prompt: str | None = None
    """Prepended as a system message to prompts that do not start with one (needs ``apply_chat_template``)."""
    max_prompt_len: int = 1024
    """Longest prompt in tokens; a longer row is an error, not a truncation."""
    shuffle: bool = True
    task: ReversalTaskConfig = field(default_factory=ReversalTaskConfig)

    def __post_init__(self) -> None:
        if self.path is not None:
            if not self.path.endswith(DATA_SUFFIXES):
                raise ValueError(
                    f"data.path={self.path!r} must end in .jsonl or .parquet (Slime's row format); "
                    "convert the file, or set data.path=null for the synthetic task."
                )
            if not Path(self.path).is_file():
                raise ValueError(f"data.path={self.path!r} is not a file; fix the path or set data.path=null.")
        if self.max_prompt_len < 1:
            raise ValueError(f"data.max_prompt_len={self.max_prompt_len} must be at least 1 (tokens).")
        if self.system_prompt is not None and not self.apply_chat_template:
            raise ValueError(
                "data.system_prompt is only used through the chat template; set data.apply_chat_template=true "
                "or data.system_prompt=null."
            )


class DatasetError(ValueError):
    """A row of the data set is unusable; the message names the file, the 1-based line and the fix."""

    def __init__(self, path: Path, line: int | None, reason: str, fix: str) -> None:
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {reason}. {fix}")
        self.path = path
        self.line = line
        self.reason = reason


def prepare_data_path(cfg: DataConfig, run_dir: Path) -> Path:
    """The data file to load: ``cfg.path``, or the synthetic task written into the run directory."""
    if cfg.path is not None:
        return Path(cfg.path)
    return write_reversal_jsonl(cfg.task, run_dir / SYNTHETIC_DATA_FILE)


Openings = Callable[[list[tuple[Any, dict[str, Any]]], Callable[[int], str]], list[list[dict[str, str]]]]
"""A multi-turn environment's opening messages for each row's (label, metadata), given where row i is for its error
(rollout/environments/pool.py ``EnvPool.openings``)."""


def load_prompts(cfg: DataConfig, tokenizer, data_path: Path, openings: Openings | None = None) -> list[Prompt]:
    """Read, validate and tokenize every row of ``data_path``; raises DatasetError on the first bad row. With
    ``openings`` (an environment), each row's opening messages follow its prompt, through the chat template."""
    rows = []
    for line, row in _read_rows(data_path):
        if isinstance(row, dict) and data_path.suffix == ".parquet":
            for key in (cfg.prompt_key, cfg.label_key, cfg.metadata_key):
                _check_json_data(data_path, line, key, row.get(key))
        rows.append((line, *_parse_row(cfg, data_path, line, row)))
    if not rows:
        raise DatasetError(data_path, None, "the file has no rows", "Point data.path at a non-empty data set.")
    opened = (openings([(label, metadata) for _, _, label, metadata in rows],
                       lambda i: f"the row at {data_path}:{rows[i][0]}")
              if openings is not None else [[]] * len(rows))
    return [_prompt(cfg, tokenizer, data_path, line, prompt, label, metadata, opening)
            for (line, prompt, label, metadata), opening in zip(rows, opened, strict=True)]


def _read_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(1-based line or row number, decoded row), streamed."""
    if path.suffix == ".parquet":
        yield from _read_parquet_rows(path)
        return
    with path.open("rb") as f:
        for line, raw in enumerate(f, start=1):
            try:
                # A byte-order mark opens files written by some Windows tools: it is not part of the first row.
                text = raw.decode("utf-8-sig" if line == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise DatasetError(
                    path, line, f"bytes that are not UTF-8 ({err.reason} at byte {err.start})",
                    "Re-encode the file as UTF-8.",
                ) from err
            if not text.strip():
                raise DatasetError(path, line, "empty line", "Remove it: every line must hold one JSON object.")
            if text.startswith("\ufeff"):
                raise DatasetError(
                    path, line, "a UTF-8 byte-order mark inside the file (files joined together?)",
                    "Remove it: only the file's first line may start with one.",
                )
            try:
                yield line, json.loads(text.rstrip("\r\n"))  # (with its newline, an error at the end reads "column 1")
            except json.JSONDecodeError as err:
                raise DatasetError(
                    path, line, f"invalid JSON ({err.msg} at column {err.colno})",
                    "Every line must hold exactly one JSON object.",
                ) from err


def _read_parquet_rows(path: Path) -> Iterator[tuple[int, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise DatasetError(
            path, None, "reading parquet needs pyarrow, which is not installed",
            "Install it (pip install pyarrow) or convert the data set to jsonl.",
        ) from err
    row_number = 0
    for batch in pq.ParquetFile(path).iter_batches():
        for row in batch.to_pylist():
            row_number += 1
            yield row_number, row


def _check_json_data(path: Path, line: int, where: str, value: Any) -> None:
    """Refuse a value that is not JSON data (a parquet timestamp, decimal, bytes, map): rewards get JSON.

    Refused rather than converted: a timestamp or a decimal has no JSON form that every reward would read
    the same way (a string? a float, rounded?), so the data set says which it means.
    """
    if value is None or isinstance(value, (str, bool, int, float)):
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_json_data(path, line, f"{where}[{i}]", item)
        return
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        for key, item in value.items():
            _check_json_data(path, line, f"{where}.{key}", item)
        return
    kind = "a map with keys that are not strings" if isinstance(value, dict) else f"a {type(value).__name__}"
    raise DatasetError(
        path, line, f"{where} is {kind} ({str(value)[:40]!r}), not JSON data",
        "Cast the column to a string, a number or a list in the file (a reward receives JSON data only).",
    )


def _parse_row(cfg: DataConfig, path: Path, line: int, row: Any) -> tuple[Any, Any, dict[str, Any]]:
    """A row's (prompt, label, metadata), checked."""
    if not isinstance(row, dict):
        raise DatasetError(path, line, f"expected a JSON object, got {_json_type(row)}", "Write each row as {...}.")
    if cfg.prompt_key not in row:
        raise DatasetError(
            path, line, f"missing key {cfg.prompt_key!r} (keys: {sorted(row)})",
            "Add the prompt, or set data.prompt_key to the key that holds it.",
        )
    prompt = row[cfg.prompt_key]
    _check_prompt(path, line, cfg.prompt_key, prompt)
    if row.get(cfg.label_key) is None:
        raise DatasetError(
            path, line, f"missing or null {cfg.label_key!r}",
            "Add the verifiable answer, or set data.label_key to the key that holds it.",
        )
    metadata = row.get(cfg.metadata_key)
    if metadata is None:
        metadata = {}
    elif not isinstance(metadata, dict):
        raise DatasetError(
            path, line, f"{cfg.metadata_key!r} must be a JSON object, got {_json_type(metadata)}",
            "Write it as {...} or leave it out.",
        )
    return prompt, row[cfg.label_key], metadata


def _prompt(cfg: DataConfig, tokenizer, path: Path, line: int, prompt: Any, label: Any, metadata: dict[str, Any],
            opening: list[dict[str, str]]) -> Prompt:
    if opening and not (isinstance(prompt, list) or cfg.apply_chat_template):
        raise DatasetError(
            path, line, "the environment opens this row's conversation with messages, which need the chat template",
            "Set data.apply_chat_template=true (or write the prompt as a list of messages).",
        )
    if isinstance(prompt, list) or cfg.apply_chat_template:
        if tokenizer.chat_template is None:
            raise DatasetError(
                path, line, "the prompt needs a chat template and the tokenizer has none",
                "Use a tokenizer with a chat template, or plain string prompts with data.apply_chat_template=false.",
            )
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        if cfg.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": cfg.system_prompt}, *messages]
        text = tokenizer.apply_chat_template([*messages, *opening], add_generation_prompt=True, tokenize=False)
    else:
        text = prompt
    try:
        input_ids = tokenizer.encode(text, add_special_tokens=False)
    except Exception as err:  # tokenizers raises a bare Exception for characters it cannot encode
        raise DatasetError(
            path, line, f"the tokenizer cannot encode the prompt ({err})",
            "Remove the characters it does not know, or use a tokenizer that covers them.",
        ) from err
    if len(input_ids) > cfg.max_prompt_len:
        raise DatasetError(
            path, line, f"the prompt is {len(input_ids)} tokens, more than data.max_prompt_len={cfg.max_prompt_len}",
            "Raise data.max_prompt_len or shorten the prompt.",
        )
    return Prompt(index=line - 1, text=text, input_ids=input_ids, label=label, metadata=metadata)


def _check_prompt(path: Path, line: int, key: str, prompt: Any) -> None:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DatasetError(path, line, f"empty {key!r}", "Give every row a non-empty prompt.")
        return
    fix = 'Write the prompt as a string or a list of {"role": str, "content": str} messages.'
    if not isinstance(prompt, list):
        raise DatasetError(path, line, f"{key!r} must be a string or a list of messages, got {_json_type(prompt)}", fix)
    if not prompt:
        raise DatasetError(path, line, f"empty {key!r} (no messages)", "Give every row at least one message.")
    for i, message in enumerate(prompt):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise DatasetError(path, line, f"{key!r} message {i} is not a {{role, content}} object of strings", fix)


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


class PromptSource:
    """Hands out prompts step by step in a fixed order, across epochs, and takes unused ones back.

    Epoch e is a permutation of the rows seeded by (seed, e) when ``shuffle``, else the file order.
    Prompts given back are handed out first, in the order they were given back, so over-sampling
    loses no prompt. Not thread-safe: one owner (the step loop) calls it.
    """

    def __init__(self, prompts: list[Prompt], *, shuffle: bool, seed: int) -> None:
        self._by_index = {p.index: p for p in prompts}
        self._indices = [p.index for p in prompts]
        self._shuffle = shuffle
        self._seed = seed
        self.epoch = 0
        self._cursor = 0  # prompts of ``epoch`` handed out so far
        self._returned: list[int] = []
        self._order = self._epoch_order(0)

    def next_batch(self, n: int) -> list[Prompt]:
        indices = self._returned[:n]
        del self._returned[:n]
        while len(indices) < n:
            if self._cursor == len(self._order):
                self.epoch += 1
                self._cursor = 0
                self._order = self._epoch_order(self.epoch)
            take = min(n - len(indices), len(self._order) - self._cursor)
            indices += self._order[self._cursor : self._cursor + take]
            self._cursor += take
        return [self._by_index[i] for i in indices]

    def peek(self, n: int) -> list[Prompt]:
        """The prompts ``next_batch(n)`` would hand out now, without handing them out (rollout.speculative drafts
        the next step's groups)."""
        saved = (self.epoch, self._cursor, list(self._returned), self._order)
        try:
            return self.next_batch(n)
        finally:
            self.epoch, self._cursor, self._returned, self._order = saved

    def give_back(self, prompts: list[Prompt]) -> None:
        self._returned += [p.index for p in prompts]

    def state_dict(self) -> dict[str, Any]:
        return {
            "num_prompts": len(self._indices),
            "epoch": self.epoch,
            "cursor": self._cursor,
            "returned": list(self._returned),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_prompts"] != len(self._indices):
            raise ValueError(
                f"the checkpoint's prompt source had {state['num_prompts']} prompts, the data set has "
                f"{len(self._indices)}; resume with the data set the run started with."
            )
        self.epoch = state["epoch"]
        self._cursor = state["cursor"]
        self._returned = list(state["returned"])
        self._order = self._epoch_order(self.epoch)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(self._indices)
        if self._shuffle:
            # A string seed is hashed with sha512 by random.Random: stable across processes and versions.
            random.Random(f"{self._seed}/{epoch}").shuffle(order)
        return order
