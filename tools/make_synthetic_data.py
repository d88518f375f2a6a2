"""Write the synthetic reversal task as jsonl in Slime's row format (the embedded default's data set).

    python tools/make_synthetic_data.py out.jsonl --num-rows 2048 --length 3 --alphabet-size 4 --seed 0

Runs generate it themselves into their run directory; this is for looking at it or reusing it as
``data.path=``. The same arguments always give the same bytes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rolloutpipe.rollout.tasks import ReversalTaskConfig, write_reversal_jsonl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--num-rows", type=int, default=2048)
    parser.add_argument("--length", type=int, default=3)
    parser.add_argument("--alphabet-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cfg = ReversalTaskConfig(num_rows=args.num_rows, length=args.length, alphabet_size=args.alphabet_size,
                             seed=args.seed)
    print(write_reversal_jsonl(cfg, args.out))


if __name__ == "__main__":
    main()
