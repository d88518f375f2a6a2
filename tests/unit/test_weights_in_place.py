"""The disk way into engines of the rollout node's own process (control/weights/disk.py ``copy_checked``, the
supervisor's ``weights_in_place``): every engine is filled in one read of the file, which the MAC check follows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rolloutpipe.control.weights.disk import copy_checked, file_mac, weights_file
from rolloutpipe.control.weights.mac import weights_key
from rolloutpipe.rollout.engines.embedded import EmbeddedEngine
from rolloutpipe.rollout.engines.supervisor import EngineSupervisor
from tests.helpers.embedded import Results, tiny_model
from tests.unit.test_weight_transfer import ATTEMPT_KEY, policy, receiver, record, written


def filled(state: dict[str, torch.Tensor], to: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """An engine's state dict for ``state``: the same names and shapes, every element 7 (floats in ``to``)."""
    return {name: torch.full_like(t, 7, dtype=to if to is not None and t.is_floating_point() else t.dtype)
            for name, t in state.items()}


@pytest.mark.parametrize("piece_bytes", [4, 24, 1 << 20], ids=["pieces in chunks", "chunks in pieces", "default"])
def test_one_read_fills_every_engine_in_its_own_dtype_and_gives_the_files_mac(tmp_path, monkeypatch, piece_bytes):
    """With 8-byte MAC chunks: pieces smaller than a chunk (a chunk's GMAC fed piece by piece) and larger. A tied
    name (``lm_head.weight`` on the embedding's storage) is filled through the name the file has."""
    monkeypatch.setattr("rolloutpipe.control.weights.mac.MAC_CHUNK_BYTES", 8)
    monkeypatch.setattr("rolloutpipe.control.weights.disk.COPY_PIECE_BYTES", piece_bytes)
    state = policy()
    path = tmp_path / weights_file(1)
    out = written(path, state)
    same, wider = filled(state), filled(state, torch.float64)
    same["lm_head.weight"] = same["model.embed_tokens.weight"]
    key, salt = weights_key(ATTEMPT_KEY), bytes.fromhex(out.salt)
    assert copy_checked(path, key, salt, [same, wider]) == out.mac == file_mac(path, key, salt)
    for name, tensor in state.items():
        assert same[name].dtype == tensor.dtype and torch.equal(same[name], tensor), name
        assert torch.equal(wider[name], tensor.to(wider[name].dtype)), name
    assert torch.equal(same["lm_head.weight"], state["model.embed_tokens.weight"])
    assert copy_checked(path, key, salt, []) == out.mac  # no engine left: still the check


@pytest.mark.parametrize("misfit,message", [
    ("missing", r"the engine has no tensors \['model.norm.weight'\]"),
    ("extra", r"the file has no tensors \['model.extra'\]"),
    ("shape", r"model.layers.0.mlp.up_proj.weight has shape \[4, 4\] in the file, \[2, 8\] in the engine"),
    ("scattered", r"the engine's \['model.layers.0.mlp.up_proj.weight'\] are not contiguous"),
])
def test_a_file_that_does_not_fit_the_engines_stops_the_run_before_anything_is_copied(tmp_path, misfit, message):
    state = policy()
    path = tmp_path / weights_file(2)
    out = written(path, state)
    good, engine = filled(state), filled(state)
    up = "model.layers.0.mlp.up_proj.weight"
    if misfit == "missing":
        del engine["model.norm.weight"]
    elif misfit == "extra":
        engine["model.extra"] = torch.zeros(3)
    elif misfit == "shape":
        engine[up] = torch.full((2, 8), 7, dtype=torch.bfloat16)
    else:
        engine[up] = torch.full((4, 4), 7, dtype=torch.bfloat16).t()
    with pytest.raises(RuntimeError, match=f"do not fit the engines' model: .*{message}"):
        receiver(tmp_path).check_file(path, record(2, out), 2, copy_into=[good, engine])
    assert all(bool((t == 7).all()) for t in good.values())  # refused before the first copy

    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))  # changed, too: that is the cause reported
    with pytest.raises(RuntimeError, match="does not have the MAC the trainer published for policy_version 2"):
        receiver(tmp_path).check_file(path, record(2, out), 2, copy_into=[good, engine])


def engines_of(*models: torch.nn.Module) -> tuple[list[EmbeddedEngine], EngineSupervisor]:
    engines = [EmbeddedEngine(name=f"engine{i}", model=m, concurrency=2, on_result=Results())
               for i, m in enumerate(models)]

    def restart(slot: int, name: str, failed) -> EmbeddedEngine:
        return EmbeddedEngine(name=name, model=tiny_model(init_seed=9), concurrency=2, on_result=Results())

    spans = SimpleNamespace(add=lambda *args, **kwargs: None)
    return engines, EngineSupervisor(engines=list(engines), restart=restart, where_to_look=lambda e: e.name,
                                     max_failures=1, request_timeout_s=None, spans=spans)


def test_the_rollout_node_fills_its_embedded_engines_in_one_read_and_they_serve_the_new_policy(tmp_path, monkeypatch):
    """No engine reads the file itself (safetensors' reader would raise); both serve the trainer's weights, tied
    head included, as policy_version 3. An engine that crashed since the last step is replaced, and its replacement
    reads the file (its own load)."""
    trained = tiny_model(init_seed=1).state_dict()
    trained.pop("lm_head.weight", None)  # tied: the trainer sends the embedding once
    path = tmp_path / weights_file(3)
    out = written(path, trained, bucket_bytes=1 << 16)
    engines, supervisor = engines_of(tiny_model(), tiny_model(init_seed=2))
    try:
        monkeypatch.setattr("safetensors.torch.load_file", lambda *a, **k: pytest.fail("an engine read the file"))
        receiver(tmp_path, supervisor).load(record(3, out), 3)
        monkeypatch.undo()
        for engine in engines:
            served = engine._model.state_dict()
            assert engine.policy_version == 3 and all(torch.equal(served[n], t) for n, t in trained.items())
            assert torch.equal(served["lm_head.weight"], trained["model.embed_tokens.weight"])

        engines[1].error = RuntimeError("its scheduler thread raised")
        receiver(tmp_path, supervisor).load(record(3, out), 3)
        replacement = supervisor.engines[1]
        assert replacement.name == "engine1-restart1" and replacement.policy_version == 3
        assert torch.equal(replacement._model.state_dict()["model.norm.weight"], trained["model.norm.weight"])
    finally:
        for engine in supervisor.engines + engines:
            engine.shutdown()


def test_a_changed_file_stops_the_run_and_the_engines_do_not_serve_it(tmp_path):
    trained = tiny_model(init_seed=1).state_dict()
    trained.pop("lm_head.weight", None)
    path = tmp_path / weights_file(4)
    out = written(path, trained, bucket_bytes=1 << 16)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    engines, supervisor = engines_of(tiny_model())
    try:
        with pytest.raises(RuntimeError, match="does not have the MAC the trainer published for policy_version 4"):
            receiver(tmp_path, supervisor).load(record(4, out), 4)
        assert engines[0].policy_version == 0
    finally:
        engines[0].shutdown()
