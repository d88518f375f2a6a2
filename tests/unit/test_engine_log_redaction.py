"""An engine server's log (rollout/engines/server_process.py: copy_redacted) never holds the run's engine API key: not
as logged, not in another case, not wrapped over lines, not base64-encoded inside a header; and the copier still
writes each line as it comes."""

from __future__ import annotations

import base64
import io
import os
import re
import threading
from pathlib import Path

import pytest

from rolloutpipe.rollout.engines.server_process import REDACTED, copy_redacted
from tests.conftest import wait_for

KEY = "3f9c0b7e5a1d4c2b8e6f0a9d7c5b3e1f2a4c6e8b0d9f7a5c3e1b2d4f6a8c0e9b"
"""A key as NodeEnv.engine_api_key makes it: 64 lower-case hex digits."""


def copied(text: bytes, tmp_path: Path) -> bytes:
    log = tmp_path / "engine.log"
    copy_redacted(io.BytesIO(text), log.open("wb"), KEY)
    return log.read_bytes()


def assert_holds_no_part_of_the_key(log: bytes) -> None:
    """No 4 consecutive characters of the key, in any case (the texts around it here have no 4 hex digits in a row)."""
    text = log.decode().lower()
    parts = [KEY[i:i + 4] for i in range(len(KEY) - 3)]
    assert not [p for p in parts if p in text], log


def test_the_key_is_replaced_in_any_case(tmp_path):
    mixed = "".join(c.upper() if i % 2 else c for i, c in enumerate(KEY))
    lines = [f"server_args=ServerArgs(api_key='{k}', host='node')\n".encode() for k in (KEY, KEY.upper(), mixed)]
    log = copied(b"".join(lines), tmp_path)
    assert_holds_no_part_of_the_key(log)
    assert log == (b"server_args=ServerArgs(api_key='" + REDACTED + b"', host='node')\n") * 3


@pytest.mark.parametrize("wrap", ["\n", "'\n    '", "\\\n  "], ids=["hard wrap", "pretty-printed", "continued"])
def test_a_key_split_across_lines_is_replaced_wherever_it_breaks(tmp_path, wrap):
    """The key's first part ends one line and the rest begins the next, at every split point; a pretty-printer's
    quotes and indent, or a shell's backslash, may stand at the break."""
    for split in range(1, len(KEY)):
        for key in (KEY, KEY.upper()):
            log = copied(f"api_key='{key[:split]}{wrap}{key[split:]}' said\nnext line\n".encode(), tmp_path)
            assert_holds_no_part_of_the_key(log)
            assert log == b"api_key='" + REDACTED + b"\n' said\nnext line\n", (split, log)


def test_a_key_wrapped_over_several_lines_is_replaced(tmp_path):
    line = f"engine args: api_key={KEY} port=30000"
    wrapped = "".join(line[i:i + 20] + "\n" for i in range(0, len(line), 20))  # a terminal 20 columns wide
    log = copied(wrapped.encode() + b"after\n", tmp_path)
    assert_holds_no_part_of_the_key(log)
    assert log.endswith(b" port=30000\nafter\n") and REDACTED in log


def decoded_base64_runs(log: bytes) -> list[bytes]:
    """Whatever the log's base64-looking runs decode to, read from each of the 4 character offsets."""
    found = []
    for run in re.findall(rb"[A-Za-z0-9+/_-]{8,}", log):
        for skip in range(4):
            chars = run[skip:]
            found.append(base64.b64decode(chars[:len(chars) // 4 * 4], altchars=b"-_" if b"-" in chars or b"_" in
                                          chars else None))
    return found


@pytest.mark.parametrize("before", [b"", b"x", b"xy"], ids=["offset 0", "offset 1", "offset 2"])
@pytest.mark.parametrize("encode", [base64.b64encode, base64.urlsafe_b64encode], ids=["standard", "url-safe"])
def test_base64_of_the_bearer_header_is_replaced_at_every_offset(tmp_path, before, encode):
    """``Authorization: Bearer <key>`` base64-encoded inside a blob, wherever it starts (a logged request dump)."""
    for key in (KEY, KEY.upper()):
        blob = encode(before + b"Authorization: Bearer " + key.encode() + b"\r\nHost: node\r\n")
        assert any(key.encode() in d for d in decoded_base64_runs(blob)), "the check finds the key unredacted"
        log = copied(b"request=" + blob + b"\n", tmp_path)
        assert REDACTED in log and not any(key.encode()[i:i + 8] in d for d in decoded_base64_runs(log)
                                          for i in range(len(key) - 7)), log


def test_a_line_is_in_the_log_before_the_next_one_comes_and_a_held_end_at_the_streams_end(tmp_path):
    """Only the end of a line that could begin a wrapped key waits for the next line; the rest is written at once,
    so the last line of a hung server is in its log. What waits is written when the stream ends."""
    read, write = os.pipe()
    log = tmp_path / "engine.log"
    copier = threading.Thread(target=copy_redacted, args=(os.fdopen(read, "rb"), log.open("wb"), KEY))
    copier.start()
    with os.fdopen(write, "wb", buffering=0) as server:
        server.write(b"loading the model\n")
        wait_for(lambda: log.read_bytes() == b"loading the model\n", "the first line in the log", timeout_s=30)
        server.write(f"its key starts {KEY[:5]}\n".encode())
        wait_for(lambda: log.read_bytes().endswith(b"its key starts "), "the line up to the key's start", timeout_s=30)
    copier.join(timeout=30)
    assert log.read_bytes() == f"loading the model\nits key starts {KEY[:5]}\n".encode()
