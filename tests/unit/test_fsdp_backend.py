"""fsdp_backend's pure parts: the streamed safetensors file and the layers it shards (the jobs: multiprocess)."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from rolloutpipe.model import DType, ModelConfig, build_tiny_tokenizer, load_model
from rolloutpipe.trainer.fsdp_backend import decoder_layers, hf_names, safetensors_header


def test_streamed_safetensors_file_loads_as_the_tensors_written(tmp_path):
    """save_weights writes the header from shapes alone, then each bucket's bytes: safetensors reads it back."""
    tensors = {"b.weight": torch.randn(3, 5, dtype=torch.bfloat16), "a.bias": torch.randn(7, dtype=torch.float64),
               "c": torch.randn(2, 1, 3), "empty": torch.zeros(0, 4)}
    path = tmp_path / "w.safetensors"
    with path.open("wb") as f:
        f.write(safetensors_header({k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}))
        for v in tensors.values():
            f.write(v.contiguous().view(torch.uint8).numpy().tobytes())
    loaded = load_file(str(path))
    assert loaded.keys() == tensors.keys()
    for k, v in tensors.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), k


def test_each_decoder_layer_is_sharded_and_the_tied_head_is_not_sent_twice():
    model = load_model(ModelConfig(dtype=DType.float32), len(build_tiny_tokenizer()))
    assert len(decoder_layers(model)) == model.config.num_hidden_layers
    names = hf_names(model)
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert names.keys() == {k for k in model.state_dict() if k != "lm_head.weight"}
