"""The pins of CI's floor step (.ci/floors.py): each requirement of pyproject.toml at the lowest version it allows."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("floors", ROOT / ".ci" / "floors.py")
floors = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(floors)


def test_every_dependency_and_every_extras_requirement_gets_a_pin_at_its_floor():
    """A dependency added to pyproject.toml cannot slip past the floor step: without a lower bound the script stops."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = list(pyproject["project"]["optional-dependencies"])
    pins = floors.floors(pyproject, extras)
    for requirement in floors.requirements(pyproject, extras):
        name, version = floors.floor(requirement)
        assert floors._release(pins[name]) >= floors._release(version), requirement


@pytest.mark.parametrize(("requirement", "pin"), [
    ("torch>=2.9", ("torch", "2.9")),
    ("submitit>=1.5,<2", ("submitit", "1.5")),
    ("submitit<2, >=1.5", ("submitit", "1.5")),
    ("megatron-core==0.16.1", ("megatron-core", "0.16.1")),
    ("einops~=0.8", ("einops", "0.8")),
    ("Hydra_Core[extra] >= 1.3.2 ; python_version >= '3.10'", ("hydra-core", "1.3.2")),
])
def test_the_pin_is_the_lower_bound_of_the_specifier(requirement, pin):
    assert floors.floor(requirement) == pin


@pytest.mark.parametrize("requirement", ["tqdm", "tqdm<5", "tqdm>4.66", "tqdm!=4.67"])
def test_a_requirement_without_a_floor_is_refused_by_name(requirement):
    with pytest.raises(ValueError, match="declares no floor"):
        floors.floor(requirement)


def test_the_higher_floor_wins_and_only_the_named_extras_are_pinned():
    pyproject = {"project": {"dependencies": ["numpy>=1.26"],
                             "optional-dependencies": {"a": ["numpy>=2.0", "pytest>=8"], "b": ["wandb>=0.19"]}}}
    assert floors.floors(pyproject, ["a"]) == {"numpy": "2.0", "pytest": "8"}
    with pytest.raises(ValueError, match="no extra c"):
        floors.floors(pyproject, ["c"])
