"""The ``verifiers`` adapter: a verifiers v1 environment (prime-intellect's ``verifiers`` 0.4.0) as our Environment.

verifiers runs an episode itself: ``Env.run_episode(task, ctx)`` starts the task's harness program (a chat loop,
e.g. the ``null`` harness), which calls the model at an OpenAI-compatible endpoint, runs the tool calls of each reply
on the taskset's MCP tool servers (``vf.Toolset``), sends the results back with its next call, ends when a reply has
no tool call (or a limit or ``@vf.stop`` ends it), and then scores the trace with the task's ``@vf.reward``s. The
model is the one thing verifiers does not own, and the only place it accepts one from outside is that endpoint (it
builds its own ``Client`` from a config), so that is the seam: the adapter serves the endpoint, on 127.0.0.1, and
turns verifiers' pull loop into our push protocol::

    ours (worker thread)                         verifiers (event loop thread of this module)
    step(text)                                    harness: POST /v1/chat/completions (messages so far)
      hands text, parsed into content + tool calls ---> endpoint answers that call
      waits                                       harness runs the tool calls, POSTs again with their results
      <--- the new messages (tool results, a user turn): Turn(messages), or, once run_episode returns,
           Turn(done=True, reward=the trace's rewards)

Mapping:
  * ``args.env``: verifiers' own ``[env]`` config (what ``vf-eval`` reads from TOML), built with
    ``vf.load_environment(vf.resolve_env_config(env))``. ``taskset.id`` names the taskset package: in verifiers v1 a
    top-level module exporting its ``vf.Taskset`` in ``__all__`` (there is no ``load_environment(**kwargs)`` module
    convention in v1). Pin the seat's harness and runtime there: verifiers' defaults are the ``bash`` harness (the
    model gets a shell) in a Prime cloud sandbox.
  * A row is one verifiers task: ``metadata.task`` is its index in the taskset, ``label`` its key (verifiers'
    content hash of the task), checked so that rows made from another version of the taskset are refused. The row's
    prompt is verifiers' prompt for the task: ``task_rows`` writes the rows, so ``reset`` returns no messages.
  * A model turn is one call to the endpoint; what verifiers sends back before the next call (after the last
    assistant message) is the environment's turn, as ``{"role", "content"}`` messages. The reward is the sum of the
    episode's trainable traces' rewards (its rubric, weights applied), on the final Turn; earlier turns get 0.
  * Tool calls: the harness executes structured OpenAI ``tool_calls``, and verifiers has no parser from text (its
    ``renderers`` parse token ids with a model's own tokenizer), so the adapter parses the turn's text:
    ``tool_call_format: hermes`` (default) reads ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    blocks, the format of Qwen's chat templates and of renderers' Qwen3 parser, the text before the first block
    being the reply's content; ``line`` reads lines ``call NAME KEY=VALUE ...`` (every argument a string), the other
    lines being the content. A block or line that does not parse is left as text. No tool call: the final answer.

Limits:
  * Text, not tokens: verifiers sees our decoded text and answers with messages that our chat template renders;
    the tokens stay ours (episodes.py). The request's ``tools`` list never reaches our prompt (rows are rendered
    without tools), so a task's prompt must describe its tools; sampling settings in the request are ignored.
  * Every model call of the episode is a turn of it, so a harness that calls the model for something else
    (``compaction`` summaries) or an episode retry (``retries``) gives verifiers a conversation that is not the one our
    model saw: the step raises, naming it. Every agent of a multi-agent env would be our model: use one-seat envs.
  * verifiers runs harness programs as uv scripts (``uv`` must be on PATH; the first episode of a machine downloads
    the program's packages, later ones reuse uv's cache, so give the first call a long ``environment.timeout_s``) and
    tool servers as ``python -m <toolset module>`` processes: the taskset package must be importable by them.
  * An episode our side ends early (its turn or token limit) leaves verifiers waiting for the next model call:
    ``close()``, or dropping the object, cancels it (harness, tool servers and runtime torn down by verifiers).

Concurrency: one ``_Runner`` per worker process and env config (verifiers shares its taskset's tool servers across an
environment worker's episodes), created at the first factory call, its loop thread started at the first ``step``:

    loop thread    consumes: episode starts, step answers (call_soon_threadsafe); produces: one event per model call
                   or episode end, on the episode's queue; waits for: verifiers (tools, scoring) and the endpoint's
                   answers; shuts down at process exit (atexit: live episodes cancelled, ``Env.serving`` exited), or
                   dies with the process (verifiers' tool servers die with this thread: PR_SET_PDEATHSIG).
    worker thread  ``step`` waits on its episode's queue; unblocked by the next model call or the episode's end.

Example (rows: ``task_rows(env)`` written as jsonl; ``vf_lookup`` is tests/environments/vf_lookup.py)::

    data: {path: vf_lookup.jsonl}
    environment:
      name: verifiers
      timeout_s: 300
      args:
        tool_call_format: hermes
        env:
          taskset: {id: vf_lookup}
          agent: {harness: {id: "null"}, runtime: {type: subprocess}, max_turns: 4}  # "null" quoted: not YAML's null
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import copy
import json
import os
import queue
import re
import secrets
import shutil
import socket
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from rolloutpipe.rollout.environments.base import Message, Turn, register_environment

ToolCall = tuple[str, str]
"""(tool name, its arguments as a JSON string), as the harness receives it."""
Parser = Callable[[str], tuple[str, list[ToolCall]]]
"""A model turn's text -> (its content, its tool calls)."""

_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_CALL_LINE = re.compile(r"call ([^\s=]+)((?: [^\s=]+=\S*)*)")


def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks; content: the text before the first."""
    calls = []
    for block in _HERMES_BLOCK.findall(text):
        try:
            call = json.loads(block)
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            continue
        arguments = call.get("arguments", {})
        # A string is passed on as it is: invalid JSON there comes back to the model as the tool's error.
        calls.append((call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments)))
    return (text[:text.index("<tool_call>")] if calls else text).strip(), calls


def parse_line(text: str) -> tuple[str, list[ToolCall]]:
    """Lines ``call NAME KEY=VALUE ...`` (string arguments); content: the other lines."""
    content, calls = [], []
    for line in text.splitlines():
        if match := _CALL_LINE.fullmatch(line.strip()):
            arguments = dict(pair.split("=", 1) for pair in match[2].split())
            calls.append((match[1], json.dumps(arguments)))
        else:
            content.append(line)
    return "\n".join(content).strip(), calls


PARSERS: dict[str, Parser] = {"hermes": parse_hermes, "line": parse_line}
"""``args.tool_call_format`` -> how a turn's text becomes tool calls."""

_ARGS = ("env", "tool_call_format")
_NO_KEY_VARIABLE = "ROLLOUTPIPE_VERIFIERS_ENDPOINT_KEY"
"""The variable verifiers reads the endpoint's API key from: unset, so it sends "EMPTY" (the endpoint is ours)."""
_SHUTDOWN_S = 10.0
_RUNNERS: dict[str, _Runner] = {}


@register_environment("verifiers")
def make_verifiers_environment(args: dict[str, Any]) -> VerifiersEpisode:
    """One episode of the verifiers environment ``args.env`` (see the module docstring)."""
    if unknown := sorted(set(args) - set(_ARGS)):
        raise ValueError(f"environment.args has keys {unknown} the verifiers adapter does not know; it takes {_ARGS}.")
    env = args.get("env")
    taskset = env.get("taskset") if isinstance(env, dict) else None
    if not isinstance(taskset, dict) or not isinstance(taskset.get("id"), str) or not taskset["id"]:
        raise ValueError("environment.args.env must be a verifiers [env] config naming its taskset package, e.g. "
                         "{taskset: {id: my_taskset}, agent: {harness: {id: 'null'}, runtime: {type: subprocess}}}.")
    tool_call_format = args.get("tool_call_format", "hermes")
    if tool_call_format not in PARSERS:
        raise ValueError(f"environment.args.tool_call_format={tool_call_format!r} is not one of {sorted(PARSERS)}.")
    key = json.dumps(env, sort_keys=True)
    if key not in _RUNNERS:
        _RUNNERS[key] = _Runner(env)
    return VerifiersEpisode(_RUNNERS[key], PARSERS[tool_call_format])


def task_rows(env: dict[str, Any], num_rows: int | None = None) -> list[dict[str, Any]]:
    """Our data rows (``{"prompt", "label", "metadata"}``, data.py) for the tasks of the verifiers [env] config
    ``env``: all of them, or the first ``num_rows`` (needed for an infinite taskset). Each prompt is the messages the
    env's harness opens the task with, which the adapter checks at the episode's first model call."""
    import verifiers.v1 as vf

    environment = _load(vf, env)
    harness = _harness(vf, environment)
    tasks = environment.taskset if num_rows is None else environment.taskset.take(num_rows)
    if not tasks.bounded:
        raise ValueError(f"taskset {env['taskset']['id']!r} is infinite: pass num_rows.")
    return [{"prompt": _prompt(harness, task), "label": task.key, "metadata": {"task": task.data.idx}}
            for task in tasks]


def _load(vf, env: dict[str, Any]):
    try:
        return vf.load_environment(vf.resolve_env_config(copy.deepcopy(env)))
    except (ImportError, ValueError, TypeError) as err:  # pydantic's ValidationError is a ValueError
        raise ValueError(f"environment.args.env is not a verifiers environment here: {err}") from err


def _harness(vf, environment):
    """The harness of the env's one agent (which opens each task's conversation: ``_prompt``)."""
    harnesses = list(environment.config.agent_harnesses().values())
    if len(harnesses) != 1:
        raise ValueError(f"environment.args.env has {len(harnesses)} agents; the verifiers adapter drives one.")
    return vf.load_harness(harnesses[0])


def _prompt(harness, task) -> list[Message]:
    """The messages ``harness`` opens ``task`` with: where the system prompt goes is the harness's choice
    (``Harness.resolve_prompt``)."""
    system, prompt = harness.resolve_prompt(task.data)
    messages = [{"role": "system", "content": system}] if system else []
    if isinstance(prompt, str):
        return [*messages, {"role": "user", "content": prompt}]
    return [*messages, *(_message(message.model_dump()) for message in prompt)]


class VerifiersEpisode:
    """One episode of a verifiers env (our Environment): its task from ``reset``, verifiers' episode from the first
    ``step``."""

    def __init__(self, runner: _Runner, parse: Parser) -> None:
        self._runner, self._parse = runner, parse
        self._task = None
        self._live: _Live | None = None

    def reset(self, label: Any, metadata: dict[str, Any]) -> list[Message]:
        index = metadata.get("task")
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise ValueError(f"metadata.task={index!r} must be the index of a task of the verifiers taskset "
                             "(rows from verifiers_env.task_rows).")
        self._task = self._runner.task(index)
        if self._task is None:
            raise ValueError(f"metadata.task={index} is past the end of taskset {self._runner.taskset_id!r}; "
                             "write the rows again with verifiers_env.task_rows.")
        if label != self._task.key:
            raise ValueError(f"the label of task {index} is not its verifiers key {self._task.key!r}: the rows come "
                             "from another version of the taskset; write them again with verifiers_env.task_rows.")
        return []

    def step(self, response: str) -> Turn:
        if self._live is None:
            self._live = self._runner.start(self._task)
            weakref.finalize(self, self._live.close)
            if isinstance(opening := self._live.next_call(), Turn):  # it ended before calling the model
                return opening
            if (sent := [_message(m) for m in opening]) != (prompt := self._runner.prompt(self._task)):
                raise RuntimeError(f"verifiers opened task {self._task.data.idx} with {sent}, not with its row's "
                                   f"prompt {prompt}: write the rows again with verifiers_env.task_rows.")
        self._live.answer(*self._parse(response))
        call = self._live.next_call()
        if isinstance(call, Turn):
            return call
        last = max(i for i, message in enumerate(call) if message.get("role") == "assistant")
        return Turn(messages=[_message(m) for m in call[last + 1:]])

    def close(self) -> None:
        """Cancel the episode if it is still running (our side ended it first)."""
        if self._live is not None:
            self._live.close()


class _Closed(Exception):
    """The episode was cancelled while its harness waited for the model."""


class _Live:
    """One running verifiers episode, shared by the worker thread (``next_call``, ``answer``, ``close``) and the loop
    thread (``request``, ``ended``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, route: str) -> None:
        self.loop, self.route = loop, route
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.reply: asyncio.Future | None = None
        """The endpoint's call waiting for the model (loop thread)."""
        self.future: Future | None = None
        """``Env.run_episode``'s, cancelled by ``close``."""
        self.num_answered = 0

    # worker thread
    def next_call(self) -> list[dict[str, Any]] | Turn:
        """The messages of the harness's next model call, checked to extend this episode's conversation; or the
        episode's end."""
        kind, value = self.events.get()
        if kind == "error":
            raise RuntimeError(f"the verifiers episode failed: {type(value).__name__}: {value}") from value
        if kind == "done":
            return Turn(done=True, reward=_reward(value))
        if (num_assistant := sum(m.get("role") == "assistant" for m in value)) != self.num_answered:
            raise RuntimeError(f"verifiers called the model with {num_assistant} assistant turns where this episode "
                               f"has {self.num_answered}: a retry or a compaction rewrote the conversation; set the "
                               "env's and agent's retries to 0 and the harness's compaction off.")
        return value

    def answer(self, content: str, calls: list[ToolCall]) -> None:
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [
                {"id": f"call_{self.num_answered}_{i}", "type": "function",
                 "function": {"name": name, "arguments": arguments}}
                for i, (name, arguments) in enumerate(calls)
            ]
        self.num_answered += 1
        self.loop.call_soon_threadsafe(_resolve, self.reply, message)

    def close(self) -> None:
        if self.future is not None:
            self.future.cancel()

    # loop thread
    async def request(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        self.reply = self.loop.create_future()
        self.events.put(("request", messages))
        return await self.reply

    def ended(self, kind: str, value: Any) -> None:
        if self.reply is not None and not self.reply.done():
            self.reply.set_exception(_Closed())
        self.events.put((kind, value))


def _resolve(reply: asyncio.Future, message: dict[str, Any]) -> None:
    if not reply.done():  # (cancelled meanwhile)
        reply.set_result(message)


def _message(message: dict[str, Any]) -> Message:
    """An OpenAI chat message as ours: its role and its content as text (verifiers sends a string, or a list of
    parts for a multi-part tool result)."""
    content = message.get("content")
    if isinstance(content, list):
        content = "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    return {"role": message["role"], "content": content or ""}


def _reward(episode) -> float:
    """The reward of a finished verifiers episode; an episode that failed raises, with verifiers' first error."""
    if not episode.ok:
        errors = [*episode.errors, *(error for trace in episode.traces for error in trace.errors)]
        why = f"{errors[0].type}: {errors[0].message}" if errors else "no error recorded"
        raise RuntimeError(f"the verifiers episode failed: {why}")
    return sum(trace.reward for trace in episode.traces if trace.agent is None or trace.agent.trainable)


class _Runner:
    """One verifiers Env per worker process and env config, run on an event loop thread of its own beside the
    endpoint its episodes' harnesses call (see the module docstring's concurrency block)."""

    def __init__(self, env: dict[str, Any]) -> None:
        import verifiers.v1 as vf

        # verifiers would otherwise install uv itself, into ~/.local (pip --user, or curl | sh), at the first episode.
        search = os.pathsep.join([str(Path.home() / ".local" / "bin"), os.environ.get("PATH", "")])
        if shutil.which("uv", path=search) is None:
            raise ValueError("verifiers runs its harness programs with uv, which is not on PATH: pip install uv into "
                             "this environment's virtualenv and put its bin directory on PATH.")
        self._vf = vf
        self.env = _load(vf, env)
        self._harness = _harness(vf, self.env)
        self.taskset_id = env["taskset"]["id"]
        self._tasks: list[Any] = []
        self._unread = iter(self.env.taskset)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: Future | None = None
        """The endpoint's base URL once ``Env.serving`` is entered; its exception if that failed."""
        self._live: dict[str, _Live] = {}
        self._stop: asyncio.Event | None = None
        self._serving: Future | None = None

    def task(self, index: int):
        """Task ``index`` of the taskset (None past its end), read lazily: a taskset may be infinite."""
        while len(self._tasks) <= index:
            if (task := next(self._unread, None)) is None:
                return None
            self._tasks.append(task)
        return self._tasks[index]

    def prompt(self, task) -> list[Message]:
        return _prompt(self._harness, task)

    def start(self, task) -> _Live:
        """Start verifiers' episode of ``task``; its harness's first model call is the live episode's first event."""
        base_url = self._serve()
        route = f"rolloutpipe-{secrets.token_hex(8)}"  # the model name verifiers puts in each call: routes it here
        live = self._live[route] = _Live(self._loop, route)
        ctx = self._vf.ModelContext(model=route, client=self._vf.EvalClientConfig(base_url=base_url,
                                                                                  api_key_var=_NO_KEY_VARIABLE))
        live.future = asyncio.run_coroutine_threadsafe(self._episode(task, ctx, live), self._loop)
        return live

    async def _episode(self, task, ctx, live: _Live) -> None:
        try:
            episode = await self.env.run_episode(task, ctx)
        except BaseException as err:  # (a cancellation: close(); nobody waits for this event then)
            live.ended("error", err)
            raise
        else:
            live.ended("done", episode)
        finally:
            self._live.pop(live.route, None)

    def _serve(self) -> str:
        """The endpoint's base URL, starting the loop thread, the endpoint and ``Env.serving`` the first time."""
        if self._ready is None:
            self._loop = asyncio.new_event_loop()
            self._ready, self._stop = Future(), asyncio.Event()
            threading.Thread(target=self._loop.run_forever, name="verifiers-env", daemon=True).start()
            self._serving = asyncio.run_coroutine_threadsafe(self._run_serving(), self._loop)
            atexit.register(self._shutdown)
        return self._ready.result()

    async def _run_serving(self) -> None:
        """The endpoint and the env's shared resources (its taskset's tool servers), entered and exited in this one
        task, held until ``_shutdown``."""
        from aiohttp import web

        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._complete)
        site_runner = web.AppRunner(app, access_log=None)
        try:
            await site_runner.setup()
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            await web.SockSite(site_runner, sock).start()
            async with self.env.serving():
                self._ready.set_result(f"http://127.0.0.1:{sock.getsockname()[1]}/v1")
                await self._stop.wait()
        except BaseException as err:
            if not self._ready.done():
                self._ready.set_exception(err)
            raise
        finally:
            await site_runner.cleanup()

    async def _complete(self, request):
        """``POST /v1/chat/completions`` from verifiers: hand the call to its episode, answer with our model's turn
        (a server-sent event stream when asked for one, as the harness programs do)."""
        from aiohttp import web
        from verifiers.v1.dialects import ChatDialect

        body = await request.json()
        live = self._live.get(body.get("model"))
        if live is None:
            return web.json_response({"error": {"message": "no such rolloutpipe episode"}}, status=404)
        try:
            message = await live.request(body.get("messages") or [])
        except _Closed:
            return web.json_response({"error": {"message": "the rolloutpipe episode was closed"}}, status=409)
        completion = {
            "id": f"{live.route}-{live.num_answered}", "object": "chat.completion", "created": int(time.time()),
            "model": live.route, "usage": None,
            "choices": [{"index": 0, "message": message,
                         "finish_reason": "tool_calls" if "tool_calls" in message else "stop"}],
        }
        if body.get("stream"):
            return web.Response(body=b"".join(ChatDialect().stream_events(completion)),
                                content_type="text/event-stream")
        return web.json_response(completion)

    def _shutdown(self) -> None:
        """At process exit: cancel the live episodes, leave ``Env.serving`` (its tool servers stop), stop the loop."""
        for live in list(self._live.values()):
            live.close()
        self._loop.call_soon_threadsafe(self._stop.set)
        # The process is exiting: whatever went wrong, verifiers' tool servers die with the loop thread anyway.
        with contextlib.suppress(Exception):
            self._serving.result(timeout=_SHUTDOWN_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
