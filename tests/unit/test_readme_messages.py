"""The messages README.md and docs/*.md quote are the ones the code writes.

A quote is either a backticked span in the last column of a table headed ``what the user sees`` (the fault
tables), or a line of output in a ``console`` block (a ``$ command`` line, then what it prints). Each quote is cut
at the page's elisions (``...``), placeholders (``<run dir>``) and clause breaks (``. ``, ``: ``, ``; ``, ``? ``:
a message is often made of several strings, a reason inside a sentence); every piece of more than one word must be
text that one message of the code can produce: a string, f-string or %-format of the package (or launch.py), not a
docstring, whose literal parts the piece matches in order, its fields matching short values (the page shows values
there: ``'trainer.lrr'``, ``16 samples``). So a reworded message, or a quote nobody writes, fails here. (Checked by
rewording one message at a time: 8 of 11 rewordings fail the test; what slips through is a change of punctuation
between clauses or of a word next to a value at a clause's edge, which the value's slack absorbs.)
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path


def _repo_root() -> Path:
    """The folder holding pyproject.toml, above this file wherever it lives under tests/."""
    return next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())


REPO = _repo_root()

WILD = None
"""A formatted field of an f-string (or %-format): matches a value."""


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def table_quotes(text: str) -> list[str]:
    """Backticked spans in the last column of every table whose last header cell is ``what the user sees``."""
    quotes, in_table = [], False
    for line in text.splitlines():
        if not line.startswith("| "):
            in_table = False
        elif re.fullmatch(r"\|[\s|:-]+\|", line.strip()):
            continue
        elif in_table:
            quotes += re.findall(r"`([^`]+)`", line.rstrip(" |").rsplit(" | ", 1)[-1])
        else:
            in_table = line.rstrip(" |").rsplit(" | ", 1)[-1].strip().lower() == "what the user sees"
    return quotes


def console_quotes(text: str) -> list[str]:
    """The output lines of every ``console`` block: what follows a ``$ command`` line."""
    blocks = re.findall(r"^```console\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)
    return [line.strip() for block in blocks for line in block.splitlines()
            if line.strip() and not line.startswith("$ ") and line.strip() != "..."]


def quotes_of(text: str) -> list[str]:
    return table_quotes(text) + console_quotes(text)


def readme_quotes() -> list[str]:
    """Every quote of README.md and docs/*.md."""
    return [quote for page in pages() for quote in quotes_of(page.read_text())]


PRINTF_FIELD = re.compile(r"%[-#0 +]*\d*(?:\.\d+)?[sdrfgx]")
"""A field of a logging call's %-format (``log.warning("engine %s failed", name)``)."""


@cache
def code_messages() -> list[list[str | None]]:
    """Every string and f-string of the package and launch.py but docstrings, as literal parts and WILD fields."""
    out = []
    for path in [*(REPO / "rolloutpipe").rglob("*.py"), REPO / "launch.py"]:
        tree = ast.parse(path.read_text())
        docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        for node in ast.walk(tree):
            if id(node) in docs:  # docstrings describe messages; only what the code says counts
                continue
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                parts = [node.value]
            elif isinstance(node, ast.JoinedStr):
                parts = [v.value if isinstance(v, ast.Constant) else WILD for v in node.values]
            else:
                continue
            out.append([q for p in parts for q in ([WILD] if p is WILD else _printf_parts(p))])
    return out


def _printf_parts(text: str) -> list[str | None]:
    literals = PRINTF_FIELD.split(text)
    return [q for i, literal in enumerate(literals) for q in ([WILD, literal] if i else [literal])]


def is_substring_of_a_message(piece: str, parts: list[str | None], max_field: int = 40, max_edge: int = 16,
                               min_literal: int = 8) -> bool:
    """Whether ``piece`` can be found in some text that ``parts`` writes: each field filled with at most
    ``max_field`` characters (a value the README shows, not a sentence of its own), a field the piece starts or
    ends inside with at most ``max_edge``, and at least ``min_literal`` characters (or a fifth of the piece) matched by
    the message's own words."""
    tokens = [t for p in parts for t in ([WILD] if p is WILD else list(p))]
    end = len(tokens)
    need = min(min_literal, len(piece) // 5)

    def closure(states: set[tuple[int, int, int]]) -> set[tuple[int, int, int]]:  # a field may end (or be empty)
        out, todo = set(states), list(states)
        while todo:
            k, _, lit = todo.pop()
            if k < end and tokens[k] is WILD and (k + 1, 0, lit) not in out:
                out.add((k + 1, 0, lit))
                todo.append((k + 1, 0, lit))
        return out

    # state: (position in tokens, characters in the current field, literal characters matched, up to `need`)
    current = closure({(k, max_field - max_edge if k < end and tokens[k] is WILD else 0, 0) for k in range(end + 1)})
    stepped: set[tuple[int, int, int]] = set()
    for char in piece:
        stepped = {(k, used + 1, lit) if tokens[k] is WILD else (k + 1, 0, min(lit + 1, need))
                   for k, used, lit in current
                   if k < end and (tokens[k] == char or tokens[k] is WILD and used < max_field)}
        current = closure(stepped)
        if not current:
            return False
    # ... and end anywhere: after a literal character, or inside a field after a short value
    return any(used <= max_edge and lit >= need for _, used, lit in stepped)


def explained(piece: str) -> bool:
    """Whether one message of the code writes ``piece`` (candidates: those that share a word with it)."""
    words = re.findall(r"[A-Za-z_]{3,}", piece)
    candidates = [m for m in code_messages() if any(w in "".join(p for p in m if p is not WILD) for w in words)]
    return any(is_substring_of_a_message(piece, m) for m in candidates)


def pieces(quote: str) -> list[str]:
    """The quote cut at elisions and placeholders, and into clauses: a message is often made of several strings
    (a reason inside a sentence), and each clause is one string's text."""
    return [p.strip() for p in re.split(r"\.\.\.|<[^>]+>|[.:;?] ", quote) if len(p.strip()) >= 4]


def is_a_value(piece: str) -> bool:
    """One word, no sentence: a file name or a name (``rows.jsonl:2``, ``/engines/engine1.log``)."""
    return " " not in piece


def test_every_message_the_readme_and_docs_quote_is_one_the_code_writes():
    quotes = readme_quotes()
    assert len(quotes) >= 10
    unexplained = [(quote, piece) for quote in quotes for piece in pieces(quote)
                   if not explained(piece) and not is_a_value(piece)]
    assert unexplained == []


def test_quotes_are_found_in_fault_tables_and_console_blocks_only():
    page = """Prose `not a quote` here.

| fault | what RolloutPipe does | what the user sees |
| --- | --- | --- |
| a bad row | it stops | `rows.jsonl:2: invalid JSON`; then `exit code 2` |

| key | meaning |
| --- | --- |
| `trainer.lr` | `not a quote either` |

```console
$ python launch.py +trainer.lrr=1e-3
error: unknown config key 'trainer.lrr'
...
```

```bash
python launch.py   # not output
```
"""
    assert quotes_of(page) == ["rows.jsonl:2: invalid JSON", "exit code 2", "error: unknown config key 'trainer.lrr'"]


def test_the_check_tells_a_message_from_a_rewording():
    template = ["unknown config key '", WILD, "'.", WILD, " Every key and its default: ", WILD]
    said = "unknown config key 'trainer.lrr'. Did you mean 'trainer.lr'? Every key and its default: python launch.py"
    assert is_substring_of_a_message(said, template)
    assert is_substring_of_a_message("key 'x'. Did", template)
    assert not is_substring_of_a_message(said.replace("Every key", "All keys"), template)
    assert not is_substring_of_a_message("unknown configuration key 'x'", template)
