"""GPU tier: needs an NVIDIA GPU (skips cleanly without one); ``tools/gpu_check.py`` runs it on a device machine."""
