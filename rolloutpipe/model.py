"""The policy model and its tokenizer: an HF causal-LM directory, or the embedded tiny Qwen3.

The embedded default is a Qwen3-architecture causal LM built from a config with a seeded random
init and a character-level tokenizer built in code, so nothing is downloaded. Both the rollout
engines and the trainer build the same model from the same config and seed, so policy_version 0 is
identical on both node groups without a weight transfer.

torch is imported where a model is built, not with the module: the launcher reads ``ModelConfig`` and starts the
node processes without it (about 1.3 s of every ``python launch.py``).
"""

from __future__ import annotations

import enum
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

TINY_SPECIAL_TOKENS = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_CHARS = string.digits + string.ascii_lowercase + "= :+?"
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}:{{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant:{% endif %}"
)


class DType(enum.Enum):
    float32 = "float32"
    float64 = "float64"
    bfloat16 = "bfloat16"

    @property
    def torch(self) -> torch.dtype:
        import torch

        return getattr(torch, self.value)


@dataclass(kw_only=True, slots=True)
class TinyModelConfig:
    """Shape of the embedded Qwen3 (used when ``model.path`` is null)."""

    num_layers: int = 2
    hidden_size: int = 64
    intermediate_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    path: str | None = None
    """An HF causal-LM directory (config, weights, tokenizer). Null: the embedded tiny Qwen3."""
    dtype: DType = DType.float32
    """Parameter dtype on both node groups. float64 makes parity checks exact to ~1e-12."""
    init_seed: int = 0
    """Seed of the tiny model's random init (ignored with ``path``)."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)

    def __post_init__(self) -> None:
        if self.path is not None and not (Path(self.path) / "config.json").is_file():
            raise ValueError(
                f"model.path={self.path!r} is not an HF model directory (no config.json there). "
                "Point it at a directory saved with save_pretrained, "
                "or set model.path=null for the embedded tiny model."
            )


def build_tiny_tokenizer():
    """A character-level tokenizer over digits, lowercase letters and a few signs (45 symbols)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(TINY_SPECIAL_TOKENS + list(TINY_CHARS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|pad|>", eos_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


def load_tokenizer(cfg: ModelConfig):
    if cfg.path is None:
        return build_tiny_tokenizer()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(cfg.path)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"model.path={cfg.path!r} has no usable tokenizer ({err}). Save one beside the weights "
            "(tokenizer.save_pretrained(path))."
        ) from err


def context_len(cfg: ModelConfig) -> int | None:
    """The longest prompt + response the model takes (``max_position_embeddings``, what SGLang serves by default
    and checks every request against); None if its config does not say."""
    if cfg.path is None:
        return cfg.tiny.max_position_embeddings
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(cfg.path)
    config = getattr(config, "text_config", None) or config
    return getattr(config, "max_position_embeddings", None)


def load_model(cfg: ModelConfig, vocab_size: int) -> torch.nn.Module:
    """The policy in eval mode on CPU, in ``cfg.dtype``; identical on every process for the same config.

    Attention is torch's scaled_dot_product_attention (``sdpa``): on a GPU its flash / memory-efficient kernels,
    which keep no [heads, T, T] scores for backward (the trainer calls it purely causal: torch_backend)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if cfg.path is not None:
        model = AutoModelForCausalLM.from_pretrained(cfg.path, dtype=cfg.dtype.torch, attn_implementation="sdpa")
        return model.eval()
    tiny = cfg.tiny
    hf_config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_layers,
        num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_key_value_heads,
        head_dim=tiny.hidden_size // tiny.num_attention_heads,
        max_position_embeddings=tiny.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        attn_implementation="sdpa",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.init_seed)
        model = Qwen3ForCausalLM(hf_config)
    # The parameters in the dtype; the buffers that are computed, not saved (RoPE's inverse frequencies), stay
    # float32, as from_pretrained leaves them: the same model as the checkpoints of the run reload, in every dtype.
    for parameter in model.parameters():
        parameter.data = parameter.data.to(cfg.dtype.torch)
    return model.eval()


def save_hf_checkpoint(model: torch.nn.Module, tokenizer, directory: Path,
                       state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """Weights (safetensors), config and tokenizer in the HF layout, loadable by transformers; ``state_dict``: these
    weights instead of the model's own (a copy of them: trainer/restore.py)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True, state_dict=state_dict)
    tokenizer.save_pretrained(directory)
