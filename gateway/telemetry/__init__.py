"""Metrics and tracing. Every gateway metric is defined in ``metrics.py``."""
