"""``python -m bench.gpu_check``: everything a lent H100/H200 can tell us, in one command under 8 minutes.

Why one command: a GPU is lent to about one task in five, for 15 minutes, with no network. So the versions it ran
with, the CUDA tests (``pytest -m gpu``, tests/gpu/) and the measurements against the upstream classes in the same
run (``measure_*.py``) all come from one prepared script, each step with a time budget, each failure recorded
without stopping the others. ``--dry-run`` runs the same code paths at tiny sizes on CPU (a test of ``make test``),
so the script is known to work before a GPU is lent. See docs/performance.md, "GPU check".
"""
