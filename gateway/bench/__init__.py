"""Load generation, side-by-side comparison, overhead benchmark and engine profiling."""
