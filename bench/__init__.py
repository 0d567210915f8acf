"""Benchmarks: scripts that print figures and ratios and record them under ``bench/results/``."""
