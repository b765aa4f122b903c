"""Shared test setup: the evidence tools (tools/experiment.py, tools/bench.py, tools/plot.py) import as modules."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools"))
