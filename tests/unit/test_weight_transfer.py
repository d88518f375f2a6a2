"""Weight sync's byte paths (control/weights/): the disk file hashed once while written and checked while the engines
read it, the flat broadcast bucket and its MAC, and which way ``pipeline.weight_sync=null`` picks."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from rolloutpipe.config import load_config, save_config
from rolloutpipe.control.seal import Forged, seal, unseal
from rolloutpipe.control.weights import WeightSync, WeightSyncSettings
from rolloutpipe.control.weights.buckets import BucketMac, pack, packed, plan_buckets, unpack
from rolloutpipe.control.weights.digest import Digest, weights_digest
from rolloutpipe.control.weights.disk import Receiver, file_mac, weights_file, write_weights
from rolloutpipe.control.weights.distributed import authenticated, bucket_mac, check_bucket
from rolloutpipe.control.weights.group import Broadcaster
from rolloutpipe.control.weights.mac import weights_key

REPO = Path(__file__).resolve().parents[2]
ATTEMPT_KEY = b"k" * 32


def policy() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"model.embed_tokens.weight": torch.randn(7, 4, generator=g).bfloat16(),
            "model.layers.0.mlp.up_proj.weight": torch.randn(4, 4, generator=g).bfloat16(),
            "model.empty": torch.zeros(0, 4, dtype=torch.bfloat16),
            "model.scale": torch.tensor(2.5, dtype=torch.float32),
            "model.norm.weight": torch.randn(4, generator=g, dtype=torch.float64),
            "model.count": torch.arange(3, dtype=torch.int64)}


def written(path: Path, state: dict[str, torch.Tensor], bucket_bytes: int = 64):
    buckets = plan_buckets(state, bucket_bytes)
    tensors = ({name: state[name] for name in bucket.names} for bucket in buckets)
    return write_weights(path, buckets, tensors, weights_key(ATTEMPT_KEY))


def receiver(run_dir: Path, engines=None, timeout_s: float = 60.0) -> Receiver:
    settings = WeightSyncSettings(way=WeightSync.disk, bucket_bytes=1, visible_timeout_s=timeout_s, join_timeout_s=1,
                                  num_engine_ranks=1, ranks_per_engine=1, engines_on_gpus=False)
    return Receiver(settings, transport=SimpleNamespace(secret=ATTEMPT_KEY), run_dir=run_dir, engines=engines,
                    check=lambda waiting_for: None)


def record(version: int, out) -> dict:
    return {"path": weights_file(version), "policy_version": version, "size": out.size, "mac": out.mac,
            "salt": out.salt}


@pytest.fixture
def gmac_uses(monkeypatch) -> list[tuple[bytes, bytes]]:
    """Every (GMAC key, nonce) pair the weights MAC uses from now on, with 8-byte MAC chunks."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    used: list[tuple[bytes, bytes]] = []

    class Recording:
        def __init__(self, key: bytes) -> None:
            self.key, self.aead = key, AESGCM(key)

        def encrypt(self, nonce: bytes, data: bytes, associated_data) -> bytes:
            used.append((self.key, nonce))
            return self.aead.encrypt(nonce, data, associated_data)

    monkeypatch.setattr("rolloutpipe.control.weights.mac.AESGCM", Recording)
    monkeypatch.setattr("rolloutpipe.control.weights.mac.MAC_CHUNK_BYTES", 8)
    return used


# --- the disk way: one pass over the bytes on each side -----------------------------------------------------------


def test_the_file_written_in_one_pass_is_what_safetensors_reads_and_carries_the_tensors_digest(tmp_path):
    state = policy()
    path = tmp_path / weights_file(1)
    out = written(path, state)
    loaded = load_file(str(path))
    assert list(loaded) == sorted(state) or set(loaded) == set(state)
    for name, tensor in state.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape
        assert torch.equal(loaded[name], tensor), name
    assert out.weights_digest == weights_digest(state)  # the step's digest, without reading the file back
    assert out.size == path.stat().st_size
    assert file_mac(path, weights_key(ATTEMPT_KEY), bytes.fromhex(out.salt)) == out.mac
    assert not path.with_suffix(".tmp").exists()


@pytest.mark.parametrize("read", ["check only", "into an engine"])
@pytest.mark.parametrize("where", ["first data byte", "last data byte", "header", "appended byte", "cut",
                                   "a middle chunk", "two chunks swapped"])
def test_a_changed_weights_file_is_refused(tmp_path, monkeypatch, where, read):
    """Any change to the file: a byte of a tensor or of the header, one added or cut. With 8-byte MAC chunks (each
    tensor in several, each its own GMAC), also a byte in a chunk between others, and two equal-length chunks of one
    tensor swapped (each chunk genuine, in the wrong place). Checked alone (engines of their own read the file), or
    as the file is read into an engine of the rollout node's process (in 4-byte pieces: several a chunk)."""
    monkeypatch.setattr("rolloutpipe.control.weights.mac.MAC_CHUNK_BYTES", 8)
    monkeypatch.setattr("rolloutpipe.control.weights.disk.COPY_PIECE_BYTES", 4)
    path = tmp_path / weights_file(2)
    out = written(path, policy())
    engines = None if read == "check only" else [{name: torch.empty_like(t) for name, t in policy().items()}]
    receiver(tmp_path).check_file(path, record(2, out), 2, copy_into=engines)  # unchanged, it passes
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    if where == "a middle chunk":
        data[start + 20] ^= 4  # the embedding's third chunk of seven
    elif where == "two chunks swapped":
        data[start:start + 16] = data[start + 8:start + 16] + data[start:start + 8]
        assert data[start:start + 8] != data[start + 8:start + 16]
    elif where == "first data byte":
        data[start] ^= 1
    elif where == "last data byte":
        data[-1] ^= 0x80
    elif where == "header":
        data[start - 1:start] = b"\n"  # header padding: still valid JSON, same layout
    elif where == "appended byte":
        data += b"\0"
    else:
        data = data[:-2]
    path.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match="does not have the MAC the trainer published for policy_version 2"):
        receiver(tmp_path).check_file(path, record(2, out), 2, copy_into=engines)


def test_a_record_naming_another_attempts_or_a_made_up_mac_is_refused(tmp_path):
    """The MAC is keyed with the attempt's key: one computed for the same bytes in another attempt is refused, and a
    record whose MAC was forged does not pass its seal (transport.py) in the first place."""
    path = tmp_path / weights_file(3)
    out = written(path, policy())
    receiver(tmp_path).check_file(path, record(3, out), 3)  # the genuine one passes
    other = write_weights(tmp_path / "other.safetensors", *_plan(policy()), weights_key(b"another attempt's key"))
    with pytest.raises(RuntimeError, match="does not have the MAC"):
        receiver(tmp_path).check_file(path, record(3, other), 3)
    key = "rp/run/weights/policy_version=3"
    forged = seal(b"an outsider's secret", key, {**record(3, out), "mac": file_mac(path, weights_key(b"guess"), b"")})
    with pytest.raises(Forged):
        unseal(ATTEMPT_KEY, key, forged)


def test_each_file_has_a_fresh_salt_and_a_record_with_another_salt_is_refused(tmp_path):
    """The same policy written twice: two salts, two MACs (no GMAC key and nonce pair authenticates two files); the
    second file's MAC under the first file's salt, or with no salt in the record, is refused."""
    path = tmp_path / weights_file(4)
    first, second = written(tmp_path / "first.safetensors", policy()), written(path, policy())
    assert first.salt != second.salt and first.mac != second.mac and first.weights_digest == second.weights_digest
    receiver(tmp_path).check_file(path, record(4, second), 4)
    for salt in (first.salt, None, "not hex"):
        with pytest.raises(RuntimeError, match="does not have the MAC"):
            receiver(tmp_path).check_file(path, {**record(4, second), "salt": salt}, 4)


def test_no_gmac_key_and_nonce_pair_authenticates_two_chunks(tmp_path, gmac_uses):
    """GMAC's one rule (a key and nonce pair used twice gives its key away): over two writes of one policy, in 8-byte
    chunks, every chunk the trainer authenticates has a pair of its own."""
    for _ in range(2):
        written(tmp_path / weights_file(1), policy())
    # policy()'s chunks, twice
    assert len(gmac_uses) == 2 * (7 + 4 + 1 + 1 + 4 + 3) and len(set(gmac_uses)) == len(gmac_uses)


def _plan(state):
    buckets = plan_buckets(state, 64)
    return buckets, ({name: state[name] for name in bucket.names} for bucket in buckets)


class _Engines:
    """Engines that read the file as SGLang's /update_weights_from_disk does, and note what they loaded."""

    def __init__(self, error: Exception | None = None) -> None:
        self.loaded: list[tuple[str, int]] = []
        self.error = error

    @contextmanager
    def weights_in_place(self, path: str, policy_version: int):
        yield None  # engines of their own processes

    def load_weights(self, path: str, policy_version: int) -> None:
        load_file(path)
        self.loaded.append((path, policy_version))
        if self.error is not None:
            raise self.error


def test_the_engines_load_while_the_node_checks_and_a_changed_file_stops_the_run_with_its_cause(tmp_path):
    path = tmp_path / weights_file(4)
    out = written(path, policy())
    engines = _Engines()
    receiver(tmp_path, engines).load(record(4, out), 4)
    assert engines.loaded == [(str(path), 4)]

    data = bytearray(path.read_bytes())
    data[-3] ^= 1
    path.write_bytes(bytes(data))
    engines = _Engines(error=ValueError("the engine choked on it"))
    with pytest.raises(RuntimeError, match="file was changed after it was written"):
        receiver(tmp_path, engines).load(record(4, out), 4)


def test_a_weights_file_that_shows_up_late_and_complete_is_waited_for(tmp_path):
    """A shared file system may show the trainer's file late, then short: the engines never get such a path."""
    state = policy()
    out = written(tmp_path / "complete.safetensors", state)
    data = (tmp_path / "complete.safetensors").read_bytes()
    path = tmp_path / weights_file(5)
    path.parent.mkdir(parents=True, exist_ok=True)

    def lagging_writer():
        time.sleep(0.3)
        path.write_bytes(data[:100])
        time.sleep(0.3)
        path.write_bytes(data)

    writer = threading.Thread(target=lagging_writer)
    writer.start()
    try:
        assert receiver(tmp_path).visible_file(record(5, out), 5) == path
    finally:
        writer.join()


@pytest.mark.parametrize("content,message", [
    (None, "were not there 0.2s after the trainer wrote them"),
    (b"x" * 10, "had 10 of their"),
], ids=["missing", "short"])
def test_a_weights_file_that_never_shows_up_complete_stops_the_run_saying_why(tmp_path, content, message):
    out = written(tmp_path / "complete.safetensors", policy())
    path = tmp_path / weights_file(6)
    path.parent.mkdir(parents=True, exist_ok=True)
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(RuntimeError, match=message) as err:
        receiver(tmp_path, timeout_s=0.2).visible_file(record(6, out), 6)
    assert "file system both node groups share" in str(err.value)


# --- the distributed way: one flat buffer per bucket --------------------------------------------------------------


@pytest.mark.parametrize("bucket_bytes", [1, 40, 1 << 20])
def test_a_flat_bucket_unpacks_to_the_same_names_dtypes_shapes_and_bits(bucket_bytes):
    state = policy()
    buckets = plan_buckets(state, bucket_bytes)
    assert [n for b in buckets for n in b.names] == list(state)
    received = {}
    for bucket in buckets:
        buffer = torch.full((bucket.num_bytes + 16,), 0xAB, dtype=torch.uint8)  # larger, and not zeroed
        flat = pack(bucket, state, buffer)
        assert flat.numel() == bucket.num_bytes
        received |= unpack(bucket, flat.clone())  # the engine's own buffer
    assert list(received) == list(state)
    for name, tensor in state.items():
        assert received[name].dtype == tensor.dtype and received[name].shape == tensor.shape, name
        assert torch.equal(received[name].view(-1).view(torch.uint8), tensor.view(-1).view(torch.uint8)), name



def test_a_bucket_lying_back_to_back_in_memory_is_sent_from_there_and_any_other_is_packed():
    """buckets.py ``packed``: the view is the tensors' own memory (a write through it shows in them), with the bytes
    ``pack`` would copy; tensors apart, out of order, with a gap or not contiguous are not one range."""
    whole = torch.arange(24, dtype=torch.float32)
    state = {"a": whole[2:8].view(2, 3), "b": whole[8:12], "c": whole[12:20].view(4, 2)}
    bucket = plan_buckets(state, 1 << 20)[0]
    flat = packed(bucket, state)
    assert torch.equal(flat, pack(bucket, state, torch.empty(bucket.num_bytes, dtype=torch.uint8)))
    flat[:4] = 0xFF
    assert state["a"][0, 0].isnan() and whole[1] == 1 and whole[20] == 20  # the range, not beyond
    not_one_range = {"apart": {"a": torch.zeros(6), "b": torch.zeros(4)},
                     "reversed": {"b": whole[8:12], "a": whole[2:8]},
                     "a gap": {"a": whole[2:8], "b": whole[9:13]},
                     "not contiguous": {"a": whole[:16].view(4, 4).t(), "b": whole[16:20]}}
    for why, tensors in not_one_range.items():
        assert packed(plan_buckets(tensors, 1 << 20)[0], tensors) is None, why

def test_a_tensor_that_would_sit_unaligned_in_a_flat_bucket_starts_the_next_one():
    """SGLang's FlattenedTensorBucket refuses a tensor whose byte offset is no multiple of its element size."""
    state = {"odd": torch.zeros(3, dtype=torch.bfloat16), "wide": torch.zeros(2, dtype=torch.float64)}
    buckets = plan_buckets(state, 1 << 20)
    assert [b.names for b in buckets] == [["odd"], ["wide"]]
    for bucket in buckets:
        offset = 0
        for size, dtype in zip(bucket.sizes, bucket.dtypes, strict=True):
            assert offset % getattr(torch, dtype).itemsize == 0
            offset += size


def _bucket_macs(state, bucket_bytes: int = 64):
    """Each bucket of ``state`` with trainer rank 0's sealed record of it and the MAC the rollout node derives, as
    ``Sender.publish`` makes them, and the policy's digest from the same pass."""
    key, digest, records = weights_key(ATTEMPT_KEY), Digest(), {}
    buckets = plan_buckets(state, bucket_bytes)
    tensors = ({name: state[name] for name in bucket.names} for bucket in buckets)
    sent = list(authenticated(buckets, tensors, key, digest, records.__setitem__))
    assert [bucket for bucket, _ in sent] == buckets and sorted(records) == list(range(len(buckets)))
    records = [records[i] for i in range(len(buckets))]
    return buckets, records, [bucket_mac(r, key) for r in records], digest


@pytest.mark.parametrize("where", ["a middle chunk", "two chunks swapped", "another bucket's bytes", "last byte"])
def test_a_changed_bucket_is_refused(monkeypatch, where):
    """What an engine checks a received bucket with (distributed.py ``check_bucket``): with 8-byte MAC chunks, a byte
    changed in a chunk between others, two chunks of a tensor swapped, a genuine bucket in another's place."""
    monkeypatch.setattr("rolloutpipe.control.weights.mac.MAC_CHUNK_BYTES", 8)
    state = policy()
    buckets, _, macs, _ = _bucket_macs(state)
    assert len(buckets) >= 3
    flat = [pack(bucket, state, torch.empty(bucket.num_bytes, dtype=torch.uint8)).clone() for bucket in buckets]
    for bucket, data, mac in zip(buckets, flat, macs):  # unchanged, each passes
        assert check_bucket(bucket, unpack(bucket, data), mac)
    bucket, data, mac = buckets[0], flat[0], macs[0]  # the embedding alone (56 bytes: 7 chunks)
    if where == "a middle chunk":
        data[20] ^= 4
    elif where == "two chunks swapped":
        data[:16] = torch.cat([data[8:16], data[:8]])
    elif where == "another bucket's bytes":
        bucket, data, mac = buckets[1], flat[1], macs[0]
    else:
        data[-1] ^= 0x80
    assert not check_bucket(bucket, unpack(bucket, data), mac)


def test_rank_0_destroys_a_broken_group_once_the_other_buffers_broadcast_has_failed_too(monkeypatch):
    """The first broadcast of a broken group fails while the other buffer's is still in flight (it fails a moment
    later, once the dead member's closed connection is seen). Leaving must wait for it and destroy the group: this
    rank's open connections are what keep a surviving SGLang server waiting in the broken broadcast."""
    destroyed = []
    monkeypatch.setattr(torch.distributed, "destroy_process_group", destroyed.append)

    class Work:  # a broadcast that has ended (failed) once it has been asked ``polls`` times
        def __init__(self, polls: int) -> None:
            self.polls = polls

        def is_completed(self) -> bool:
            self.polls -= 1
            return self.polls <= 0

    rank0 = object.__new__(Broadcaster)  # (no group to join: only leave's own state)
    rank0.group, rank0._pg = SimpleNamespace(group_name="broken"), "the group"
    rank0._in_flight = [(Work(1), None), (Work(5), None)]
    rank0.leave()
    assert destroyed == ["the group"] and rank0._pg is None


def test_a_bucket_mac_travels_as_a_header_and_a_malformed_one_is_an_error():
    _, _, macs, _ = _bucket_macs(policy())
    assert BucketMac.parse(macs[1].header()) == macs[1]
    for value in ("", "zz:00", f"{'00' * 32}:{'00' * 15}", f"{'00' * 31}:{'00' * 16}"):
        with pytest.raises(ValueError):
            BucketMac.parse(value)


def test_every_bucket_is_a_message_of_its_own_and_the_digest_is_the_policys(gmac_uses):
    """Fresh salt per bucket, so every (GMAC key, nonce) pair is used once over two sends of one policy; the tensors'
    bytes are hashed once for both the MAC and the step's weights digest, which is the policy's."""
    state = policy()
    (_, first, _, digest), (_, second, _, _) = _bucket_macs(state), _bucket_macs(state)
    assert digest.hexdigest() == weights_digest(state)
    assert len(gmac_uses) == 2 * (7 + 4 + 1 + 1 + 4 + 3) and len(set(gmac_uses)) == len(gmac_uses)
    assert len({r["salt"] for r in first + second}) == len(first) + len(second)


@pytest.mark.parametrize("engine,checks", [("embedded_http", True), ("sglang", False)])
def test_the_trainer_makes_bucket_macs_only_for_engines_that_check_them(engine, checks):
    """The embedded engine's server refuses a bucket without its MAC; SGLang has no way to take one, so none is made
    (for a 32B policy, seconds of GMAC a step for nothing), and the rollout node sends none."""
    settings = load_config({"rollout": {"engine": engine}, "pipeline": {"weight_sync": "distributed"}}).weight_sync()
    assert settings.engines_check_buckets is checks
    state, published = policy(), {}
    buckets = plan_buckets(state, 64)
    tensors = ({name: state[name] for name in bucket.names} for bucket in buckets)
    digest = Digest()
    publish = published.__setitem__ if settings.engines_check_buckets else None
    assert [b for b, _ in authenticated(buckets, tensors, weights_key(ATTEMPT_KEY), digest, publish)] == buckets
    assert len(published) == (len(buckets) if checks else 0) and digest.hexdigest() == weights_digest(state)


# --- pipeline.weight_sync=null ------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides,way,why", [
    ({"rollout": {"engine": "sglang"}}, WeightSync.distributed, "SGLang engines on GPU nodes"),
    ({"rollout": {"engine": "sglang", "engine_urls": ["http://10.0.0.1:30000"], "num_engines": 1,
                  "engine_api_key_file": "/dev/null"}}, WeightSync.disk, "rollout.engine_urls"),
    ({"rollout": {"engine": "sglang"}, "pipeline": {"mode": "async_one_step"}}, WeightSync.disk, "async_one_step"),
    ({"rollout": {"engine": "embedded_http"}}, WeightSync.disk, "run on CPU"),
    ({}, WeightSync.disk, "run on CPU"),
])
def test_null_broadcasts_where_it_can_serve_and_config_yaml_records_the_way(tmp_path, overrides, way, why):
    cfg = load_config(OmegaConf.merge({"pipeline": {"weight_sync": None}}, overrides))
    assert cfg.pipeline.weight_sync is way
    assert why in cfg.weight_sync_choice()[1]
    save_config(cfg, tmp_path / "config.yaml")
    assert OmegaConf.load(tmp_path / "config.yaml").pipeline.weight_sync == way.value
    assert load_config(OmegaConf.load(tmp_path / "config.yaml")).pipeline.weight_sync is way  # a node re-reads it


@pytest.mark.parametrize("experiment", ["gpqa", "math", "math_8b"])
def test_the_gpu_presets_broadcast_unless_told_otherwise_and_the_cpu_default_stays_on_disk(experiment, tmp_path):
    from hydra import compose, initialize_config_dir

    from rolloutpipe.config import register_hydra_schema

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "rows.jsonl").write_text('{"prompt": "1+1?", "label": "2"}\n')
    register_hydra_schema()
    base = [f"+experiment={experiment}", "launcher=slurm", f"model.path={tmp_path}",
            f"data.path={tmp_path / 'rows.jsonl'}"]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        preset, told = (load_config(compose("config", overrides=base + extra))
                        for extra in ([], ["pipeline.weight_sync=disk"]))
    assert preset.pipeline.weight_sync is WeightSync.distributed
    assert told.pipeline.weight_sync is WeightSync.disk
    assert load_config({}).pipeline.weight_sync is WeightSync.disk
