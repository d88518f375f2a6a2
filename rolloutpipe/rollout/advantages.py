"""GRPO advantages of one group, from its own rewards only: pure Python.

A_i = r_i - mean(r), divided by the group's unbiased standard deviation (+ 1e-6, as torch.std) when
``normalize_std`` (Dr. GRPO turns it off); a group with one reward value gets zeros (trainer/grpo.py has the
loss). No statistic spans groups, so a group's advantages are final the moment it is complete (groups.py)
and do not depend on which other groups the step trains. The simulator runs this file compiled with mypyc
(sim/compiled.py), so it is fully typed.
"""

from __future__ import annotations

import math


def group_advantages(rewards: list[float], *, normalize_std: bool) -> list[float]:
    """GRPO advantages of one group from its own rewards only; a group with one reward value gets zeros."""
    mean = math.fsum(rewards) / len(rewards)
    centered = [r - mean for r in rewards]
    if normalize_std and len(rewards) > 1:
        std = math.sqrt(math.fsum([c * c for c in centered]) / (len(rewards) - 1))  # unbiased, as torch.std
        centered = [c / (std + 1e-6) for c in centered]
    return centered
