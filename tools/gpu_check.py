"""The GPU check: one command on a GPU machine, one table, a non-zero exit on any miss (docs/gpu.md).

    python tools/gpu_check.py [--out gpu_check_out]        every part; the SGLang ones only where sglang imports
    python tools/gpu_check.py --parts trainer_size,bit_identity
    python tools/gpu_check.py --cpu-smoke                  the check's plumbing on a CPU machine (tiny shapes)

Parts, in this order (tools/gpu_checks/; each module's docstring says what is held to what):

    trainer_size            each backend at Qwen3-1.7B's width: peak memory vs the memory plan, tokens/s and MFU
    distributed_optimizer   Megatron's DistributedOptimizer vs the torch backend, through a checkpoint, its memory
    default_run             python launch.py, the embedded default, trainer on CUDA: it exits 0 and learns
    resume                  a Megatron run (distributed optimizer) stopped and resumed: the uninterrupted digests
    bit_identity            bf16 sync vs cgp+fgd, exact accumulation, on torch, fsdp and megatron: equal digests
    fsdp_nccl               FSDP over NCCL on the GPUs (at most 2): it trains
    logprobs, parity        a real SGLang server against the trainer (need sglang; skipped without it)

Everything but the SGLang parts needs only the project's run-time dependencies and a CUDA torch (the check stops
before any part, naming them, when one is missing: docs/gpu.md's wheel folder), and takes under 5 minutes on one
H200. A part that crashes is a MISS row with its error; the others still run. With one GPU the multi-rank runs use
one rank (NCCL takes one GPU per rank); with two or more, two. The table goes to stdout and, with a JSON summary, to
OUT/gpu_check.md and OUT/gpu_check.json; each part's runs are under OUT/<part>/.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PARTS = ("trainer_size", "distributed_optimizer", "default_run", "resume", "bit_identity", "fsdp_nccl", "logprobs",
         "parity")
SGLANG_PARTS = ("logprobs", "parity")
TIME_GOAL_S = 300
"""Every part that needs no SGLang, on one H200 (issue 43)."""


def missing_dependencies() -> list[str]:
    """The project's run-time dependencies and its megatron extra (pyproject.toml) that this Python lacks, or has at a
    version they exclude: a GPU image has torch and transformers, the rest comes as a wheel folder (docs/gpu.md)."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    missing = []
    for line in [*project["dependencies"], *project["optional-dependencies"]["megatron"]]:
        requirement = Requirement(line)
        try:
            version = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(f"{requirement} (absent)")
            continue
        if not requirement.specifier.contains(version, prereleases=True):
            missing.append(f"{requirement} (has {version})")
    return missing


def part_function(name: str, args: argparse.Namespace):
    """The part's function of the machine (imported only when it runs: the SGLang parts import sglang)."""
    if name == "trainer_size":
        from gpu_checks import trainer_size

        return trainer_size.check
    if name == "distributed_optimizer":
        from gpu_checks import distributed_optimizer

        return distributed_optimizer.check
    if name in ("default_run", "resume", "bit_identity", "fsdp_nccl"):
        from gpu_checks import runs

        return getattr(runs, name)
    from gpu_checks import sglang_engine

    if name == "logprobs":
        return lambda machine: sglang_engine.logprobs(machine, args.sglang_args, args.logprob_atol)
    return lambda machine: sglang_engine.parity(machine, args.sglang_args, args.trainer_backend)


def run_part(name: str, machine, args: argparse.Namespace) -> list:
    """The part's rows; a skip row where it cannot run here; a MISS row with the error where it crashed."""
    from gpu_checks.common import Row, Verdict

    if name in SGLANG_PARTS and (machine.cpu_smoke or importlib.util.find_spec("sglang") is None):
        why = "no GPU (--cpu-smoke)" if machine.cpu_smoke else "sglang is absent (pip install -e '.[sglang]')"
        return [Row(part=name, checked="a real SGLang server", measured=f"skipped: {why}", limit="-",
                    verdict=Verdict.skipped)]
    folder = machine.folder(name)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    print(f"-- {name}", flush=True)
    try:
        return part_function(name, args)(machine)
    except Exception as err:  # noqa: BLE001 (a crash is the part's MISS row; the others still run)
        traceback.print_exc()
        message = (str(err).strip().splitlines() or [""])[-1][:200]
        return [Row(part=name, checked="the part ran to its end", measured=f"crashed: {type(err).__name__}: "
                    f"{message}", limit="no error", verdict=Verdict.miss)]


def describe_machine(machine) -> dict:
    import torch

    def version(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "absent"

    cuda = torch.cuda.is_available()
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}" if cuda
                       else "CPU (--cpu-smoke)"),
            "python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
            **{p: version(p) for p in ("transformers", "megatron-core", "transformer-engine", "sglang")},
            "peak_tflops": machine.peak_tflops, "trainer_ranks": machine.num_ranks}


def markdown(rows: list, about: dict, times: dict[str, float]) -> str:
    lines = ["GPU check, " + ", ".join(f"{k} {v}" for k, v in about.items()), "",
             "| part | checked | measured | limit | result |", "|---|---|---|---|---|"]
    lines += [f"| {r.part} | {r.checked} | {r.measured} | {r.limit} | {r.verdict.value} |" for r in rows]
    spent = sum(t for name, t in times.items() if name not in SGLANG_PARTS)
    lines += ["", "wall time: " + ", ".join(f"{name} {t:.0f} s" for name, t in times.items())
              + f"; without SGLang {spent:.0f} s (goal on one H200: under {TIME_GOAL_S} s)"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check_out"))
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of: {', '.join(PARTS)}")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny shapes on the CPU (CUDA hidden): the check's plumbing, memory not judged")
    parser.add_argument("--layers", type=int, default=4, help="trainer_size's layers at Qwen3-1.7B's width")
    parser.add_argument("--num-timed", type=int, default=None,
                        help="trainer_size's timed batches after the warm-up (default 3; 1 with --cpu-smoke)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the GPU's dense bf16 TFLOP/s for MFU (default: H100/H200 989, A100 312, by name)")
    parser.add_argument("--jobs", type=int, default=None, help="launch.py runs at once (default 4; 2 on the CPU)")
    parser.add_argument("--logprob-atol", type=float, default=2e-3)
    parser.add_argument("--trainer-backend", choices=["megatron", "torch"], default="megatron",
                        help="the parity part's trainer")
    parser.add_argument("--sglang-args", nargs=argparse.REMAINDER, default=[],
                        help="extra sglang.launch_server arguments (last on the line)")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    if unknown := set(parts) - set(PARTS):
        parser.error(f"unknown part(s) {', '.join(sorted(unknown))}; the parts: {', '.join(PARTS)}")
    if missing := missing_dependencies():  # (before anything runs: each part would fail on its first import)
        print(f"error: missing here: {', '.join(missing)}. Install them (pip install -e '.[megatron]'); on a machine "
              "with no package index, from a wheel folder: docs/gpu.md, 'A bare GPU machine'.", file=sys.stderr)
        return 2
    if args.cpu_smoke:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch initialises CUDA; the launched jobs inherit it
    import torch
    from gpu_checks.common import Machine, Verdict
    from gpu_checks.trainer_size import default_peak_tflops

    if args.cpu_smoke:  # tiny models gain nothing from more, and OpenMP's spinning threads crawl on shared cores
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        print("error: no CUDA device here. The check's plumbing runs on a CPU with --cpu-smoke.", file=sys.stderr)
        return 2
    machine = Machine(cpu_smoke=args.cpu_smoke, num_gpus=torch.cuda.device_count(), out=args.out.resolve(),
                      layers=args.layers, num_timed=args.num_timed or (1 if args.cpu_smoke else 3),
                      peak_tflops=args.peak_tflops or default_peak_tflops(),
                      num_jobs=args.jobs or (2 if args.cpu_smoke else 4))
    about = describe_machine(machine)
    rows, times = [], {}
    for name in (p for p in PARTS if p in parts):
        start = time.monotonic()
        rows += run_part(name, machine, args)
        times[name] = time.monotonic() - start
    table = markdown(rows, about, times)
    print("\n" + table, end="")
    machine.out.mkdir(parents=True, exist_ok=True)
    (machine.out / "gpu_check.md").write_text(table)
    ok = not any(r.verdict is Verdict.miss for r in rows)
    summary = {"ok": ok, "machine": about, "wall_s": times,
               "rows": [{"part": r.part, "checked": r.checked, "measured": r.measured, "limit": r.limit,
                         "result": r.verdict.value, "figures": r.figures} for r in rows]}
    (machine.out / "gpu_check.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
