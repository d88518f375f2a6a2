"""CI runs the README's test command, the one a newcomer types, not a variant of it."""

from __future__ import annotations

import re
import shlex

from tests.conftest import REPO


def readme_test_command() -> list[str]:
    """The command of the README's block after "Run the tests"."""
    readme = (REPO / "README.md").read_text()
    found = re.search(r"^Run the tests\b.*?^```bash\n(.+?)\n```", readme, flags=re.M | re.S)
    assert found, "README.md: no ```bash block after 'Run the tests'"
    return shlex.split(found.group(1))


def ci_test_commands() -> list[list[str]]:
    """Every pytest command of .ci/run run with this machine's python (the tiers' own virtualenvs aside), without
    the environment variables before it and what follows its first shell operator."""
    commands = []
    for line in (REPO / ".ci" / "run").read_text().replace("\\\n", " ").splitlines():
        if "-m pytest" not in line.split("#")[0]:
            continue
        words = shlex.split(line, comments=True)
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            words = words[1:]
        if words[:3] == ["python", "-m", "pytest"]:
            cut = next((i for i, word in enumerate(words) if word in ("||", "&&", "|", ";")), len(words))
            commands.append(words[:cut])
    return commands


def test_ci_runs_the_readme_test_command_with_at_most_a_report_added():
    readme = readme_test_command()
    assert readme[:3] == ["python", "-m", "pytest"]
    [ci] = ci_test_commands()  # the main suite; the tiers in their own virtualenvs run other pythons
    # what CI may add: how much it reports; the same tests, workers and order
    added = [word for word in ci if word not in readme]
    assert all(word.startswith("--durations") for word in added), added
    assert [word for word in ci if word in readme] == readme
