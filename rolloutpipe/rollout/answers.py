"""Reading the final answer out of a response: the text that the ``math`` and ``gpqa`` rewards score.

A response is read by its structure, not by its last match of a pattern:

1. **Thinking.** What stands inside ``<think>...</think>`` is the model's working. When the response closes its
   thinking, the answer is read from what follows the last ``</think>``; only if nothing there states an answer
   is the thinking read, and then for explicit statements only (never a passing mention of an option). A
   response that opens ``<think>`` and never closes it (a trace cut off by the length limit) gave no answer.
2. **The final statement.** An explicit statement (``Answer: X``, ``The answer is X``, ``\\boxed{X}``) beats any
   mention around it, and the last explicit statement wins (a model that corrects itself ends with the answer
   it means). For math, every ``\\boxed{}`` of the section counts, as math-verify reads them (two boxed roots
   form the set of both); an ``Answer:`` line after the last box wins over the boxes.
3. **Linear.** Boxes are found by one forward pass with a brace stack, and every pattern here is free of
   nested repetition, so a degenerate response (thousands of unclosed ``\\boxed{``) is read in time linear in
   its length and yields no answer.

This module is imported by reward workers: keep it to the standard library.
"""

from __future__ import annotations

import re

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
MAX_ANSWER_CHARS = 4000
"""The most text handed to math-verify for one answer (a statement, the boxes, or the end of a response with no
statement: its patterns take the last match), so that a degenerate response costs no more than an ordinary one."""

_BRACE_TOKENS = re.compile(r"\\(?:boxed|fbox)\s*\{|\\\\(?!boxed|fbox)|\\[{}$]|[{}]")
"""A box opener (also after a doubled backslash, as in text escaped twice), an escaped backslash, brace or
dollar (skipped), or a grouping brace."""


def answer_sections(response: str) -> list[tuple[str, bool]]:
    """Where the answer may stand, in the order to look: (text, is_thinking)."""
    thinking, closed, after = response.rpartition(THINK_CLOSE)
    if closed:
        return [(after, False), (thinking.replace(THINK_OPEN, " "), True)]
    if THINK_OPEN in response:
        return []  # still thinking when the response ended
    return [(response, False)]


def boxes(text: str) -> list[tuple[int, str]]:
    """(start, content) of every balanced ``\\boxed{...}`` (or ``\\fbox``) not inside another, in one pass.

    Escaped braces (``\\{``) do not group, as in LaTeX; an unclosed box (a truncated response) is skipped.
    """
    found: list[tuple[int, str]] = []
    stack: list[tuple[int, int] | None] = []  # (box start, content start) for a box's brace, None for a group
    open_boxes = 0
    for token in _BRACE_TOKENS.finditer(text):
        kind = token.group()
        if kind.startswith("\\") and not kind.startswith(("\\boxed", "\\fbox")):
            continue
        if kind == "}":
            if not stack:
                continue
            top = stack.pop()
            if top is not None:
                open_boxes -= 1
                if open_boxes == 0:
                    found.append((top[0], text[top[1] : token.start()]))
        elif kind == "{":
            stack.append(None)
        else:
            stack.append((token.start(), token.end()))
            open_boxes += 1
    return found


# ---- math -------------------------------------------------------------------------------------

_ANSWER_MARKER = re.compile(
    r"(?i:\banswer\b)(?:\s*\*\*)?(?:\s*[:\uff1a]|\s+(?i:is|would be|should be)\b\s*[:\uff1a]?)"
)
"""``Answer:``, ``**Answer:**``, ``Final Answer:``, ``The answer is``: what introduces a final answer."""

_PROSE_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}")
_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")


def final_math_answer(response: str) -> str | None:
    """The final answer as text for math-verify's ``parse`` (``$...$`` around LaTeX), or None if there is none.

    In the first section (``answer_sections``) that states one: the last ``Answer:`` line if it comes after
    every box, else all of the section's boxes together (``$\\boxed{a}\\boxed{b}$``: math-verify reads them
    as one answer, a set when they differ). With no statement in any section, the end of the text after the
    thinking as it is (math-verify's own reading of free text), unless it holds a box that never closed.
    """
    for text, _ in answer_sections(response):
        found = boxes(text)
        markers = list(_ANSWER_MARKER.finditer(text))
        if markers and (not found or markers[-1].start() > found[-1][0]):
            line = _answer_line(text, markers[-1].end())
            if line:
                statement = text[text.rfind("\n", 0, markers[-1].start()) + 1 :]
                return _as_math_text(line, statement)[:MAX_ANSWER_CHARS]
        contents = [_clean_math(content) for _, content in found]
        contents = [c for c in contents if c]
        if contents:
            return ("$" + "".join(f"\\boxed{{{c}}}" for c in contents) + "$")[-MAX_ANSWER_CHARS:]
    sections = answer_sections(response)
    if sections and "\\boxed" not in sections[0][0] and sections[0][0].strip():
        # No statement anywhere: math-verify reads the end of the answer as it would on its own (its last
        # formula or number). A section with a box that never closes is a truncated or degenerate answer.
        return sections[0][0][-MAX_ANSWER_CHARS:].replace("\\$", " ")
    return None


def _answer_line(text: str, start: int) -> str:
    """What follows an answer marker: the rest of its line, or the next non-empty line if that is empty."""
    rest = text[start:].lstrip(" \t*_")
    line, _, after = rest.partition("\n")
    if not line.strip(" \t*_"):
        line = next((candidate for candidate in after.split("\n") if candidate.strip(" \t*_")), "")
    return line.strip()


def _clean_math(text: str) -> str:
    """Box content for ``$...$``: one line (newlines mean nothing in LaTeX), no dollars of its own."""
    return _UNESCAPED_DOLLAR.sub(" ", text.replace("\\$", " ")).replace("\n", " ").strip()


def _as_math_text(text: str, statement: str | None = None) -> str:
    """An answer (``text``, what follows its marker) as math-verify should see it.

    Escaped dollars are currency, never math delimiters; markdown emphasis is dropped. An answer with its own
    math delimiters (or a box) goes as it is, with its marker (``statement``: from the start of the marker's
    line), so math-verify's own answer patterns pick the math out of it. Otherwise the leading mathematics (up
    to the first word of prose outside braces: ``72 clips`` -> ``72``) is put between dollars, so that
    ``x^2 + 1`` is read as LaTeX and not as the number 1; an answer that starts with prose goes as it is.
    """
    text = _plain(text)
    if _UNESCAPED_DOLLAR.search(text) or "\\(" in text or "\\[" in text or "\\boxed" in text:
        return _plain(statement)[:MAX_ANSWER_CHARS] if statement is not None else text
    math = _leading_math(text).strip().rstrip(".,;:").strip()
    return f"${math}$" if math else text


def _plain(text: str) -> str:
    return text.replace("\\$", " ").replace("**", "").replace("__", "").strip()


def _leading_math(text: str) -> str:
    depth = 0
    last = 0
    for word in _PROSE_WORD.finditer(text):
        depth += text.count("{", last, word.start()) - text.count("}", last, word.start())
        last = word.start()
        if depth <= 0:
            return text[: word.start()]
    return text


def label_math_text(label: object) -> str:
    """A math label as math-verify should see it: as an answer statement is (``_as_math_text``)."""
    return _as_math_text(str(label))


# ---- multiple choice --------------------------------------------------------------------------

_DECORATION = r"(?:\s|[*_$\"'(\[{]|\\[(\[]|\\(?:boxed|text|textbf|mathbf|mathrm|bf)\b|(?i:option|choice)\b)*"
"""What may stand between an answer marker and its letter: spaces, markdown, ``$``, ``\\boxed{``, "option"."""

_LETTER_STATEMENT = re.compile(_ANSWER_MARKER.pattern + _DECORATION + r"([A-Z])(?![A-Za-z0-9])")
_BARE_MENTION = re.compile(r"\(([A-Z])\)")
_LETTER_LINE = re.compile(r"(?m)^[ \t*_#>]*\(?([A-Z])\)?[ \t*_.]*$")
_BOX_WRAPPER = re.compile(r"^\\(?:text|textbf|mathbf|mathrm|bf)\s*\{(.*)\}$", re.DOTALL)
_BOXED_LETTER = re.compile(r"^\(?([A-Z])(?:\s*[).:](?:\s.*)?|\))?$", re.DOTALL)


def chosen_letter(response: str, letters: str) -> str | None:
    """The option the response answers with, read by its structure (module docstring), or None.

    Explicit statements: ``Answer: X`` (also ``Answer: $X$``, ``**Answer:** (X)``, ``The answer is X``) and a box
    holding only a letter (``\\boxed{X}``, ``\\boxed{\\textbf{X}}``, ``\\boxed{(X) text}``; ``\\boxed{B = mv}``
    is a formula, not a letter). Only outside the thinking, and only when no statement is there: the last
    ``(X)`` mentioned or a line holding just the letter.
    """
    for text, is_thinking in answer_sections(response):
        stated = [(m.start(1), m.group(1)) for m in _LETTER_STATEMENT.finditer(text) if m.group(1) in letters]
        for start, content in boxes(text):
            letter = _boxed_letter(content)
            if letter is not None and letter in letters:
                stated.append((start, letter))
        if stated:
            return max(stated)[1]
        if not is_thinking:
            mentioned = [
                (m.start(1), m.group(1))
                for pattern in (_BARE_MENTION, _LETTER_LINE)
                for m in pattern.finditer(text)
                if m.group(1) in letters
            ]
            if mentioned:
                return max(mentioned)[1]
    return None


def _boxed_letter(content: str) -> str | None:
    content = content.strip()
    while (wrapped := _BOX_WRAPPER.match(content)) is not None:
        content = wrapped.group(1).strip()
    match = _BOXED_LETTER.match(content)
    return match.group(1) if match else None
