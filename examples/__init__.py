"""Runnable examples of mpifl's plug-in contracts (mpifl.api), one package each.

Run them from the repository root, where ``examples.<name>.<module>:attr`` imports::

    PYTHONPATH=. mpiexec -n 3 mpifl run examples/<name>/config.yaml

(``python -m mpifl`` puts the current folder on the path by itself.) tests/test_examples.py runs each.
"""
