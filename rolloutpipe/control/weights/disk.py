"""Weight sync through a file (``pipeline.weight_sync=disk``, the default; every engine kind).

Trainer rank 0 writes ``run_dir/weights/policy_v<k>.safetensors`` bucket by bucket as the policy streams out of the
backend, and publishes its path, size and MAC in the store (a sealed record, control/transport.py); the rollout node
has every engine load it and checks the MAC while they read it. Each side touches each byte once:

    trainer   each tensor is hashed while it is written, from the same memory, on a second thread: its BLAKE3 (every
              core but the writer's; digest.py ``tensor_hash``) for the step's weights digest, and its AES-GMAC chunk
              by chunk for the file's MAC. Nothing is read back.
    rollout   once the file is there with the published size, the node recomputes the MAC from the page cache
              while the engines load it: engines of the node's own process (the embedded engine) in the same read,
              which copies each piece into all of them and authenticates it from the cache (``copy_checked``);
              engines of their own (SGLang servers) read the file themselves beside the node's check (one thread).
              A mismatch stops the run before any request reaches the new weights (the node admits step k+1 only
              after ``load`` returns).

The MAC. AES-GMAC over the file's data (mac.py: a fresh salt per file, chunk i of the tensors in file order has
nonce i); on the rollout side it is the only hash. The file's MAC is a BLAKE3 keyed with the weights key over the
header and the chunk tags in order: a changed, moved, cut or appended byte changes it.

The record stays sealed like every other (it also carries the path and the size); the MAC adds no key that
survives the attempt. Needs a file system both node groups see. A replacement engine (after a failure) loads the
same file, so engines are replaceable.

Where the file goes. On one node (the store on loopback: a local run) the run directory's file system is slower than
memory unless it is memory-backed itself, so the files go to a private directory in ``/dev/shm`` (mode 0700, made
per attempt; ``run_dir/weights`` links to it) when ``/dev/shm`` is a tmpfs with room for SHM_COPIES policies.
Otherwise, and on several nodes, they stay in ``run_dir/weights``. RAM holds what is left there, so nothing may stay:
the directory goes at exit (``remove_private_dirs``: atexit, and launch/node.py's ``exit_with`` itself when it
runs no exit handler), and a directory whose owner was killed goes with the next run's ``place`` (``sweep_orphans``: its
owner holds a lock on it for life, which the kernel drops however the process ends).
"""

from __future__ import annotations

import atexit
import fcntl
import hmac
import ipaddress
import json
import logging
import math
import mmap
import os
import shutil
import struct
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import blake3
import torch

from rolloutpipe.control.transport import Transport
from rolloutpipe.control.weights import EngineGroup, PolicyWeights, WeightSyncSettings, weights_record_key
from rolloutpipe.control.weights.buckets import Bucket
from rolloutpipe.control.weights.digest import Digest, cores_beside_one, tensor_bytes, tensor_hash
from rolloutpipe.control.weights.mac import SALT_BYTES, ChunkMac, chunks, gmac_key, weights_key

log = logging.getLogger(__name__)

SHM = Path("/dev/shm")
SHM_COPIES = 3
"""Policies /dev/shm must have room for: the one served, the one being written, one in reserve."""
SHM_PREFIX = "rolloutpipe-"
OWNER_LOCK = ".owner.lock"
"""In a private directory: the file its owner holds an exclusive ``flock`` on while it lives."""
_private_dirs: dict[Path, tuple[int, Callable[[], None]]] = {}
"""This process's private directories: the owner lock's descriptor, and how to remove the directory."""

_SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
                       "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
_TORCH_DTYPES = {code: getattr(torch, name) for name, code in _SAFETENSORS_DTYPES.items()}


def weights_file(version: int) -> str:
    """Where disk sync writes policy ``version``, relative to the run directory."""
    return f"weights/policy_v{version}.safetensors"


@dataclass(frozen=True, kw_only=True, slots=True)
class Written:
    size: int
    mac: str
    """BLAKE3 keyed with the weights key: the file's header, then each chunk's GMAC tag in file order (``file_mac``)."""
    salt: str
    """This file's random salt (hex), published with the MAC: the GMAC key is the weights key and the salt."""
    weights_digest: str


def _hash_and_tag(data: memoryview, chunk_mac: ChunkMac, first: int, threads: int) -> tuple[bytes, list[bytes]]:
    """A tensor's ``tensor_hash`` on ``threads`` (the weights digest) and the tags of its chunks, numbered from
    ``first``."""
    return tensor_hash(data, max_threads=threads), chunk_mac.tags([data], first)


def write_weights(path: Path, buckets: list[Bucket], tensors: Iterator[dict[str, torch.Tensor]],
                  key: bytes) -> Written:
    """Write the policy that ``tensors`` yields bucket by bucket as one safetensors file, atomically (the header
    first: ``buckets`` has every name, dtype and shape). Each tensor is hashed on a second thread while this one
    writes it, on all cores but the writer's; host memory holds one bucket."""
    header, salt, threads = safetensors_header(buckets), os.urandom(SALT_BYTES), cores_beside_one()
    mac, digest, chunk_mac, num_chunks = blake3.blake3(header, key=key), Digest(), ChunkMac(gmac_key(key, salt)), 0
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with ThreadPoolExecutor(1, thread_name_prefix="weights-hash") as pool, tmp.open("wb") as f:
        f.write(header)
        for bucket, state in zip(buckets, tensors, strict=True):
            hashing = []
            for name in bucket.names:
                data = tensor_bytes(state[name])
                hashing.append((name, pool.submit(_hash_and_tag, data, chunk_mac, num_chunks, threads)))
                num_chunks += len(chunks(0, len(data)))
                f.write(data)
            for name, hashing_it in hashing:
                hashed, tags = hashing_it.result()
                mac.update(b"".join(tags))
                digest.add(name, state[name], hashed)
    tmp.rename(path)
    return Written(size=path.stat().st_size, mac=mac.hexdigest(), salt=salt.hex(), weights_digest=digest.hexdigest())


def file_mac(path: Path, key: bytes, salt: bytes) -> str:
    """The MAC ``write_weights`` gave the file at ``path`` with ``salt``, recomputed from its bytes (mapped, each read
    once: ``copy_checked`` into no engine, a chunk in one GMAC call); ValueError if it is no safetensors file whose
    tensors cover it exactly. One thread: GMAC on one core (9 GB/s from memory on the 2-core machine) outruns an
    engine's read of the file, and a second would only take a core from the engines."""
    return copy_checked(path, key, salt, [])


COPY_PIECE_BYTES = 1 << 20
"""How much of a tensor ``copy_checked`` copies into the engines before it authenticates it from the cache. On the
2-core machine 1 MiB did best (0.57-0.62 s for 3.44 GB); 256 KiB to 512 KiB and 2 MiB to 4 MiB pieces took
0.60-0.65 s."""


class WeightsMisfit(ValueError):
    """A weights file's tensors are not an engine's: a name or a shape the other lacks."""


def copy_checked(path: Path, key: bytes, salt: bytes, destinations: list[dict[str, torch.Tensor]]) -> str:
    """Copy the safetensors file at ``path`` into every one of ``destinations`` (the state dicts of this process's
    engines: one tensor per name of the file, of its shape, and every other one tied to one of those) and return
    the file's MAC (``file_mac``'s), reading each byte from memory once: each piece of COPY_PIECE_BYTES is copied
    into every destination, then authenticated while it is still in the cache. ValueError, before anything is
    copied, if the file is no safetensors file whose tensors cover it exactly; WeightsMisfit if it does not fit a
    destination.

    One thread. Measured on the 2-core machine (3.44 GB in /dev/shm, medians of 5): this takes 1.55-1.6 x the read
    into the weights alone; the check on a second thread, piece by piece behind the copy, took 1.9 x (the GMAC
    holds the GIL: the two threads hand it over every piece); the check beside the read, each streaming the whole
    file from memory, 1.8-2.1 x."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view, source = memoryview(mapped), None
        try:
            start, entries = _data_layout(view)
            targets = [_targets(entries, destination) for destination in destinations]
            mac, chunk_mac, index = blake3.blake3(view[:start], key=key), ChunkMac(gmac_key(key, salt)), 0
            for i, entry in enumerate(entries):
                source = _source(mapped, start, entry) if targets else None
                size = _TORCH_DTYPES[entry.dtype].itemsize
                for begin, end in chunks(entry.begin, entry.end):
                    gmac = chunk_mac.in_pieces(index)
                    index += 1
                    low, high = (begin - entry.begin) // size, (end - entry.begin) // size  # elements
                    step = max(1, COPY_PIECE_BYTES // size if targets else high - low)  # no engine: the chunk whole
                    for first in range(low, high, step):
                        stop = min(first + step, high)
                        for target in targets:
                            target[i][first:stop].copy_(source[first:stop])
                        at = start + entry.begin + first * size
                        gmac.authenticate_additional_data(view[at:at + (stop - first) * size])
                    gmac.finalize()
                    mac.update(gmac.tag)
            return mac.hexdigest()
        finally:
            source = None  # its hold on the mapping, which closes next
            view.release()


def _source(mapped: mmap.mmap, start: int, entry: _Entry) -> torch.Tensor:
    """``entry``'s elements as they lie in the mapped file, flat (nothing copied; the mapping is read-only)."""
    numel = math.prod(entry.shape)
    if numel == 0:
        return torch.empty(0, dtype=_TORCH_DTYPES[entry.dtype])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "not writable": it is only read
        return torch.frombuffer(mapped, dtype=_TORCH_DTYPES[entry.dtype], count=numel, offset=start + entry.begin)


def _targets(entries: list[_Entry], destination: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Each entry's tensor in ``destination``, flat; WeightsMisfit naming every tensor that does not fit."""
    problems, names = [], {e.name for e in entries}
    if missing := sorted(names - destination.keys()):
        problems.append(f"the engine has no tensors {missing}")
    problems += [f"{e.name} has shape {list(e.shape)} in the file, {list(destination[e.name].shape)} in the engine"
                 for e in entries if e.name in destination and tuple(destination[e.name].shape) != e.shape]
    filled = {destination[name].data_ptr() for name in names & destination.keys()}
    if left := sorted(name for name, t in destination.items()
                      if name not in names and (t.numel() == 0 or t.data_ptr() not in filled)):
        problems.append(f"the file has no tensors {left}")
    if scattered := sorted(name for name, t in destination.items() if not t.is_contiguous()):
        problems.append(f"the engine's {scattered} are not contiguous")
    if problems:
        raise WeightsMisfit("; ".join(problems))
    return [destination[e.name].view(-1) for e in entries]


def safetensors_header(buckets: list[Bucket]) -> bytes:
    """The header of a safetensors file holding ``buckets``' tensors back to back in their order."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for bucket in buckets:
        for name, dtype, shape, size in zip(bucket.names, bucket.dtypes, bucket.shapes, bucket.sizes, strict=True):
            header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded


def _data_layout(view: memoryview) -> tuple[int, list[_Entry]]:
    """Where a safetensors file's data starts, and its tensors in file order, whose byte ranges must tile the rest of
    the file exactly (no byte unhashed, none twice), each the size its dtype and shape give. The file may be
    anyone's: every field is checked."""
    try:
        (length,) = struct.unpack("<Q", view[:8])
        if length > len(view) - 8:
            raise ValueError("header longer than the file")
        header = json.loads(bytes(view[8:8 + length]))
        entries = sorted(_Entry(int(e["data_offsets"][0]), int(e["data_offsets"][1]), name, e["dtype"],
                                tuple(int(n) for n in e["shape"]))
                         for name, e in header.items() if name != "__metadata__")
    except (struct.error, ValueError, TypeError, KeyError, IndexError, AttributeError) as err:
        raise ValueError(f"no safetensors header ({err})") from err
    end = 0
    for entry in entries:
        if entry.begin != end or entry.end < entry.begin:
            raise ValueError(f"tensor data at {entry.begin} where {end} was expected")
        if (entry.dtype not in _TORCH_DTYPES
                or math.prod(entry.shape) * _TORCH_DTYPES[entry.dtype].itemsize != entry.end - entry.begin):
            raise ValueError(f"{entry.name}: {entry.end - entry.begin} bytes of {entry.dtype!r} for shape "
                             f"{list(entry.shape)}")
        end = entry.end
    if 8 + length + end != len(view):
        raise ValueError(f"the tensors end at byte {8 + length + end} of {len(view)}")
    return 8 + length, entries


class _Entry(NamedTuple):
    """A tensor of a safetensors file: its data's byte range (from the data's start), name, dtype code and shape."""

    begin: int
    end: int
    name: str
    dtype: str
    shape: tuple[int, ...]


def on_one_node(transport: Transport) -> bool:
    """Whether every process of the run is on this node: local runs host the store on loopback."""
    try:
        return ipaddress.ip_address(transport.address.host).is_loopback
    except ValueError:
        return transport.address.host == "localhost"


def memory_backed(path: Path) -> bool:
    """Whether ``path`` lies on a tmpfs or ramfs (the mount with the longest matching mount point)."""
    path = path.resolve()
    best, kind = -1, ""
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        point = Path(fields[1].replace("\\040", " "))
        if (path == point or point in path.parents) and len(point.parts) > best:
            best, kind = len(point.parts), fields[2]
    return kind in ("tmpfs", "ramfs")


class Sender:
    def __init__(self, settings: WeightSyncSettings, *, transport: Transport, run_dir: Path,
                 policy: PolicyWeights) -> None:
        self.transport = transport
        self.run_dir = run_dir
        self.policy = policy
        self.placed = False

    def open(self) -> None:
        pass

    def publish(self, version: int, *, serves: bool) -> str:
        buckets, tensors = self.policy.hf_buckets()
        if not serves:  # the final policy: no engine loads it (the final checkpoint has it)
            digest = Digest()
            for state in tensors:
                digest.update(state)
            return digest.hexdigest()
        if not self.placed:
            self.place(sum(bucket.num_bytes for bucket in buckets))
        written = write_weights(self.run_dir / weights_file(version), buckets, tensors,
                                weights_key(self.transport.secret))
        self.transport.put_record(weights_record_key(self.transport, version), {
            "path": weights_file(version), "policy_version": version, "size": written.size, "mac": written.mac,
            "salt": written.salt})
        return written.weights_digest

    def place(self, num_bytes: int) -> None:
        """Point ``run_dir/weights`` at a fresh private directory in /dev/shm where that is faster and safe (the
        module docstring); drop an earlier attempt's, and those of runs that were killed."""
        self.placed = True
        weights = self.run_dir / "weights"
        if weights.is_symlink():
            _remove_shm_dir(weights.resolve())
            weights.unlink()
        where = f"{weights} (run.dir's file system)"
        if (not weights.exists() and on_one_node(self.transport) and not memory_backed(self.run_dir)
                and SHM.is_dir() and memory_backed(SHM)):
            if orphans := sweep_orphans(SHM):
                log.info("removed %d weights directories from %s that killed runs left behind: %s", len(orphans),
                         SHM, ", ".join(path.name for path in orphans))
            if shutil.disk_usage(SHM).free >= SHM_COPIES * num_bytes:
                target = private_dir(SHM, f"{SHM_PREFIX}{self.transport.run_id}-",
                                     lambda: _remove_shm_link(weights, target))
                weights.parent.mkdir(parents=True, exist_ok=True)
                weights.symlink_to(target, target_is_directory=True)
                where = f"{target} (/dev/shm: one node, and run.dir's file system is not memory-backed)"
        log.info("disk weight sync writes policies of %.2f GB to %s", num_bytes / 1e9, where)

    def retire(self, version: int) -> None:
        (self.run_dir / weights_file(version)).unlink(missing_ok=True)


def private_dir(parent: Path, prefix: str, remove: Callable[[], None]) -> Path:
    """A new directory in ``parent`` (mode 0700) that this process owns until it ends: it holds the directory's owner
    lock, and ``remove`` (which deletes the directory) runs at its exit (``remove_private_dirs``)."""
    target = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    claiming = target / f"{OWNER_LOCK}.new"
    fd = os.open(claiming, os.O_CREAT | os.O_WRONLY, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    claiming.rename(target / OWNER_LOCK)  # the lock is held by the time a sweep can find it
    if not _private_dirs:
        atexit.register(remove_private_dirs)
    _private_dirs[target] = (fd, remove)
    return target


def remove_private_dirs() -> None:
    """Remove this process's private directories (at exit; launch/node.py's ``exit_with`` calls it itself when a
    store call is in flight, and runs no other exit handler)."""
    while _private_dirs:
        _, (fd, remove) = _private_dirs.popitem()
        remove()
        os.close(fd)


def sweep_orphans(parent: Path) -> list[Path]:
    """Remove this user's private directories in ``parent`` whose owner is gone (killed, or ended by a signal it
    could not handle), and return them. One whose owner lives, or that has no owner lock (another program's, or an
    older version's), is left alone."""
    removed = []
    for path in sorted(parent.glob(f"{SHM_PREFIX}*")):
        try:
            if path.is_symlink() or path.stat().st_uid != os.getuid():
                continue
            fd = os.open(path / OWNER_LOCK, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its owner holds it
        finally:
            os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _remove_shm_dir(path: Path) -> None:
    if path.parent == SHM and path.name.startswith(SHM_PREFIX):
        shutil.rmtree(path, ignore_errors=True)


def _remove_shm_link(weights: Path, target: Path) -> None:
    """The /dev/shm directory, and ``run_dir/weights`` with it (no link left dangling in the run directory, which a
    copy of it, ``shutil.copytree`` or ``cp -rL``, would fail on)."""
    _remove_shm_dir(target)
    if weights.is_symlink() and weights.readlink() == target:
        weights.unlink()


class Receiver:
    def __init__(self, settings: WeightSyncSettings, *, transport: Transport, run_dir: Path, engines: EngineGroup,
                 check: Callable[[str], None]) -> None:
        self.run_dir = run_dir
        self.engines = engines
        self.visible_timeout_s = settings.visible_timeout_s
        self.check = check
        self.transport = transport

    def open(self) -> None:
        pass

    def prepare(self, version: int) -> None:
        pass  # a failed engine's replacement loads the file as every engine does

    def load(self, record: dict, version: int) -> None:
        """The engines load the file and the node checks its MAC, each byte read from memory once. Engines of this
        process (the embedded engine) are filled in one read of the file that the check follows piece by piece
        (``copy_checked``); engines of their own (SGLang servers) read it while a second thread checks it."""
        path = self.visible_file(record, version)
        with self.engines.weights_in_place(str(path), version) as destinations:
            if destinations is not None:
                self.check_file(path, record, version, copy_into=destinations)
                return
        with ThreadPoolExecutor(1, thread_name_prefix="weights-check") as pool:
            checking = pool.submit(self.check_file, path, record, version)
            try:
                self.engines.load_weights(str(path), version)
            except Exception:
                checking.result()  # a changed file is the cause to report, if it is one
                raise
            checking.result()

    def check_file(self, path: Path, record: dict, version: int,
                   copy_into: list[dict[str, torch.Tensor]] | None = None) -> None:
        """Raise unless ``path`` is the file the trainer wrote for ``version`` (its MAC); with ``copy_into`` (engines'
        state dicts), its tensors are copied into them in the same read."""
        key = weights_key(self.transport.secret)
        try:
            salt = bytes.fromhex(str(record.get("salt")))
            mac = file_mac(path, key, salt) if copy_into is None else copy_checked(path, key, salt, copy_into)
            genuine = hmac.compare_digest(mac, str(record.get("mac")))
        except WeightsMisfit as err:
            self.check_file(path, record, version)  # a changed file is the cause to report, if it is one
            raise RuntimeError(f"policy_version {version}'s weights {path} do not fit the engines' model: {err}. The "
                               "rollout engines must serve the model the trainer trains (model.*).") from err
        except ValueError as err:
            genuine = False
            log.warning("%s: %s", path, err)
        if not genuine:
            raise RuntimeError(f"{path} does not have the MAC the trainer published for policy_version {version}: "
                               "the file was changed after it was written; refusing it, and stopping before any "
                               "request reaches those weights.")

    def visible_file(self, record: dict, version: int) -> Path:
        """Policy ``version``'s file once it can be the one the trainer wrote: the run's own path, complete. A file
        not there yet or still short (a shared file system that lags behind the trainer's node) is waited for, up to
        pipeline.weights_visible_timeout_s; the engines never see a path that is missing or short."""
        path = self.run_dir / weights_file(version)
        if record.get("path") != weights_file(version) or record.get("policy_version") != version:
            raise RuntimeError(f"the weights record of policy_version {version} names {record.get('path')!r}, not "
                               f"{weights_file(version)!r}; refusing to load it.")
        deadline = time.monotonic() + self.visible_timeout_s
        while (lag := _not_visible_yet(path, record.get("size"))) is not None:
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"policy_version {version}'s weights {path} {lag} {self.visible_timeout_s:g}s after the trainer "
                    "wrote them. The rollout node loads them from the run directory, which must be on a file system "
                    "both node groups share (run.dir); raise pipeline.weights_visible_timeout_s if it is shared but "
                    "slow, or use pipeline.weight_sync=distributed.")
            self.check(f"policy_version {version}'s weights to show up complete at {path}")
            time.sleep(0.1)
        return path


def _not_visible_yet(path: Path, size: int | None) -> str | None:
    """Why ``path`` cannot be the trainer's file of ``size`` bytes yet (None: it may be; its MAC decides)."""
    try:
        have = path.stat().st_size
    except FileNotFoundError:
        return "were not there"
    if size is not None and have < size:
        return f"had {have} of their {size} bytes"
    return None
