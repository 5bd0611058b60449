"""Benchmarks (`glm5-hal bench`). Benchmarks measure; tests never assert on timings."""
