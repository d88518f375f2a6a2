"""Multiprocess tier: real processes of the job on this machine (``launch.py``, node processes, engine servers,
torch.distributed over gloo)."""
