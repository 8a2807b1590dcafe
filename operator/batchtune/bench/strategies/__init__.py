"""Tuning strategies under benchmark: ours (via batchtune.core) and the baselines."""
