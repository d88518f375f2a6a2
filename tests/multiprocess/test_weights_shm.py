"""Disk weight sync's private /dev/shm directories leave nothing behind: a killed owner's goes with the next run's
``place``, a live owner's stays, and a node that ends through ``os._exit`` removes its own (control/weights/disk.py).

Each test stands in for /dev/shm with a directory of its own, and for the owners with child processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from rolloutpipe.control.weights import disk

OWNER = textwrap.dedent("""
    import shutil, sys, time
    from pathlib import Path
    from rolloutpipe.control.weights.disk import private_dir
    target = private_dir(Path(sys.argv[1]), sys.argv[2], lambda: shutil.rmtree(target))
    print(target, flush=True)
    time.sleep(600)
""")


def owner(parent: Path, prefix: str = "rolloutpipe-run-") -> tuple[subprocess.Popen, Path]:
    """A child process that makes a private directory in ``parent`` and lives until it is killed."""
    child = subprocess.Popen([sys.executable, "-c", OWNER, str(parent), prefix], stdout=subprocess.PIPE, text=True)
    return child, Path(child.stdout.readline().strip())


def kill(child: subprocess.Popen) -> None:
    child.send_signal(signal.SIGKILL)
    child.wait()
    child.stdout.close()


def test_a_killed_owners_directory_is_swept_and_a_live_owners_kept(tmp_path: Path) -> None:
    (killed, killed_dir), (alive, alive_dir) = owner(tmp_path), owner(tmp_path)
    try:
        unowned = tmp_path / "rolloutpipe-older-version"  # no owner lock: not known to be dead
        unowned.mkdir()
        (killed_dir / "policy_v3.safetensors").write_bytes(b"\0" * 64)
        kill(killed)
        assert killed_dir.is_dir()  # atexit did not run: the leak this guards against
        assert disk.sweep_orphans(tmp_path) == [killed_dir]
        assert not killed_dir.exists() and alive_dir.is_dir() and unowned.is_dir()
    finally:
        kill(alive)
    assert disk.sweep_orphans(tmp_path) == [alive_dir]
    assert [path.name for path in tmp_path.iterdir()] == [unowned.name]


def test_place_sweeps_orphans_and_the_directory_goes_at_exit(tmp_path: Path, monkeypatch) -> None:
    shm, run_dir = tmp_path / "shm", tmp_path / "run"
    shm.mkdir()
    monkeypatch.setattr(disk, "SHM", shm)
    monkeypatch.setattr(disk, "memory_backed", lambda path: Path(path) == shm)
    killed, orphan = owner(shm, "rolloutpipe-other-run-")
    kill(killed)
    transport = SimpleNamespace(address=SimpleNamespace(host="127.0.0.1"), run_id="run")
    sender = disk.Sender(None, transport=transport, run_dir=run_dir, policy=None)
    sender.place(1024)
    weights = run_dir / "weights"
    assert not orphan.exists()
    assert weights.is_symlink() and weights.resolve().parent == shm
    assert weights.resolve().name.startswith("rolloutpipe-run-")
    assert disk.sweep_orphans(shm) == []  # this process owns it
    disk.remove_private_dirs()
    assert list(shm.iterdir()) == [] and not weights.exists() and not weights.is_symlink()


@pytest.mark.parametrize("in_flight", [True, False])
def test_a_node_ending_through_os_exit_removes_its_directory(tmp_path: Path, in_flight: bool) -> None:
    """launch/node.py ``exit_with``: ``os._exit`` while a store call is in flight runs no atexit handler."""
    script = textwrap.dedent(f"""
        import shutil, sys
        from pathlib import Path
        from rolloutpipe.control import bounded_store
        from rolloutpipe.control.weights.disk import private_dir
        from rolloutpipe.launch.node import exit_with
        target = private_dir(Path(sys.argv[1]), "rolloutpipe-run-", lambda: shutil.rmtree(target))
        (target / "policy_v1.safetensors").write_bytes(bytes(64))
        bounded_store.calls_in_flight = lambda: {in_flight}
        exit_with(3)
    """)
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    assert list(tmp_path.iterdir()) == []
