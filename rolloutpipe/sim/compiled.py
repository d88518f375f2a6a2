"""The simulator's hot path, compiled with mypyc from the same source files.

A simulated step runs the project's scheduling code (rollout/: admission.py's Admission and its policies,
slots.py's StepSlots, schedule.py's RolloutSchedule, groups.py's GroupAssembler, advantages.py;
trainer/batching.py; observe/metrics.py's step record), the simulator's engines and glue (sim/engine.py,
sim/run.py) and the nouns they pass (types.py) once per request: millions of times a run.
mypyc compiles exactly these files, no copy of them, into C extensions that run the simulator about 2.4x
faster (docs/simulator.md).

``activate`` puts the compiled modules ahead of the sources on the package path. It must run before any of
them is imported (tools/simulate.py and bench/sim_speed.py call it first thing); in a process that already
imported them (a test) the sources run. The build lives in ``$ROLLOUTPIPE_CACHE/mypyc/<key>`` (default
``~/.cache/rolloutpipe``), the key a hash of those sources and of the Python and mypy versions, so an
edited source is built again (about 30 s, once). ``ROLLOUTPIPE_SIM_COMPILED`` chooses:

    auto (default)   use the build, building it first if mypyc is installed (``pip install -e .[sim]``);
                     without mypyc or a C compiler, run the sources and say so once
    1                the same, but fail instead of running the sources
    0                run the sources
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent
MODULES = ("types.py", "rollout/admission.py", "rollout/slots.py", "rollout/schedule.py", "rollout/groups.py",
           "rollout/advantages.py", "trainer/batching.py", "observe/metrics.py", "sim/engine.py", "sim/run.py")
"""Paths under the package of the files compiled."""

_MYPY_SETTINGS = """\
[mypy]
# Modules outside the compiled set are typed Any: they stay interpreted and are called through Python.
follow_imports = skip
ignore_missing_imports = True
"""


class CompileError(RuntimeError):
    pass


def module_names() -> list[str]:
    return ["rolloutpipe." + m.removesuffix(".py").replace("/", ".") for m in MODULES]


def build_key() -> str:
    digest = hashlib.sha256()
    for module in MODULES:
        digest.update(module.encode() + b"\0" + (PACKAGE / module).read_bytes())
    digest.update(sys.version.encode() + sysconfig.get_platform().encode() + _mypy_version().encode())
    return digest.hexdigest()[:16]


def build_dir() -> Path:
    root = Path(os.environ.get("ROLLOUTPIPE_CACHE", Path.home() / ".cache" / "rolloutpipe"))
    return root / "mypyc" / build_key()


def activate(policy: str | None = None) -> bool:
    """Use the compiled modules in this process if ``policy`` (default: $ROLLOUTPIPE_SIM_COMPILED, auto)
    allows; returns whether they are used."""
    policy = policy if policy is not None else os.environ.get("ROLLOUTPIPE_SIM_COMPILED", "auto")
    if policy not in ("auto", "1", "0"):
        raise ValueError(f"ROLLOUTPIPE_SIM_COMPILED={policy!r}: use auto, 1 (require the compiled simulator) "
                         "or 0 (run the sources).")
    if policy == "0":
        return False
    imported = [name for name in module_names() if name in sys.modules]
    if imported:
        if policy == "1":
            raise CompileError(f"{', '.join(imported)} already imported: activate() must run before them.")
        return False
    target = build_dir()
    if not target.is_dir():
        try:
            build(target)
        except CompileError as err:
            if policy == "1":
                raise
            print(f"[rolloutpipe] the simulator runs interpreted (~2.4x slower): {err}", file=sys.stderr)
            return False
    sys.path.insert(0, str(target))  # mypyc's shared library is a top-level module
    for package in _packages():  # each compiled module's package looks in the build first
        importlib.import_module(package).__path__.insert(0, str(target / package.replace(".", "/")))
    return True


def _packages() -> list[str]:
    """The packages holding MODULES, parents first (their __init__ files import nothing of MODULES)."""
    return sorted({name.rpartition(".")[0] for name in module_names()}, key=len)


def build(target: Path) -> None:
    """Compile MODULES with mypyc into ``target`` (atomically: a concurrent build of the same key is harmless)."""
    if importlib.util.find_spec("mypyc") is None:
        raise CompileError("mypyc is not installed; `pip install -e .[sim]` (or mypy) compiles it, once.")
    print(f"[rolloutpipe] compiling the simulator's hot path with mypyc into {target} (once, ~30 s) ...",
          file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        work = Path(tmp)
        shutil.copytree(PACKAGE, work / "rolloutpipe", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        (work / "mypy.ini").write_text(_MYPY_SETTINGS)
        done = subprocess.run([sys.executable, "-m", "mypyc", *(f"rolloutpipe/{m}" for m in MODULES)], cwd=work,
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            log = (done.stdout + done.stderr).strip().splitlines()
            raise CompileError("mypyc failed (is a C compiler installed?):\n" + "\n".join(log[-15:]))
        out = work / "out"
        for built in [*work.glob("*.so"), *(work / "rolloutpipe").rglob("*.so")]:
            dest = out / built.relative_to(work)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(built, dest)
        try:
            out.rename(target)
        except OSError:
            if not target.is_dir():  # not another build's finished copy
                raise


def _mypy_version() -> str:
    try:
        from importlib.metadata import version

        return version("mypy")
    except Exception:  # noqa: BLE001 - not installed: the key only has to differ from a real version's
        return "none"
