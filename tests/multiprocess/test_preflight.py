"""A model the code cannot map faithfully, or a tokenizer that cannot serve the model, stops the launch before
anything starts (launch/preflight.py): exit code 2, one line with the key and the fix."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rolloutpipe.config import ConfigError, load_config
from rolloutpipe.launch.preflight import check_model
from rolloutpipe.model import ModelConfig, build_tiny_tokenizer, load_model, save_hf_checkpoint
from tests.conftest import REPO, needs_extra, node_environ


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-hf")
    tokenizer = build_tiny_tokenizer()
    save_hf_checkpoint(load_model(ModelConfig(), len(tokenizer)), tokenizer, directory)
    return directory


def variant(hf_dir, tmp_path, **changes):
    """A copy of the tiny HF model directory with config.json fields changed."""
    import shutil

    copy = tmp_path / "model"
    shutil.copytree(hf_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    config.update(changes)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def config_for(path, **trainer):
    return load_config({"model": {"path": str(path)}, "trainer": trainer})


def test_the_saved_model_passes_on_both_backends(hf_dir):
    check_model(config_for(hf_dir))
    check_model(config_for(hf_dir, backend="megatron"))


@pytest.mark.parametrize("changes,message", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                          "original_max_position_embeddings": 256}}, "rope scaling 'yarn'"),
    ({"attention_bias": True}, "attention_bias=true, whose o_proj bias"),
    ({"use_sliding_window": True, "sliding_window": 64}, "sliding-window attention"),
], ids=["yarn", "attention-bias", "sliding-window"])
def test_what_the_megatron_mapping_does_not_carry_is_refused_at_launch(hf_dir, tmp_path, changes, message):
    path = variant(hf_dir, tmp_path, **changes)
    with pytest.raises(ConfigError, match=message):
        check_model(config_for(path, backend="megatron"))
    check_model(config_for(path))  # the torch backend runs the HF model itself


def test_a_tensor_parallel_size_that_does_not_divide_the_kv_heads_is_refused_at_launch(hf_dir):
    heads = json.loads((hf_dir / "config.json").read_text())["num_key_value_heads"]
    with pytest.raises(ConfigError, match=f"tensor_parallel_size=3 must divide the model's {heads} key/value"):
        check_model(config_for(hf_dir, backend="megatron", num_ranks=3, megatron={"tensor_parallel_size": 3}))


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(hf_dir, tmp_path):
    path = variant(hf_dir, tmp_path, vocab_size=len(build_tiny_tokenizer()) - 5)
    with pytest.raises(ConfigError, match="tokens but the model embeds .* not this model's tokenizer"):
        check_model(config_for(path))


def test_a_tokenizer_without_a_pad_token_is_refused(hf_dir, tmp_path):
    path = variant(hf_dir, tmp_path)
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    tokenizer_config.pop("pad_token", None)
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    special = path / "special_tokens_map.json"
    if special.exists():
        special.write_text(json.dumps({k: v for k, v in json.loads(special.read_text()).items() if k != "pad_token"}))
    with pytest.raises(ConfigError, match="the tokenizer has no pad token"):
        check_model(config_for(path))


def test_the_launch_stops_with_exit_code_2_before_anything_starts(hf_dir, tmp_path):
    path = variant(hf_dir, tmp_path, attention_bias=True)
    result = subprocess.run([sys.executable, str(REPO / "launch.py"), f"run.dir={tmp_path / 'run'}",
                             f"model.path={path}", "trainer.backend=megatron"],
                            cwd=tmp_path, env=node_environ(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.startswith("error: model.path's config has attention_bias=true"), result.stderr
    assert not (tmp_path / "run" / "config.yaml").exists()


@needs_extra("slurm", "torchx")
def test_the_torchx_component_refuses_the_same_model_before_anything_is_queued(hf_dir, tmp_path):
    """launchers/components.py runs launch.py's model checks: TorchX reports the same error and starts nothing."""
    path = variant(hf_dir, tmp_path, attention_bias=True)
    component = f"{REPO / 'launchers' / 'components.py'}:grpo"
    result = subprocess.run(["torchx", "run", "-s", "local_cwd", component, f"run.dir={tmp_path / 'run'}",
                             f"model.path={path}", "trainer.backend=megatron"],
                            cwd=tmp_path, env=node_environ(), capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "model.path's config has attention_bias=true" in result.stdout + result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "run" / "config.yaml").exists()
