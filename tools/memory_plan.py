"""Estimated peak GPU memory per trainer rank and per rollout engine, term by term, against a GPU's memory; then
the host memory of the first trainer node and the first rollout node, against launcher.<group>.mem_gb.

    python tools/memory_plan.py +experiment=gpqa model.path=/path/to/Qwen3-1.7B
    python tools/memory_plan.py +experiment=gpqa --model-shape qwen3-1.7b --gpu-memory-gib 141
    python tools/memory_plan.py +experiment=math --model-shape qwen3-4b trainer.recompute=true
    python tools/memory_plan.py --model-shape qwen3-32b +experiment=math trainer.backend=fsdp

Takes launch.py's Hydra overrides (the same Config, checked the same way) and these flags; the shape comes from
model.path's config.json, or ``--model-shape`` (then model.path and data.path may be left out). Where more
trainer ranks divide the state (FSDP, Megatron's distributed optimizer) it names the fewest trainer GPUs that fit.
What each term counts and assumes: rolloutpipe/launch/memory_plan.py (GPU) and rolloutpipe/launch/host_memory.py
(host; launcher.trainer.mem_gb=N and launcher.rollout.mem_gb=N check a node against N GiB). Exit code 1 when an
estimate does not fit, 2 on a bad config.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rolloutpipe.config import ConfigError, compose_config
from rolloutpipe.launch import host_memory, memory_plan

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Other arguments are Hydra overrides, as for launch.py.")
    parser.add_argument("--gpu-memory-gib", type=float, default=memory_plan.DEFAULT_GPU_MEMORY_GIB)
    parser.add_argument("--model-shape", choices=sorted(memory_plan.QWEN3_SHAPES),
                        help="built-in Qwen3 config.json numbers instead of model.path's")
    parser.add_argument("--attention", choices=[k.value for k in memory_plan.AttentionKind],
                        help="what the trainer's attention keeps (default: fused for the torch backend's SDPA, "
                             "materialised for Megatron's local layer spec)")
    args, overrides = parser.parse_known_args(argv)
    if args.model_shape:  # the shape is given: the preset's must-set paths are not needed
        given = {o.lstrip("+").split("=", 1)[0] for o in overrides}
        overrides = [f"{key}=null" for key in ("model.path", "data.path") if key not in given] + overrides
    try:
        cfg = compose_config(overrides, CONF_DIR)
        shape = memory_plan.QWEN3_SHAPES[args.model_shape] if args.model_shape else memory_plan.model_shape(cfg)
    except (ConfigError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    attention = memory_plan.AttentionKind(args.attention) if args.attention else None
    result = memory_plan.plan(cfg, shape, gpu_memory_gib=args.gpu_memory_gib, attention=attention)
    nodes = host_memory.plan(cfg, shape)
    print(memory_plan.format_plan(result))
    print()
    print(host_memory.format_plan(nodes), end="")
    print("\n".join(host_memory.warnings(nodes)) or "every node's host memory fits (or is not checked)")
    return 0 if all(e.fits for e in result.estimates) and all(n.fits for n in nodes) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
