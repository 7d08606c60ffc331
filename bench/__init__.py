"""Benchmarks: scripts that print figures next to a floor measured in the same run."""
