"""The evidence tools: python -m tools.<name> from the repository root (tools/experiment.py, bench.py, ...)."""
