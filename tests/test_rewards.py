import threading

import pytest

from rolloutpipe.rollout.rewards import (
    RewardConfig,
    RewardPool,
    extract_final_answer,
    get_reward,
    gpqa_reward,
    math_reward,
    register_reward,
)
from rolloutpipe.rollout.tasks import reversal_reward

FAULTY = ["tests.fixtures.faulty_rewards"]


def faulty_pool(name: str, **overrides) -> RewardPool:
    return RewardPool(RewardConfig(name=name, import_modules=FAULTY, **overrides))


# ---- the registry and config -------------------------------------------------------------------


def test_builtin_rewards_are_registered_by_name():
    assert get_reward("synthetic") is reversal_reward
    assert get_reward("math") is math_reward
    assert get_reward("gpqa") is gpqa_reward


def test_registering_a_taken_name_fails():
    with pytest.raises(ValueError, match="'math' is already registered"):
        register_reward("math")(lambda response, label, metadata: 0.0)


@pytest.mark.parametrize(
    "overrides, message",
    [({"timeout_s": 0}, "reward.timeout_s=0"), ({"num_workers": 0}, "reward.num_workers=0")],
)
def test_reward_config_names_the_bad_key(overrides, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        RewardConfig(**overrides)


# ---- math --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response, label",
    [
        ("so x = 1/2, hence \\boxed{\\frac{1}{2}}", "0.5"),
        ("first \\boxed{3}, no wait: \\boxed{4}", "4"),
        ("\\boxed{\\{1, 2\\}}", "\\{2,1\\}"),
        ("The sum is 1 + x^2.\nAnswer: x^2 + 1", "1+x^2"),
        ("Answer: 3\nAnswer: $\\sqrt{2}$.", "\\sqrt{2}"),
        ("Answer: 12", 12),
        ("\\boxed{7}", "$7$"),
    ],
)
def test_math_reward_accepts_boxed_and_answer_forms(response, label):
    assert math_reward(response, label, {}) == 1.0


@pytest.mark.parametrize(
    "response, label",
    [
        ("\\boxed{4} then \\boxed{3}", "4"),
        ("Answer: 5", "4"),
        ("the answer is 4", "4"),
        ("", "4"),
    ],
)
def test_math_reward_rejects_wrong_or_missing_answers(response, label):
    assert math_reward(response, label, {}) == 0.0


def test_final_answer_is_the_last_balanced_box():
    assert extract_final_answer("\\boxed{a} x \\boxed{\\frac{1}{2}} y") == "\\frac{1}{2}"
    assert extract_final_answer("\\boxed{a} then truncated \\boxed{\\frac{1}{") == "a"
    assert extract_final_answer("Answer: 5 \\boxed{6}") == "6"
    assert extract_final_answer("Answer: 7\nbecause reasons") == "7"
    assert extract_final_answer("Answer:") is None


def test_unparseable_math_label_is_an_error_not_a_zero():
    with pytest.raises(ValueError, match="cannot parse the label"):
        math_reward("\\boxed{1}", "", {})


# ---- gpqa --------------------------------------------------------------------------------------

CHOICES = {"choices": ["4 m/s", "8 m/s", "16 m/s", "32 m/s"]}


@pytest.mark.parametrize(
    "label",
    ["B", "b", 1, "8 m/s", " 8 m/s "],
    ids=["letter", "lowercase-letter", "index", "text", "text-with-spaces"],
)
def test_gpqa_reward_accepts_letter_index_and_text_labels(label):
    assert gpqa_reward("It doubles twice. Answer: B", label, CHOICES) == 1.0
    assert gpqa_reward("It doubles once. Answer: C", label, CHOICES) == 0.0


@pytest.mark.parametrize(
    "response, reward",
    [
        ("Answer: B", 1.0),
        ("**Answer:** (B)", 1.0),
        ("answer: B.", 1.0),
        ("\\boxed{B}", 1.0),
        ("\\boxed{\\text{B}}", 1.0),
        ("Not (A), so (B)", 1.0),
        ("Answer: B ... on reflection (C)", 0.0),
        ("Answer: Because it doubles", 0.0),
        ("I cannot tell", 0.0),
    ],
)
def test_gpqa_reward_takes_the_last_stated_choice(response, reward):
    assert gpqa_reward(response, "B", CHOICES) == reward


def test_gpqa_letters_extend_with_more_choices():
    six = {"choices": ["1", "2", "3", "4", "5", "6"]}
    assert gpqa_reward("Answer: F", 5, six) == 1.0
    assert gpqa_reward("Answer: E", "5", six) == 1.0  # text label "5" is choice E
    assert gpqa_reward("(A) is wrong; (E)", "E", six) == 1.0
    assert gpqa_reward("(A) is right; (E)", "A", CHOICES) == 1.0  # no E among four choices: (E) is prose


@pytest.mark.parametrize("label", ["Z", 4, "64 m/s", None])
def test_gpqa_label_that_names_no_choice_is_an_error(label):
    with pytest.raises(ValueError, match="is not a letter A-D, a 0-based index below 4"):
        gpqa_reward("Answer: A", label, CHOICES)


# ---- the pool ----------------------------------------------------------------------------------


def test_pool_scores_like_the_function_from_many_threads():
    cases = [("dba", "dba"), ("dbx", "dba"), ("cc", "abc"), ("", "ab")] * 10
    results = [None] * len(cases)

    with RewardPool(RewardConfig(name="synthetic", num_workers=2)) as pool:

        def score(i):
            results[i] = pool.score(cases[i][0], cases[i][1], {})

        threads = [threading.Thread(target=score, args=(i,)) for i in range(len(cases))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    for (response, label), outcome in zip(cases, results):
        assert outcome.error is None
        assert outcome.reward == reversal_reward(response, label, {})
        assert outcome.elapsed_s >= 0


def test_reward_exception_gives_zero_and_records_error():
    with faulty_pool("raises") as pool:
        outcome = pool.score("xyz", "fail", {})
        assert (outcome.reward, outcome.error, outcome.timed_out) == (0.0, "ValueError: cannot score 'xyz'", False)
        assert pool.score("xyz", "ok", {}).reward == 1.0


def test_reward_timeout_gives_zero_marked_as_a_timeout_and_pool_recovers():
    """Marked: reward.on_timeout (not the error text) decides whether its group is trained."""
    with faulty_pool("hangs", timeout_s=0.5) as pool:
        outcome = pool.score("x", "hang", {})
        assert (outcome.reward, outcome.error, outcome.timed_out) == (0.0, "timeout after 0.5 s", True)
        assert outcome.elapsed_s >= 0.5
        after = pool.score("x", "ok", {})
        assert (after.reward, after.error) == (1.0, None)


def test_dead_worker_is_restarted():
    with faulty_pool("dies") as pool:
        outcome = pool.score("x", "die", {})
        assert outcome.reward == 0.0 and "worker died (exit code 3)" in outcome.error and not outcome.timed_out
        assert pool.score("x", "ok", {}).reward == 1.0


@pytest.mark.parametrize("label, shown", [("text", "'1.0' (str)"), ("nan", "nan (float)")])
def test_non_number_reward_gives_zero_with_error(label, shown):
    with faulty_pool("not_a_number") as pool:
        outcome = pool.score("x", label, {})
    assert outcome.reward == 0.0
    assert outcome.error == f"the reward returned {shown}, not a finite number"


def test_unknown_reward_fails_at_construction_listing_known_names():
    with pytest.raises(ValueError, match=r"unknown reward 'nope'; known: \['gpqa', 'math', 'synthetic'\]"):
        RewardPool(RewardConfig(name="nope"))


def test_missing_reward_module_fails_at_construction():
    with pytest.raises(ValueError, match="ModuleNotFoundError: No module named 'no_such_rewards'"):
        RewardPool(RewardConfig(import_modules=["no_such_rewards"]))


def test_inputs_that_are_not_json_give_zero_with_error():
    with RewardPool(RewardConfig()) as pool:
        outcome = pool.score("x", {1, 2}, {})
    assert outcome.reward == 0.0 and "not JSON data" in outcome.error


def test_reward_workers_stay_light():
    with faulty_pool("heavy_modules_loaded") as pool:
        outcome = pool.score("", "", {})
    assert (outcome.reward, outcome.error) == (0.0, None)
