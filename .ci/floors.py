"""Pin every dependency pyproject.toml declares, and those of the named extras, to the lowest version it allows.

    python .ci/floors.py dev megatron > floors.txt
    pip install -r floors.txt                        the floors and what they need
    pip install -c floors.txt -e ".[dev,megatron]"   the project at them

``>=X`` (alone or with an upper bound), ``~=X`` and ``==X`` all become ``==X``, so X must be a release: pyproject's
floor is the version the floor step installs and tests. A requirement with no lower bound stops the script with its
name (its floor could not be tested), and so does an extra pyproject lacks. Where two requirements name one package
(megatron-core in dev and megatron), the higher floor is pinned. Only the direct dependencies are pinned; pip
resolves the rest, as it would for a user whose other packages hold these at their floors.
Standard library only: CI runs it before anything is installed.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"

_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*([^;]*)(?:;.*)?$")
_LOWER_BOUND = re.compile(r"^(>=|==|~=)\s*([0-9][A-Za-z0-9.+!-]*)$")


def normalize(name: str) -> str:
    """The PEP 503 form of a package name: case and runs of ``-_.`` do not tell names apart."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(pyproject: dict, extras: list[str]) -> list[str]:
    """The requirement strings of [project.dependencies] and of each of ``extras``."""
    project = pyproject["project"]
    declared = project.get("optional-dependencies", {})
    unknown = [extra for extra in extras if extra not in declared]
    if unknown:
        raise ValueError(f"pyproject.toml has no extra {', '.join(unknown)} (it has {', '.join(declared)})")
    return [*project.get("dependencies", []), *(req for extra in extras for req in declared[extra])]


def floor(requirement: str) -> tuple[str, str]:
    """(normalized name, lowest version) of one requirement string; ValueError when it declares no lower bound."""
    match = _REQUIREMENT.match(requirement)
    if match is None:
        raise ValueError(f"cannot read the requirement {requirement!r}")
    for spec in filter(None, (s.strip() for s in match.group(2).split(","))):
        bound = _LOWER_BOUND.match(spec)
        if bound is not None:
            return normalize(match.group(1)), bound.group(2)
    raise ValueError(f"{requirement!r} in pyproject.toml declares no floor (>=, ~= or ==), so the floor step "
                     "cannot test it: give it the lowest release the code works with")


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version))


def floors(pyproject: dict, extras: list[str]) -> dict[str, str]:
    """Normalized package name -> the version to pin (the higher floor where a package is declared twice)."""
    out: dict[str, str] = {}
    for requirement in requirements(pyproject, extras):
        name, version = floor(requirement)
        if name not in out or _release(version) > _release(out[name]):
            out[name] = version
    return out


def main(extras: list[str]) -> None:
    try:
        pins = floors(tomllib.loads(PYPROJECT.read_text()), extras)
    except ValueError as err:
        sys.exit(f"floors.py: {err}")
    sys.stdout.write(f"# the floors of pyproject.toml's dependencies and extras {' '.join(extras)} (.ci/floors.py)\n")
    sys.stdout.write("".join(f"{name}=={version}\n" for name, version in sorted(pins.items())))


if __name__ == "__main__":
    main(sys.argv[1:])
