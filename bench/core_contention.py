"""The machine's floor: how much slower each side computes when the other core computes too.

    python bench/core_contention.py --repeats 6

Two processes, each pinned to its own core with one torch thread, as the local launcher places the
rollout and the trainer: an engine-like loop (the tiny policy's forward over 32 rows, no grad) on the
first core and a trainer-like loop (forward + backward of one 200-token row) on the second. Phases
rotate (engine alone, both, trainer alone), ``--repeats`` times, so noise hits each phase alike. Each
loop's median wall and CPU (``time.thread_time``) per iteration is printed per phase: CPU time that
grows for the same work says the core itself got slower (shared caches, memory, the host), which no
scheduling of ours can remove; wall time above CPU time is time the process lost its core.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

KINDS = ("engine", "trainer")


def loop(kind: str, cpu: int, on, stop, out) -> None:
    import torch

    from rolloutpipe.config import ModelConfig
    from rolloutpipe.model import load_model

    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = load_model(ModelConfig(), vocab_size=256)
    if kind == "trainer":
        model.train()
    x = torch.randint(0, 200, (1, 200) if kind == "trainer" else (32, 96))
    samples = []
    while not stop.is_set():
        if not on.is_set():
            time.sleep(0.005)
            continue
        start, cpu_start = time.perf_counter(), time.thread_time()
        if kind == "trainer":
            model(input_ids=x).logits.float().logsumexp(-1).sum().backward()
        else:
            with torch.inference_mode():
                model(input_ids=x, logits_to_keep=1)
        samples.append((time.perf_counter(), time.perf_counter() - start, time.thread_time() - cpu_start))
    out.put((kind, samples))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--phase-s", type=float, default=2.5)
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    stop, out = mp.Event(), mp.Queue()
    on = {k: mp.Event() for k in KINDS}
    procs = [mp.Process(target=loop, args=(k, cpus[i % len(cpus)], on[k], stop, out)) for i, k in enumerate(KINDS)]
    for p in procs:
        p.start()
    time.sleep(8)  # both models built
    phases = []
    for _ in range(args.repeats):
        for state in (("engine",), ("engine", "trainer"), ("trainer",)):
            for k in KINDS:
                (on[k].set if k in state else on[k].clear)()
            start = time.perf_counter()
            time.sleep(args.phase_s)
            phases.append((state, start + 0.2, time.perf_counter()))
    stop.set()
    results = dict(out.get() for _ in KINDS)
    for p in procs:
        p.join()
    for kind in KINDS:
        cells = {}
        for label, want in (("alone", (kind,)), ("both", KINDS)):
            got = [s for state, a, b in phases if state == want for s in results[kind] if a <= s[0] <= b]
            cells[label] = (statistics.median(s[1] for s in got), statistics.median(s[2] for s in got), len(got))
        (aw, ac, an), (bw, bc, bn) = cells["alone"], cells["both"]
        print(f"{kind:7s} alone: {1e3 * aw:6.2f} ms wall {1e3 * ac:6.2f} ms CPU (n={an})   other core busy: "
              f"{1e3 * bw:6.2f} ms wall {1e3 * bc:6.2f} ms CPU (n={bn})   CPU {100 * (bc / ac - 1):+.1f}%")


if __name__ == "__main__":
    main()
