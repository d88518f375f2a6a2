"""The GPU recipes bind to the typed config: SGLang engines, the Megatron trainer, Slurm resources that match."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from rolloutpipe.config import load_config, register_hydra_schema
from rolloutpipe.launch.config import LauncherKind
from rolloutpipe.rollout.config import EngineKind
from rolloutpipe.trainer.config import TrainerBackend
from tests.conftest import REPO


@pytest.mark.parametrize("experiment", ["gpqa", "math"])
def test_gpu_recipe_runs_sglang_and_megatron_with_matching_slurm_resources(experiment, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "rows.jsonl").write_text('{"prompt": "1+1?", "label": "2"}\n')
    register_hydra_schema()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        raw = compose("config", overrides=[f"+experiment={experiment}", "launcher=slurm",
                                           f"model.path={tmp_path}", f"data.path={tmp_path / 'rows.jsonl'}"])
    cfg = load_config(raw)
    assert cfg.rollout.engine is EngineKind.sglang and cfg.trainer.backend is TrainerBackend.megatron
    assert cfg.launcher.kind is LauncherKind.slurm
    trainer = cfg.launcher.trainer
    assert trainer.nodes * trainer.tasks_per_node == cfg.trainer.num_ranks
    assert cfg.launcher.rollout.gpus_per_node >= cfg.rollout.engines_per_node * cfg.rollout.sglang_gpus_per_engine
    assert cfg.rollout.num_engines == cfg.launcher.rollout.nodes * cfg.rollout.engines_per_node
    assert cfg.n_samples_per_prompt == 8 and cfg.rollout_max_response_len >= 4096
