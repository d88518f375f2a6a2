"""FIFO vs FGD admission on the real SGLang server, where its scheduler reorders requests.

    bash tests/sglang_cpu/install.sh .venv-sglang        # SGLang 0.5.23 on the CPU (test-only workaround)
    .venv-sglang/bin/python bench/sglang_fgd_bench.py [--repeats 2 --steps 4 --settings kv_pressure,request_limit]

Every run is the whole job in cgp mode (``launch.py rollout.engine=sglang``, the job starting its SGLang servers
with the CPU recipe of tests/sglang_real/test_sglang_real.py, but at full batch: no
``--max-running-requests 1``), on a tiny random-init Qwen3 whose responses are long-tailed (EOS with probability
~1/45 per token, up to ``--response-len``), 8 prompts x 4 samples a step in two training batches of 4 groups.
Settings, each where SGLang itself decides the order in which requests run:

    kv_pressure     one engine whose KV cache (--max-total-tokens 512) holds about a third of the step's tokens:
                    SGLang admits a request only when its reservation (prompt + 0.7 x max_new_tokens, the ratio
                    decaying while nothing is retracted) fits, so requests queue for memory
    retraction      the same, admitting on a reservation of 0.05 x max_new_tokens (SGLANG_INIT_NEW_TOKEN_RATIO): the
                    running requests outgrow the cache and SGLang retracts some (the one with the fewest generated
                    tokens first) back into the queue
    request_limit   one engine running at most 4 requests (--max-running-requests) of the step's 32
    two_engines     two engines, each running at most 4 requests

FIFO sends requests in group order and SGLang runs them first come first served; FGD sends the group index as each
request's priority (``--enable-priority-scheduling --schedule-low-priority-values-first``) so the queue is reordered
by it. Repeats are interleaved (fifo, fgd, fifo, ...); step 0 of each run is dropped (warm-up, compilation). Cells
are medians over the remaining steps of all repeats; ``vs fifo`` are ratios of medians from this one invocation.
``first_grp_s``: time from the step's start to its first trainable group; ``retracted``: the requests SGLang
retracted per run (from its log), the sign that KV pressure happened.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from pipeline_bench import aligned_table, run_one, wait_quiet  # noqa: E402

from tests import sglang_cpu  # noqa: E402  (the CPU recipe of the SGLang tier)

SETTINGS: dict[str, dict] = {
    "kv_pressure": {"engines": 1, "args": ["--max-total-tokens", "512", "--max-running-requests", "32"]},
    "retraction": {"engines": 1, "args": ["--max-total-tokens", "512", "--max-running-requests", "32"],
                   "environ": {"SGLANG_INIT_NEW_TOKEN_RATIO": "0.05", "SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR": "0.05"}},
    "request_limit": {"engines": 1, "args": ["--max-total-tokens", "8192", "--max-running-requests", "4"]},
    "two_engines": {"engines": 2, "args": ["--max-total-tokens", "8192", "--max-running-requests", "4"]},
}
ADMISSION = {"fifo": ["rollout.admission=fifo"], "fgd": ["rollout.admission=fgd"]}
COLUMNS = [("perf/first_group_s", "first_grp_s"), ("perf/rollout_to_train_end_s", "r2t_s"),
           ("perf/trainer_wait_ratio", "wait"), ("perf/rollout_s", "rollout_s")]
WORKLOAD = ["rollout_batch_size=8", "n_samples_per_prompt=4", "global_batch_size=16", "micro_batch_size=4",
            "pipeline.mode=cgp", "rollout.engine=sglang", "rollout.concurrency=32", "trainer.lr=1e-7",
            "rollout.sglang_deterministic_inference=false", "rollout.server_start_timeout_s=300",
            "pipeline.peer_timeout_s=60", "eval.interval=0"]


def save_model(directory: Path) -> Path:
    from rolloutpipe.model import ModelConfig, build_tiny_tokenizer, load_model, save_hf_checkpoint

    if not (directory / "config.json").exists():
        save_hf_checkpoint(load_model(ModelConfig(), len(build_tiny_tokenizer())), build_tiny_tokenizer(), directory)
    return directory


def retracted(run_dir: Path) -> int:
    total = 0
    for log in (run_dir / "engines").rglob("*.log"):
        total += sum(int(m) for m in re.findall(r"#retracted_reqs: (\d+)", log.read_text(errors="replace")))
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="RL steps per run (step 0 is dropped)")
    parser.add_argument("--response-len", type=int, default=160)
    parser.add_argument("--out", type=Path,
                        default=REPO / "bench" / "runs" / f"sglang-fgd-{time.strftime('%Y%m%d-%H%M%S')}")
    args = parser.parse_args()
    model_dir = save_model(args.out / "tiny-hf")
    rows = [["setting", "admission", *(short for _, short in COLUMNS), "retracted", "r2t range", "first_grp vs fifo",
             "r2t vs fifo", "wait vs fifo"]]
    for setting in args.settings.split(","):
        spec = SETTINGS[setting]
        records: dict[str, list[list[dict]]] = {a: [] for a in ADMISSION}
        num_retracted: dict[str, list[int]] = {a: [] for a in ADMISSION}
        for rep in range(args.repeats):
            for admission, extra in ADMISSION.items():
                run_dir = args.out / setting / f"{admission}-{rep}"
                overrides = [*WORKLOAD, f"model.path={model_dir}", f"num_rollout={args.steps}",
                             f"rollout_max_response_len={args.response_len}", f"rollout.num_engines={spec['engines']}",
                             f"rollout.sglang_launch_args=[{','.join([*sglang_cpu.LAUNCH_ARGS, *spec['args']])}]",
                             *extra]
                wait_quiet(0.25, 30.0)
                # the SGLang servers the job starts read them
                environ = {**os.environ, **sglang_cpu.environ(REPO), **spec.get("environ", {})}
                steps, foreign = run_one(run_dir, overrides, environ)
                records[admission].append(steps[1:])
                num_retracted[admission].append(retracted(run_dir))
                print(f"  {setting} {admission} repeat {rep}: done (other jobs used {foreign:.2f} cores, "
                      f"{num_retracted[admission][-1]} retracted)", file=sys.stderr, flush=True)
        med = {a: {key: statistics.median(r[key] for rep in recs for r in rep) for key, _ in COLUMNS}
               for a, recs in records.items()}
        for admission in ADMISSION:
            m, base = med[admission], med["fifo"]
            per_repeat = [statistics.median(r["perf/rollout_to_train_end_s"] for r in rep)
                          for rep in records[admission]]
            rows.append([setting, admission, *(f"{m[key]:.3f}" for key, _ in COLUMNS),
                         f"{statistics.median(num_retracted[admission]):.0f}",
                         f"{min(per_repeat):.2f}-{max(per_repeat):.2f}",
                         *(f"{100 * (m[key] / base[key] - 1):+.1f}%" for key in
                           ("perf/first_group_s", "perf/rollout_to_train_end_s", "perf/trainer_wait_ratio"))])
        print("\n".join(aligned_table(rows)), flush=True)
    table = "\n".join(aligned_table(rows))
    (args.out / "table.md").write_text(table + "\n")
    print(f"\n{table}\n\nruns and table in {args.out}")


if __name__ == "__main__":
    main()
