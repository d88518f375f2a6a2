"""The gymnasium adapter (rollout/environments/gymnasium_env.py) driving a real Gymnasium FrozenLake by scripted
replies: rewards, endings, invalid replies, the row's seed, and the one-line errors of a bad row or config.

FrozenLake-v1, map 4x4, not slippery (cells 0-15 row by row; S start, F frozen, H hole, G goal):

    S F F F
    F H F H
    F F F H
    H F F G
"""

from __future__ import annotations

import re

import pytest

from rolloutpipe.rollout.environments.base import get_environment
from tests.conftest import assert_import_pulls_none_of

LAKE = {"id": "FrozenLake-v1", "kwargs": {"is_slippery": False, "map_name": "4x4"},
        "actions": ["left", "down", "right", "up"]}
TEST_MODEL_ALPHABET = re.compile(r"[0-9a-z=:+? ]*")
"""What the CPU test model's tokenizer knows: the repr mode's messages must stay inside it."""


@pytest.fixture
def make():
    """The registered gymnasium factory (skips, naming the extra, where gymnasium is not installed)."""
    pytest.importorskip("gymnasium", reason="needs the gymnasium extra: pip install -e '.[gymnasium]'")
    return get_environment("gymnasium")


def play(env, replies: list[str]) -> list:
    return [env.step(reply) for reply in replies]


def test_get_environment_returns_the_adapters_factory(make):
    from rolloutpipe.rollout.environments import gymnasium_env

    assert make is gymnasium_env.make_gymnasium_environment


def test_reaching_the_goal_gives_reward_one_and_ends_the_episode(make):
    env = make({**LAKE, "prompt": "reach the goal answer left down right or up"})
    assert env.reset(0, {"seed": 3}) == [{"role": "user", "content": "reach the goal answer left down right or up "
                                                                     "state 0"}]
    # The last action named counts, whatever the reasoning before it mentions (and in any case).
    turns = play(env, ["not down there is a hole so right", "right", "Down", "down", "down", "then right"])
    assert [t.messages[0]["content"] for t in turns] == ["state 1", "state 2", "state 6", "state 10", "state 14",
                                                         "state 15"]
    assert [t.reward for t in turns] == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert [t.done for t in turns] == [False] * 5 + [True]
    assert all(type(t.reward) is float and type(t.done) is bool for t in turns)  # they cross a pipe as JSON


def test_default_action_names_are_the_action_digits(make):
    env = make({"id": "FrozenLake-v1", "kwargs": {"is_slippery": False, "map_name": "4x4"}})
    env.reset(0, {"seed": 0})
    turns = play(env, ["2", "2", "1", "1", "1", "i pick 2"])
    assert turns[-1].reward == 1.0 and turns[-1].done


def test_falling_in_a_hole_ends_the_episode_with_reward_zero(make):
    env = make(LAKE)
    env.reset(0, {"seed": 0})
    turns = play(env, ["down", "right"])  # 0 -> 4 -> 5, a hole
    assert turns[-1].messages == [{"role": "user", "content": "state 5"}]
    assert (turns[-1].reward, turns[-1].done) == (0.0, True)


def test_a_truncated_episode_is_done(make):
    env = make({**LAKE, "kwargs": {**LAKE["kwargs"], "max_episode_steps": 2}})  # gymnasium.make's TimeLimit
    env.reset(0, {"seed": 0})
    turns = play(env, ["left", "up"])  # into the walls: still on the start cell, neither won nor lost
    assert [(t.messages[0]["content"], t.reward, t.done) for t in turns] == [("state 0", 0.0, False),
                                                                             ("state 0", 0.0, True)]


def test_invalid_replies_are_answered_then_end_the_episode_after_max_invalid_actions(make):
    env = make({**LAKE, "invalid_action_reward": -0.5, "max_invalid_actions": 2})
    env.reset(0, {"seed": 0})
    first = env.step("downhill i guess")  # a name inside a word is not a whole word: no action
    assert first.messages == [{"role": "user", "content": "invalid action use one of left down right up"}]
    assert (first.reward, first.done) == (-0.5, False)
    assert TEST_MODEL_ALPHABET.fullmatch(first.messages[0]["content"])
    moved = env.step("right")  # the lake did not move on the invalid reply
    assert moved.messages == [{"role": "user", "content": "state 1"}]
    second = env.step("")
    assert (second.reward, second.done) == (-0.5, True)


def test_one_invalid_reply_ends_the_episode_by_default(make):
    env = make(LAKE)
    env.reset(0, {"seed": 0})
    turn = env.step("jump")
    assert (turn.reward, turn.done) == (0.0, True)


def test_the_opening_depends_on_the_row_alone(make):
    args = {**LAKE, "prompt": "rules: go from 0 to 15 answer left down right or up"}
    first, second = make(args), make(args)
    assert first.reset(5, {"seed": 11}) == second.reset(5, {"seed": 11})
    assert first.reset(11, {}) == second.reset(11, {})  # an int label is the seed when metadata has none
    opening = first.reset(5, {"seed": 11})[0]["content"]
    assert TEST_MODEL_ALPHABET.fullmatch(opening), opening


def test_the_same_row_and_replies_replay_the_same_episode(make):
    """pool.py rebuilds an episode on a fresh worker by replaying its replies: on a slippery lake, where every move
    draws from the environment's random stream, that gives the same turns only if the row's seed is used."""
    slippery = {**LAKE, "kwargs": {"is_slippery": True, "map_name": "4x4"}}
    replies = ["right", "down", "right", "down", "left", "down", "right", "up", "right", "down"] * 2

    def episode(seed: int) -> list[tuple[str, float, bool]]:
        env = make(slippery)
        env.reset(0, {"seed": seed})
        turns = []
        for reply in replies:
            turn = env.step(reply)
            turns.append((turn.messages[0]["content"], turn.reward, turn.done))
            if turn.done:
                break
        return turns

    assert episode(7) == episode(7)
    assert len({tuple(episode(seed)) for seed in range(8)}) > 1  # the seed is what makes them alike


def test_ansi_observation_shows_the_rendered_map(make):
    env = make({**LAKE, "observation": "ansi", "prompt": "the lake"})
    opening = env.reset(0, {"seed": 0})[0]["content"]
    assert opening.startswith("the lake\n") and "FHFH\nFFFH\nHFFG" in opening


def test_a_row_without_a_seed_is_a_clear_value_error(make):
    env = make(LAKE)
    with pytest.raises(ValueError, match=r"needs metadata\.seed \(an int\) or an int label"):
        env.reset("the goal", {})
    with pytest.raises(ValueError, match=r"metadata\.seed\) must be a non-negative int, got '3'"):
        env.reset(0, {"seed": "3"})


def test_an_unknown_or_missing_id_is_a_value_error_naming_environment_args_id(make):
    with pytest.raises(ValueError, match=r"environment\.args\.id='NoSuchGame-v0' is not a Gymnasium environment"):
        make({"id": "NoSuchGame-v0"})
    with pytest.raises(ValueError, match=r"needs environment\.args\.id"):
        make({"kwargs": {"is_slippery": False}})


def test_bad_args_are_value_errors_naming_the_key(make):
    with pytest.raises(ValueError, match=r"environment\.args\.kwargs=\{'slippery': False\} do not fit FrozenLake"):
        make({"id": "FrozenLake-v1", "kwargs": {"slippery": False}})
    with pytest.raises(ValueError, match=r"environment\.args\.actions=\['left', 'down'\] must list 4 names"):
        make({"id": "FrozenLake-v1", "actions": ["left", "down"]})
    with pytest.raises(ValueError, match=r"unknown environment\.args key\(s\) \['action'\]"):
        make({"id": "FrozenLake-v1", "action": ["left", "down", "right", "up"]})


def test_a_non_discrete_action_space_is_refused_when_the_factory_runs(make):
    with pytest.raises(ValueError, match=r"Pendulum-v1 has the action space Box.*Discrete action spaces only"):
        make({"id": "Pendulum-v1"})


def test_importing_the_core_does_not_import_gymnasium():
    assert_import_pulls_none_of(["rolloutpipe", "rolloutpipe.config", "rolloutpipe.rollout.environments.base",
                                 "rolloutpipe.rollout.environments.pool"], ["gymnasium"])
