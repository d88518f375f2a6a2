"""Engine servers as child processes of the rollout node: the embedded engine's server or ``sglang.launch_server``.

Each server runs in its own session (process group), so ``stop`` reaches whatever it spawned (SGLang starts a
scheduler and a detokenizer process), and dies with the rollout node if that dies abruptly (control/lifetime.py:
start servers on the node's main thread, which is what that ties them to). It takes calls only with the run's
engine API key, which it gets in its environment (``sglang_api.API_KEY_ENV``), never on its command line. It
listens on its node's own address only (loopback when the whole job is on one machine: control/env.node_address).

Its output goes to a log file that errors point to, through the node: SGLang logs its whole server arguments at
INFO, the API key among them, so the node copies the server's output into the log with the key replaced
(``REDACTED``), and the log directory and files are the user's alone (0700, 0600). Replaced too: the key in any
case, the key wrapped over lines (a line break, with the indent and quotes of a pretty-printer, between any two of
its characters), and its base64 wherever it sits in an encoded blob (``Authorization: Bearer <key>`` encoded).

Log copier (one thread per server, ``log-<name>``)
    consumes   the server's stdout and stderr (one pipe, inherited by whatever the server spawns), line by line
    produces   the log file, the key replaced; a line that ends with the start of the key (a wrapped key's first
               part) is written up to it, and the rest once the next line shows whether the key goes on there
    waits for  the next line
    shuts down at the pipe's end (writing what it held): every process of the server's group has exited (or was
               killed)
"""

from __future__ import annotations

import base64
import functools
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import BinaryIO

from rolloutpipe.control.env import free_port
from rolloutpipe.control.lifetime import child_environ, die_with_parent, stop_groups
from rolloutpipe.rollout.engines import sglang_api

STOP_GRACE_S = 20.0
REDACTED = b"<engine-api-key-removed>"


class ServerProcess:
    """One engine server process; ``url`` is known once ``start`` returns."""

    def __init__(self, *, name: str, command: list[str], log_path: Path, api_key: str | None, url: str | None = None,
                 port_file: Path | None = None, host: str = "127.0.0.1") -> None:
        self.name = name
        self.host = host
        self.command = command
        self.log_path = log_path
        self.url = url
        self.api_key = api_key
        self._port_file = port_file
        self._proc: subprocess.Popen | None = None
        self._stopped = False

    def start(self) -> ServerProcess:
        """Start the process; ``wait_ready`` then waits for it (start several, then wait for all)."""
        log = open_private_log(self.log_path)
        log.write(f"$ {shlex.join(self.command)}\n".encode())
        log.flush()
        environ = child_environ()
        if self.api_key is not None:
            environ[sglang_api.API_KEY_ENV] = self.api_key
        self._proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      start_new_session=True, env=environ)
        threading.Thread(target=copy_redacted, args=(self._proc.stdout, log, self.api_key), name=f"log-{self.name}",
                         daemon=True).start()
        return self

    @property
    def endpoint(self) -> sglang_api.Endpoint:
        assert self.url is not None, "the URL is known once wait_ready returns"
        return sglang_api.Endpoint(self.url, self.api_key)

    def wait_ready(self, *, timeout_s: float) -> None:
        """Wait until /health answers; raises with the log's tail (and stops the process) if it does not."""
        deadline = time.monotonic() + timeout_s
        try:
            if self._port_file is not None:
                while not self._port_file.exists():
                    self.check_alive()
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{self.name}: no port written to {self._port_file} within {timeout_s:.0f}s")
                    time.sleep(0.05)
                self.url = f"http://{self.host}:{int(self._port_file.read_text())}"
            sglang_api.wait_healthy(self.endpoint, timeout_s=max(1.0, deadline - time.monotonic()),
                                    check_alive=self.check_alive, poll_s=0.2)
        except BaseException:
            self.stop()
            raise

    def exit_reason(self) -> str | None:
        """Why the process is gone (None while it runs)."""
        code = self._proc.poll() if self._proc is not None else None
        if code is None:
            return None
        return f"exited with code {code} (log: {self.log_path}){_tail(self.log_path)}"

    def check_alive(self) -> None:
        if (reason := self.exit_reason()) is not None:
            raise RuntimeError(f"engine server {self.name} ({shlex.join(self.command[:4])} ...) {reason}")

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it after a grace period (what is left of it, even once the server
        itself has exited: SGLang's scheduler may outlive it); idempotent."""
        if self._proc is not None and not self._stopped:
            self._stopped = True
            stop_groups([self._proc], STOP_GRACE_S)

    def kill(self) -> None:
        """SIGKILL the process group at once (a failed server: nothing to shut down cleanly); idempotent."""
        if self._proc is not None and not self._stopped:
            self._stopped = True
            stop_groups([self._proc], 0.0)


def open_private_log(path: Path) -> BinaryIO:
    """``path`` for appending, readable by its owner only, in a directory only its owner can enter."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.parent.chmod(0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(fd, 0o600)  # (a log left by an earlier attempt keeps its old mode otherwise)
    return os.fdopen(fd, "ab")


def copy_redacted(stream: BinaryIO, log: BinaryIO, key: str | None) -> None:
    """The log copier (module docstring): every line of ``stream`` into ``log``, ``key`` replaced, until the end."""
    redactor = Redactor(key) if key else None
    with stream, log:
        for line in iter(stream.readline, b""):
            log.write(redactor.feed(line) if redactor else line)
            log.flush()
        if redactor:
            log.write(redactor.held)


WRAP = rb"""['"]?\\?[ \t]{0,80}\r?\n[ \t]{0,80}['"]?"""
"""What may stand between two characters of a wrapped key: a line break, with a pretty-printer's closing quote (or a
shell's backslash) before it and its indent and opening quote after it."""


class Redactor:
    """Replaces the key in a stream of lines (see the module docstring); ``feed`` returns what may be written."""

    def __init__(self, key: str) -> None:
        self._whole, self._start = _patterns(key)
        self.held = b""
        """The end of what was fed that may be a wrapped key's first part: written once the next line shows."""

    def feed(self, line: bytes) -> bytes:
        text = self._whole.sub(lambda m: REDACTED + b"\n" * m.group().count(b"\n"), self.held + line)
        start = self._start.search(text)
        cut = len(text) if start is None else start.start()
        self.held = text[cut:]
        return text[:cut]


@functools.lru_cache(maxsize=2)
def _patterns(key: str) -> tuple[re.Pattern, re.Pattern]:
    """The key's forms, whole and (ending a line) started; compiled once per key (a tenth of a second), not per
    server."""
    forms = [(key.encode(), True)] + [(form, False) for k in (key, key.upper()) for form in base64_forms(k.encode())]
    scoped = [(b"(?i:%s)" if any_case else b"(?:%s)", form) for form, any_case in forms]
    whole = re.compile(b"|".join(scope % _wrapped(form) for scope, form in scoped))
    start = re.compile(b"(?:" + b"|".join(scope % _wrapped_start(form) for scope, form in scoped) + b")" + WRAP
                       + rb"\Z")
    return whole, start


def _wrapped(form: bytes) -> bytes:
    """A pattern of ``form`` with a WRAP allowed between any two of its characters."""
    return (b"(?:" + WRAP + b")?").join(re.escape(form[i:i + 1]) for i in range(len(form)))


def _wrapped_start(form: bytes) -> bytes:
    """A pattern of any proper prefix of ``form``, wrapped as in ``_wrapped`` (nested: c0(?:W?c1(?:W?c2)?)?)."""
    pattern = b""
    for i in reversed(range(len(form) - 1)):
        pattern = re.escape(form[i:i + 1]) + (b"(?:(?:" + WRAP + b")?" + pattern + b")?" if pattern else b"")
    return pattern


def base64_forms(secret: bytes) -> set[bytes]:
    """The base64 text ``secret`` makes inside any encoded blob: at each of its 3 offsets (mod 3), the whole
    4-character groups made of its bytes alone, in the standard and the URL-safe alphabet."""
    forms = set()
    for offset in range(3):
        encoded = base64.b64encode(b"\0" * offset + secret)[4 if offset else 0:(offset + len(secret)) // 3 * 4]
        forms |= {encoded, encoded.translate(bytes.maketrans(b"+/", b"-_"))}
    return forms


def die_with_the_rollout_node() -> None:
    """Called first by a server's entry point (http_server, sglang_launch): SIGKILL when the node that started it
    dies. The node's own stop path is SIGTERM and a grace period; this one is for a node that is gone, with
    nobody left to hand results to, so nothing in the server is worth a clean exit. (SGLang's own scheduler and
    detokenizer processes ask for the same when their parent dies: ``kill_itself_when_parent_died``.)"""
    die_with_parent(signal.SIGKILL)


def embedded_server(*, name: str, model_config_yaml: Path, concurrency: int, log_dir: Path, api_key: str | None,
                    num_threads: int | None = None, host: str = "127.0.0.1",
                    batch_invariant: bool = False) -> ServerProcess:
    """The embedded engine's server (``python -m rolloutpipe.rollout.engines.http_server``) on a free port of
    ``host`` (this node's address: control/env.node_address)."""
    port_file = log_dir / f"{name}.port"
    port_file.unlink(missing_ok=True)
    command = [sys.executable, "-m", "rolloutpipe.rollout.engines.http_server",
               "--model-config", str(model_config_yaml), "--host", host, "--port", "0",
               "--port-file", str(port_file), "--concurrency", str(concurrency)]
    if num_threads:
        command += ["--num-threads", str(num_threads)]
    if batch_invariant:
        command.append("--batch-invariant")
    return ServerProcess(name=name, command=command, log_path=log_dir / f"{name}.log", port_file=port_file,
                         api_key=api_key, host=host)


def sglang_server(*, name: str, model_path: str, dtype: str, concurrency: int, seed: int, base_gpu_id: int,
                  priority_scheduling: bool, extra_args: list[str], log_dir: Path, api_key: str | None,
                  host: str = "127.0.0.1", deterministic: bool = True) -> ServerProcess:
    """``python -m sglang.launch_server`` for one engine, on this node's GPUs from ``base_gpu_id``, started through
    ``rolloutpipe.rollout.engines.sglang_launch`` so that its ``--api-key`` comes from the environment.

    On a CPU the real-SGLang tier (tests/sglang_real/test_sglang_real.py) runs it, through a test-only workaround
    and with its CPU flags in ``extra_args``; tools/gpu_check.py runs it on a GPU machine.
    """
    port = free_port()
    command = [
        sys.executable, "-m", "rolloutpipe.rollout.engines.sglang_launch", "--model-path", model_path,
        "--host", host,
        "--port", str(port), "--dtype", dtype, "--skip-tokenizer-init", "--max-running-requests", str(concurrency),
        "--weight-version", "0", "--random-seed", str(seed), "--base-gpu-id", str(base_gpu_id),
    ]
    if deterministic:  # per-request seeds are honoured only with it (rollout.sglang_deterministic_inference)
        command += ["--enable-deterministic-inference"]
    if priority_scheduling:  # lower first; a request without a priority last (sglang_api's module docstring)
        command += ["--enable-priority-scheduling", "--schedule-low-priority-values-first",
                    "--default-priority-value", str(sglang_api.MISSING_PRIORITY)]
    return ServerProcess(name=name, command=command + extra_args, log_path=log_dir / f"{name}.log",
                         url=f"http://{host}:{port}", api_key=api_key)


def _tail(path: Path, num_lines: int = 15) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()[-num_lines:]
    except OSError:
        return ""
    return "\n  last lines:\n    " + "\n    ".join(lines) if lines else ""
