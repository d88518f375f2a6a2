"""The verifiers adapter (rollout/environments/verifiers_env.py) driving a real verifiers 0.4.0 environment.

Marker ``verifiers``. verifiers is installed in a virtualenv of its own (tests/environments/install_verifiers.sh);
without it these tests skip, and ``RP_REQUIRE_VERIFIERS=1`` turns the skip into a failure. Scripted model turns drive
tests/environments/vf_lookup.py (a lookup tool served over MCP, a rubric checking the reversed hidden string) through
verifiers' own episode: its ``null`` harness program (a uv script), its tool server process, its scoring.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from rolloutpipe.rollout.environments import base
from rolloutpipe.rollout.environments.base import Turn

pytestmark = pytest.mark.verifiers

HERE = Path(__file__).resolve().parent
EPISODE_END_S = 60.0
"""A guard against a hang: verifiers tears an episode down in about a second here."""


def _verifiers_or_skip() -> None:
    if importlib.util.find_spec("verifiers") is None:
        not_here = pytest.fail if os.environ.get("RP_REQUIRE_VERIFIERS") == "1" else pytest.skip
        not_here("verifiers is not installed here: bash tests/environments/install_verifiers.sh <venv> makes a "
                 "virtualenv with verifiers 0.4.0; run these tests with its python")


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module", autouse=True)
def vf_lookup_importable(monkeypatch_module):
    """verifiers imports a taskset by its package name and starts its tool server as ``python -m vf_lookup``; its
    harness program runs with uv, installed beside this python."""
    _verifiers_or_skip()
    monkeypatch_module.syspath_prepend(str(HERE))
    monkeypatch_module.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    monkeypatch_module.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    import vf_lookup

    from rolloutpipe.rollout.environments.verifiers_env import task_rows

    return task_rows(vf_lookup.ENV)


def episode(rows: list[dict], index: int, **args):
    import vf_lookup

    environment = base.get_environment("verifiers")({"env": vf_lookup.ENV, **args})
    assert environment.reset(rows[index]["label"], rows[index]["metadata"]) == []
    return environment


def hermes(name: str, **arguments: str) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def test_the_registered_factory_is_the_adapter():
    from rolloutpipe.rollout.environments import verifiers_env

    assert base.get_environment("verifiers") is verifiers_env.make_verifiers_environment


def test_args_without_a_verifiers_env_config_are_a_value_error_naming_the_fix():
    factory = base.get_environment("verifiers")
    for args in ({}, {"env": {}}, {"env": {"taskset": {"id": ""}}}):
        with pytest.raises(ValueError, match=r"environment\.args\.env must be a verifiers \[env\] config naming"):
            factory(args)
    with pytest.raises(ValueError, match=r"keys \['module'\] the verifiers adapter does not know"):
        factory({"module": "vf_lookup"})
    with pytest.raises(ValueError, match=r"tool_call_format='xml' is not one of \['hermes', 'line'\]"):
        factory({"env": {"taskset": {"id": "vf_lookup"}}, "tool_call_format": "xml"})


def test_rows_carry_the_prompt_verifiers_opens_each_task_with(rows):
    assert [row["metadata"] for row in rows] == [{"task": i} for i in range(4)]
    assert rows[0]["prompt"] == [{"role": "user", "content": "call lookup with key k1 then answer with its value "
                                                              "reversed"}]


def test_rows_from_another_taskset_are_refused_at_reset(rows):
    import vf_lookup

    environment = base.get_environment("verifiers")({"env": vf_lookup.ENV})
    with pytest.raises(ValueError, match=r"metadata\.task=None must be the index"):
        environment.reset(rows[0]["label"], {})
    with pytest.raises(ValueError, match=r"metadata\.task=4 is past the end of taskset 'vf_lookup'"):
        environment.reset(rows[0]["label"], {"task": 4})
    with pytest.raises(ValueError, match=r"the label of task 1 is not its verifiers key"):
        environment.reset(rows[0]["label"], {"task": 1})


def test_calling_the_tool_then_answering_its_value_reversed_earns_1(rows):
    environment = episode(rows, 0)
    assert environment.step(hermes("lookup", key="k1")) == Turn(messages=[{"role": "tool", "content": "abc"}])
    assert environment.step("cba") == Turn(done=True, reward=1.0)


def test_a_wrong_answer_after_the_tool_earns_0(rows):
    environment = episode(rows, 0)
    assert environment.step(hermes("lookup", key="k1")) == Turn(messages=[{"role": "tool", "content": "abc"}])
    assert environment.step("abc") == Turn(done=True, reward=0.0)


def test_an_answer_without_a_tool_call_ends_the_episode_and_is_scored(rows):
    assert episode(rows, 2).step("the value is secret") == Turn(done=True, reward=0.0)
    assert episode(rows, 2).step("a1dd") == Turn(done=True, reward=1.0)  # the rubric checks the answer alone


def test_line_tool_calls_keep_to_the_tiny_alphabet(rows):
    environment = episode(rows, 1, tool_call_format="line")
    assert environment.step("call lookup key=k2") == Turn(messages=[{"role": "tool", "content": "bdca"}])
    assert environment.step("acdb") == Turn(done=True, reward=1.0)


def live_routes() -> set[str]:
    from rolloutpipe.rollout.environments import verifiers_env

    return {route for runner in verifiers_env._RUNNERS.values() for route in runner._live}


def test_an_episode_closed_before_its_end_is_torn_down_by_verifiers(rows):
    for drop in (False, True):
        environment = episode(rows, 3)
        assert environment.step(hermes("lookup", key="k4")) == Turn(messages=[{"role": "tool", "content": "zq9"}])
        live = environment._live
        if drop:
            del environment  # what the pool does to an episode it evicts
        else:
            environment.close()
        kind, value = live.events.get(timeout=EPISODE_END_S)  # run_episode itself ended, its harness stopped
        assert (kind, type(value)) == ("error", asyncio.CancelledError)
        assert live.route not in live_routes()


def test_a_conversation_that_is_not_the_episodes_is_refused():
    from rolloutpipe.rollout.environments.verifiers_env import _Live

    live = _Live(None, "route")
    live.num_answered = 1
    live.events.put(("request", [{"role": "user", "content": "the prompt again"}]))  # a retry starts over
    with pytest.raises(RuntimeError, match="0 assistant turns where this episode has 1: a retry or a compaction"):
        live.next_call()


def test_hermes_and_line_parsing_keep_what_is_not_a_call_as_content():
    from rolloutpipe.rollout.environments.verifiers_env import parse_hermes, parse_line

    assert parse_hermes(f"first the key {hermes('lookup', key='k1')}") == ("first the key",
                                                                           [("lookup", '{"key": "k1"}')])
    assert parse_hermes('<tool_call>{"name": "lookup", "arguments": "{bad"}</tool_call>') == (
        "", [("lookup", "{bad")])  # the harness answers invalid argument JSON with a tool error
    assert parse_hermes("<tool_call>not json</tool_call> cba") == ("<tool_call>not json</tool_call> cba", [])
    assert parse_line("look it up\ncall lookup key=k1 n=2") == ("look it up", [("lookup", '{"key": "k1", "n": "2"}')])
    assert parse_line("calls lookup key=k1") == ("calls lookup key=k1", [])


def test_a_verifiers_environment_trains_end_to_end(rows, tmp_path):
    """Two steps of ``python launch.py`` on vf_lookup: our engine's turns, verifiers' harness, tools and rubric, our
    trainer. The untrained tiny model rarely writes a tool call, so the episodes are mostly one turn scored 0; what
    this checks is the whole path, every episode rewarded by verifiers without an error."""
    from tests.conftest import SMALL, read_metrics, read_samples, run_job

    path = tmp_path / "vf_lookup.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run_dir = tmp_path / "run"
    result = run_job(
        run_dir, *SMALL, "environment.name=verifiers", "environment.num_workers=2", "environment.timeout_s=300",
        "environment.max_turns=4", "environment.max_turn_tokens=8", "+environment.args.tool_call_format=line",
        '+environment.args.env={taskset: {id: vf_lookup}, agent: {harness: {id: "null"}, runtime: {type: '
        'subprocess}, max_turns: 4}}', "rollout_max_response_len=120", f"data.path={path}",
        "data.apply_chat_template=true", "eval.interval=0", "run.save_samples=true", timeout_s=900,
        environ={"PYTHONPATH": os.environ["PYTHONPATH"] + os.pathsep + str(HERE.parent.parent),
                 "PATH": os.environ["PATH"]})
    assert result.returncode == 0, result.stderr[-3000:]
    samples = read_samples(run_dir)
    assert len(samples) == 32 and all(s["reward_error"] is None for s in samples), samples[:2]
    assert [m["rollout/num_samples"] for m in read_metrics(run_dir)] == [16, 16]
