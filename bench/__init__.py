"""Benchmarks of acp-state, each figure beside a baseline measured in the same run."""
