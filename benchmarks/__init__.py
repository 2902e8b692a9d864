"""Benchmarks of the product's own code paths; run them from the repository root as modules, e.g.
`.venv/bin/python -m benchmarks.detection`. They import the product and benchmarks.support, never tests/."""
