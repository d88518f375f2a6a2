"""Checks of the model and its tokenizer before anything starts: what would make a run wrong, said at launch.

``check_model`` reads model.path's config.json and tokenizer (no weights), so a model the trainer backend cannot map
faithfully, or a tokenizer that cannot serve the model, stops ``python launch.py`` with exit code 2 and the key to
change, instead of after the queue wait and the model load on every rank. So does an explicit
``trainer.megatron.distributed_optimizer=true`` with float64, which Megatron refuses (``check_distributed_optimizer``).

``warn_memory`` (GPU launchers only: launch.py's Slurm kinds, TorchX with GPUs) logs the memory plan's warnings
(launch/memory_plan.py) when an estimate exceeds a GPU's memory, and the host memory plan's (launch/host_memory.py)
when a node's exceeds its ``launcher.<group>.mem_gb``: a warning, never a refusal, since an estimate is not a
measurement. The local CPU run never computes it.
"""

from __future__ import annotations

import logging

from rolloutpipe.config import Config, ConfigError
from rolloutpipe.model import load_tokenizer
from rolloutpipe.trainer.config import TrainerBackend

log = logging.getLogger(__name__)


def check_model(cfg: Config) -> None:
    check_distributed_optimizer(cfg)
    if cfg.model.path is None:
        return  # the embedded tiny model and its tokenizer are made for each other
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(cfg.model.path)
        tokenizer = load_tokenizer(cfg.model)
    except (OSError, ValueError) as err:
        raise ConfigError(f"model.path={cfg.model.path}: {err}") from None
    check_tokenizer(tokenizer, hf_config, path=cfg.model.path)
    if cfg.trainer.backend is TrainerBackend.megatron:
        from rolloutpipe.trainer.megatron.model import check_supported

        try:
            check_supported(hf_config, tp_size=cfg.trainer.megatron.tensor_parallel_size)
        except ValueError as err:
            raise ConfigError(str(err)) from None


def check_distributed_optimizer(cfg: Config) -> None:
    """An explicit ``trainer.megatron.distributed_optimizer=true`` with float64 (it runs on GPUs and, redirected, on
    the CPU, but takes 16- and 32-bit parameters only)."""
    if cfg.trainer.backend is not TrainerBackend.megatron or not cfg.trainer.megatron.distributed_optimizer:
        return
    from rolloutpipe.trainer.megatron.optimizer import resolve_distributed_optimizer

    try:
        resolve_distributed_optimizer(True, cuda=True, dtype=cfg.model.dtype.value)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_tokenizer(tokenizer, hf_config, *, path: str) -> None:
    """The tokenizer must stop responses (eos), pad batches (pad) and emit only ids the model embeds."""
    for name in ("eos", "pad"):
        if getattr(tokenizer, f"{name}_token_id") is None:
            raise ConfigError(f"model.path={path}: the tokenizer has no {name} token; responses could not "
                              f"{'stop' if name == 'eos' else 'be batched'}. Set tokenizer.{name}_token and save it "
                              "beside the weights (tokenizer.save_pretrained).")
    if len(tokenizer) > hf_config.vocab_size:
        raise ConfigError(f"model.path={path}: the tokenizer has {len(tokenizer)} tokens but the model embeds "
                          f"{hf_config.vocab_size} (config.json vocab_size): it is not this model's tokenizer. Save "
                          "the model's own tokenizer beside its weights.")


def warn_memory(cfg: Config, *, gpu_memory_gib: float | None = None) -> list[str]:
    """Log (and return) one warning per trainer rank or engine estimate over the GPU's memory (80 GiB unless
    given), and per node whose host memory estimate is over its ``launcher.<group>.mem_gb`` (null: not checked),
    naming the largest terms and the keys that lower them."""
    from rolloutpipe.launch import host_memory, memory_plan

    gpu = memory_plan.DEFAULT_GPU_MEMORY_GIB if gpu_memory_gib is None else gpu_memory_gib
    shape = memory_plan.model_shape(cfg)
    lines = memory_plan.warnings(memory_plan.plan(cfg, shape, gpu_memory_gib=gpu))
    for line in lines:
        log.warning("%s (an estimate for a %.0f GiB GPU: python tools/memory_plan.py <the same overrides> "
                    "--gpu-memory-gib N shows every term)", line, gpu)
    host = host_memory.warnings(host_memory.plan(cfg, shape))
    for line in host:
        log.warning("%s (an estimate: python tools/memory_plan.py <the same overrides> shows every term)", line)
    return lines + host
