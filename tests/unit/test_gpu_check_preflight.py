"""tools/gpu_check.py stops before any part when a run-time dependency is missing: a GPU image has torch and
transformers, and the rest travels as the wheel folder of docs/gpu.md, which once lacked blake3 and cryptography."""

from __future__ import annotations

import importlib.metadata
import importlib.util

from tests.conftest import REPO

_spec = importlib.util.spec_from_file_location("gpu_check", REPO / "tools" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)


def test_this_install_has_every_dependency_the_check_needs():
    assert gpu_check.missing_dependencies() == []


def test_a_missing_or_too_old_dependency_stops_the_check_before_any_part(monkeypatch, tmp_path, capsys):
    real = importlib.metadata.version

    def version(name: str) -> str:
        if name == "blake3":
            raise importlib.metadata.PackageNotFoundError(name)
        return "4.0.0" if name == "transformers" else real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert gpu_check.main(["--cpu-smoke", "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert "blake3>=1.0.0 (absent)" in error and "transformers>=4.57.1 (has 4.0.0)" in error, error
    assert "docs/gpu.md" in error
    assert not (tmp_path / "out").exists()  # nothing ran
