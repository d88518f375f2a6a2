import json
import logging
import threading
from pathlib import Path

import pytest

from rolloutpipe.rollout import rewards
from rolloutpipe.rollout.answers import boxes, final_math_answer
from rolloutpipe.rollout.rewards import (
    RewardConfig,
    RewardPool,
    get_reward,
    gpqa_reward,
    limit_math_verify_time,
    math_reward,
    register_reward,
)
from rolloutpipe.rollout.tasks import reversal_reward

MATH_VERIFY_PAIRS = Path(__file__).parent.parent / "fixtures" / "math_verify_pairs.jsonl"

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
        ("\\boxed{\\{1, 2\\}}", "\\{2,1\\}"),
        ("The sum is 1 + x^2.\nAnswer: x^2 + 1", "1+x^2"),
        ("Answer: 3\nAnswer: $\\sqrt{2}$.", "\\sqrt{2}"),
        ("Answer: 12", 12),
        ("\\boxed{7}", "$7$"),
        ("the answer is 4", "4"),
    ],
)
def test_math_reward_accepts_boxed_and_answer_forms(response, label):
    assert math_reward(response, label, {}) == 1.0


@pytest.mark.parametrize(
    "response, label",
    [
        ("\\boxed{4} then \\boxed{3}", "4"),
        ("Answer: 5", "4"),
        ("", "4"),
        ("<think>so it is 4, Answer: 4", "4"),
    ],
)
def test_math_reward_rejects_wrong_or_missing_answers(response, label):
    assert math_reward(response, label, {}) == 0.0


@pytest.mark.parametrize(
    "response, label, reward",
    [
        ("The integers are \\boxed{-2} and \\boxed{1}.", "1,-2", 1.0),
        ("The two solutions: $\\boxed{3}$ or $\\boxed{-5}$", "\\{-5, 3\\}", 1.0),
        ("The integers are \\boxed{-2} and \\boxed{1}.", "1", 0.0),  # a set of two is not one of them
        ("first \\boxed{3}, no wait: \\boxed{4}", "4", 0.0),  # hedging with two boxes: math-verify's {3, 4}
        ("So \\boxed{15}.\n\n**Final Answer**\n\\boxed{15}", "15", 1.0),
        ("$\\boxed{1}\\boxed{2}$", "$\\{1, 2\\}$", 1.0),
    ],
)
def test_math_reward_reads_every_boxed_answer_as_math_verify_does(response, label, reward):
    assert math_reward(response, label, {}) == reward


@pytest.mark.parametrize(
    "response, label, reward",
    [
        ("<think>Try x = 5: \\boxed{5}. No, recheck.</think>\nThe count is 7.\nAnswer: 7", "7", 1.0),
        ("<think>Try x = 5: \\boxed{5}. No, recheck.</think>\nThe count is 7.\nAnswer: 7", "5", 0.0),
        ("<think>x is \\boxed{5}</think>So the answer is \\boxed{7}.", "7", 1.0),
        ("We found \\boxed{5} for x, and y = 2x - 3.\nAnswer: 7", "7", 1.0),
        ("<think>the answer is 6</think>", "6", 1.0),  # nothing after the thinking: its statement counts
        ("<think>Maybe 6. Answer: 6. Hmm, but then", "6", 0.0),  # truncated thinking: no answer
    ],
)
def test_math_reward_takes_the_final_statement_after_the_thinking(response, label, reward):
    assert math_reward(response, label, {}) == reward


@pytest.mark.parametrize(
    "response",
    [
        "It costs \\$18.90 in total.\nAnswer: \\$18.90",
        "Two items at \\$9.45 each: \\boxed{\\$18.90}",
        "Two items at \\$9.45 each make \\$18.90.",
    ],
)
def test_math_reward_reads_escaped_dollars_as_currency(response):
    assert math_reward(response, "18.90", {}) == 1.0


@pytest.mark.parametrize(
    "response, label",
    [
        ("She sold 48 + 24 clips.\nAnswer: 72 clips", "72"),
        ("Answer: **34**", "34"),
        ("**Answer:** 34 apples.", "34"),
        ("Answer: \\frac{1}{2} cup", "\\frac{1}{2}"),
        ("Final Answer: The final answer is $28\\%$. I hope it is correct.", "$28\\%$"),
    ],
)
def test_math_reward_reads_prose_after_answer(response, label):
    assert math_reward(response, label, {}) == 1.0


def test_math_reward_reads_multi_line_box_contents():
    response = "The product is\n\\[\n\\boxed{\n\\begin{pmatrix} 2 & 0 \\\\\n 1 & 3 \\end{pmatrix}\n}\n\\]"
    assert math_reward(response, "\\begin{pmatrix} 2 & 0 \\\\ 1 & 3 \\end{pmatrix}", {}) == 1.0


def test_boxes_are_balanced_outermost_and_skip_unclosed_or_escaped_braces():
    text = "\\boxed{a} x \\boxed{\\frac{1}{2}} y \\boxed{\\boxed{3}} \\boxed{\\left\\{ x \\right.} \\boxed{\\frac{1}{"
    assert [content for _, content in boxes(text)] == ["a", "\\frac{1}{2}", "\\boxed{3}", "\\left\\{ x \\right."]
    assert final_math_answer("Answer: 5 \\boxed{6}") == "$\\boxed{6}$"
    assert final_math_answer("Answer: 7\nbecause reasons") == "$7$"
    assert final_math_answer("<think>Answer: 5") is None
    assert math_reward("Answer:", "5", {}) == 0.0


def test_degenerate_response_of_unclosed_boxes_scores_zero_without_a_timeout():
    """16k tokens of ``\\boxed{`` that never close: one linear pass finds no answer, far inside the timeout."""
    with RewardPool(RewardConfig(name="math", timeout_s=5)) as pool:
        outcome = pool.score("\\boxed{" * 16000 + " and so on", "1", {})
    assert (outcome.reward, outcome.error, outcome.timed_out) == (0.0, None, False)


def test_math_verify_times_itself_out_in_a_worker_below_the_reward_timeout():
    """A tower of powers sympy cannot compare: math-verify's own 1 s limits stop it, the worker lives on."""
    with RewardPool(RewardConfig(name="math", timeout_s=6)) as pool:
        outcome = pool.score("\\boxed{9^{9^{9^{9}}}}", "1", {})
        assert (outcome.reward, outcome.error, outcome.timed_out) == (0.0, None, False)
        assert pool.score("\\boxed{3}", "3", {}).reward == 1.0


@pytest.mark.parametrize("reward_timeout_s, call_timeout_s", [(10.0, 3), (60.0, 18), (2.0, 1), (0.5, 1)])
def test_each_math_verify_call_gets_a_third_of_the_reward_timeout(reward_timeout_s, call_timeout_s, monkeypatch):
    monkeypatch.setattr(rewards, "_math_call_timeout_s", None)
    limit_math_verify_time(reward_timeout_s)
    assert rewards._math_call_timeout_s == call_timeout_s


def test_math_reward_off_the_main_thread_runs_without_signals(monkeypatch):
    monkeypatch.setattr(rewards, "_math_call_timeout_s", 3)
    results = []
    thread = threading.Thread(target=lambda: results.append(math_reward("\\boxed{2}", "2", {})))
    thread.start()
    thread.join()
    assert results == [1.0]


def test_math_reward_agrees_with_math_verify_on_its_own_kinds_of_pairs():
    """Pairs written after the classes of math-verify's test-suite (numbers, notation, relations, sets,
    matrices, several boxes, Minerva's "final answer is"): our reward and math-verify on the whole response
    give the same verdict. (The classes where the structure decides, thinking, escaped dollars, an answer line
    after a box, are the tests above; there the two differ on purpose.)"""
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    pairs = [json.loads(line) for line in MATH_VERIFY_PAIRS.read_text().splitlines()]
    verdicts = [
        (pair["class"], math_reward(pair["response"], pair["label"], {}),
         float(verify(parse(pair["label"]), parse(pair["response"]))))
        for pair in pairs
    ]
    assert [v for v in verdicts if v[1] != v[2]] == []
    assert {ours for _, ours, _ in verdicts} == {0.0, 1.0} and len(verdicts) >= 40


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
        ("B", 1.0),
        ("Answer: B ... on reflection (C) is too fast", 1.0),
        ("Answer: Because it doubles", 0.0),
        ("I cannot tell", 0.0),
    ],
)
def test_gpqa_reward_reads_the_stated_choice(response, reward):
    assert gpqa_reward(response, "B", CHOICES) == reward


@pytest.mark.parametrize(
    "response",
    [
        "Answer: C\n\nWhy not (A)? Because (A) ignores friction, and (B) double counts.",
        "Answer: C. Check: momentum gives \\boxed{B = m v}, so the speed quadruples.",
        "The answer is (C).\n\nNote that (D) would need twice the mass.",
        "Answer: A\nWait, the speed doubles twice, not once.\nAnswer: C",
    ],
)
def test_gpqa_explicit_answer_beats_later_mentions(response):
    assert gpqa_reward(response, "C", CHOICES) == 1.0


@pytest.mark.parametrize(
    "response, reward",
    [
        ("<think>(A) is out; so (B)? Or (C). Let me compute the energy", 0.0),  # truncated: never answered
        ("<think>(A) is out; so (B)? Or (C). Let me compute. Answer: C is likely, but", 0.0),
        ("<think>Answer: A? No...</think>\nThe answer is **C**.", 1.0),
        ("<think>Surely (A), or maybe (D)</think>\nSo (C).", 1.0),
        ("<think>... so Answer: C</think>", 1.0),  # nothing after the thinking: its statement counts
        ("<think>... so (C)</think>", 0.0),  # but never a passing mention inside it
    ],
)
def test_gpqa_reads_after_the_thinking_and_never_a_truncated_trace(response, reward):
    assert gpqa_reward(response, "C", CHOICES) == reward


@pytest.mark.parametrize(
    "response",
    [
        "Answer: $C$",
        "Answer: $\\boxed{C}$",
        "\\boxed{\\textbf{C}}",
        "\\boxed{\\text{(C) 16 m/s}}",
        "The correct answer is (C) 16 m/s.",
        "ANSWER: C",
        "**Final Answer:** C",
        "Answer: option C",
    ],
)
def test_gpqa_reads_latex_and_markdown_answer_formats(response):
    assert gpqa_reward(response, "C", CHOICES) == 1.0


def test_gpqa_letters_extend_with_more_choices():
    six = {"choices": ["1", "2", "3", "4", "5", "6"]}
    assert gpqa_reward("Answer: F", 5, six) == 1.0
    assert gpqa_reward("Answer: E", "5", six) == 1.0  # text label "5" is choice E
    assert gpqa_reward("(A) is wrong; (E)", "E", six) == 1.0
    assert gpqa_reward("(A) is right; (E)", "A", CHOICES) == 1.0  # no E among four choices: (E) is prose


@pytest.mark.parametrize(
    "label, metadata",
    [
        ("(C)", CHOICES),
        ("c.", CHOICES),
        ("2", CHOICES),
        (2.0, CHOICES),
        ("C", {"choices": {"A": "4 m/s", "B": "8 m/s", "C": "16 m/s", "D": "32 m/s"}}),
        ("16 m/s", {"choices": {"(A)": "4 m/s", "(B)": "8 m/s", "(C)": "16 m/s", "(D)": "32 m/s"}}),
        (2, {"choices": {"D": "32 m/s", "C": "16 m/s", "B": "8 m/s", "A": "4 m/s"}}),
        ("16 m/s", {"choices": {"first": "4 m/s", "second": "8 m/s", "third": "16 m/s", "fourth": "32 m/s"}}),
    ],
    ids=["parenthesized", "lowercase-period", "numeric-string", "float-index", "dict", "dict-paren-keys",
         "dict-unordered-index", "dict-other-keys"],
)
def test_gpqa_labels_in_other_shapes_and_choice_dicts(label, metadata):
    assert gpqa_reward("Answer: C", label, metadata) == 1.0
    assert gpqa_reward("Answer: B", label, metadata) == 0.0


@pytest.mark.parametrize("label", ["Z", 4, "64 m/s", None, "7", True])
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
