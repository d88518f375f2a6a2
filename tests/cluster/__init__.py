"""Cluster tier: real Slurm jobs on the one-machine cluster of ``slurm/local_cluster.sh`` (skip with instructions
without it; RP_REQUIRE_SLURM=1 turns the skip into a failure)."""
