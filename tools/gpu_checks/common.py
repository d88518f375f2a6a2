"""What the parts share: the machine they run on, the rows they report, and whole jobs through launch.py.

Nothing here imports pytest or tests/conftest.py: the check runs on a bare GPU machine that has only the project's
run-time dependencies (docs/gpu.md). The jobs' reward, tests/fixtures/dense_rewards.py, imports only rolloutpipe.
"""

from __future__ import annotations

import enum
import os
import subprocess
import sys
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class Verdict(enum.Enum):
    passed = "pass"
    miss = "MISS"
    skipped = "skip"


def verdict(ok: bool) -> Verdict:
    return Verdict.passed if ok else Verdict.miss


@dataclass(kw_only=True, slots=True)
class Row:
    """One line of the table: what a part checked, what it measured, the limit it was held to, and the verdict."""

    part: str
    checked: str
    measured: str
    limit: str
    verdict: Verdict
    figures: dict = field(default_factory=dict)
    """The measured numbers, for the JSON summary."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Machine:
    """Where the parts run and how hard they look (tools/gpu_check.py's flags)."""

    cpu_smoke: bool
    """Tiny shapes on the CPU, memory reported but not judged, NCCL and SGLang skipped: the plumbing, not a GPU."""
    num_gpus: int
    out: Path
    layers: int
    """trainer_size's decoder layers at Qwen3-1.7B's width."""
    num_timed: int
    """trainer_size's timed batches after the warm-up one (tokens/s and MFU: the best of them)."""
    peak_tflops: float | None
    """The GPU's dense bfloat16 peak, what MFU divides by (None: MFU not reported)."""
    num_jobs: int
    """launch.py runs at once within a part."""

    def folder(self, part: str) -> Path:
        """Where ``part`` keeps its runs: emptied when the check starts it."""
        return self.out / part

    @property
    def num_ranks(self) -> int:
        """Trainer ranks of the multi-rank runs: 2 on the CPU (gloo) and with two GPUs or more (NCCL, one GPU
        each); 1 with one GPU, where NCCL refuses two ranks on one device."""
        return 2 if self.cpu_smoke or self.num_gpus >= 2 else 1


def tiny_model_config(init_seed: int = 0):
    from rolloutpipe.model import ModelConfig, TinyModelConfig

    return ModelConfig(init_seed=init_seed, tiny=TinyModelConfig(hidden_size=256, intermediate_size=512,
                                                                 num_attention_heads=4, num_key_value_heads=2))


def qwen3_config(shape, *, max_positions: int):
    """The HF Qwen3 config of a launch/model_shapes.ModelShape (tied embeddings)."""
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                       intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
                       num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                       head_dim=shape.head_dim, tie_word_embeddings=True, max_position_embeddings=max_positions,
                       rope_theta=1e6)


WORKLOAD = ["rollout_batch_size=4", "n_samples_per_prompt=4", "global_batch_size=16", "micro_batch_size=4",
            "rollout_max_response_len=6", "reward.name=letter_fraction",
            "reward.import_modules=[tests.fixtures.dense_rewards]", "wandb.mode=disabled"]
"""tests/conftest.py's SMALL workload and dense reward: 16 samples a step, a few seconds a run. The untrained tiny
model earns the task's own reward too rarely for its groups to train, and the digests must move every step."""
BF16_EXACT = ["trainer.exact_accumulation=true", "rollout.batch_invariant=true", "model.dtype=bfloat16"]
"""The same bits in any arrival order and rank split (tests/helpers/parity.py), in bfloat16."""


def launch(run_dir: Path, *overrides: str, environ: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python launch.py run.dir=<run_dir> <overrides>`` to completion; its stderr is kept beside the run."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, str(REPO / "launch.py"), f"run.dir={run_dir}", *overrides], check=False,
                            cwd=REPO, env={**os.environ, "PYTHONPATH": path, **(environ or {})}, capture_output=True,
                            text=True, timeout=900)
    run_dir.with_name(run_dir.name + ".stderr.txt").write_text(result.stderr)
    return result


def launch_all(machine: Machine, runs: Mapping[str, tuple], environ: Mapping[str, Mapping[str, str]] | None = None
               ) -> dict[str, subprocess.CompletedProcess]:
    """Several ``launch`` calls, ``machine.num_jobs`` at a time: name -> (run_dir, *overrides)."""
    with ThreadPoolExecutor(machine.num_jobs) as pool:
        futures = {name: pool.submit(launch, *spec, environ=(environ or {}).get(name)) for name, spec in runs.items()}
        return {name: future.result() for name, future in futures.items()}


def failure(name: str, result: subprocess.CompletedProcess) -> str | None:
    """None if the run exited 0, else its exit code and the last line of its stderr (the whole of it is beside the
    run directory)."""
    if result.returncode == 0:
        return None
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    return f"{name} exited {result.returncode}: {(lines or ['(no stderr)'])[-1][:200]}"


def same_digests(run_a: Path, run_b: Path, num_steps: int) -> tuple[bool, str]:
    """Whether two runs logged the same ``train/weights_digest`` at each of their ``num_steps`` steps, each step's
    new (equal digests of weights that never moved would prove nothing), and the figure for the table."""
    from rolloutpipe.observe.report import first_difference, run_digests

    comparison = first_difference(run_a, run_b)
    digests = run_digests(run_a)
    moved = len(set(digests.values())) == len(digests)
    ok = comparison.first_difference is None and comparison.common_steps == list(range(num_steps)) and moved
    if comparison.first_difference is not None:
        return False, f"digests differ from step {comparison.first_difference}"
    return ok, (f"digests equal at {len(comparison.common_steps)}/{num_steps} steps"
                + ("" if moved else ", but a step left the weights unchanged"))


def same_final_weights(run_a: Path, run_b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    a, b = (load_file(str(r / "checkpoints" / "final" / "model.safetensors")) for r in (run_a, run_b))
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
