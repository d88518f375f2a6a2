"""The GPU check's parts (common.py: what they share): tools/gpu_check.py runs them and prints the table. A part is
a function of the machine that returns its rows; no part imports another."""
