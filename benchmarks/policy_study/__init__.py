"""The scheduling-policy study: offline replay of trace slices through real engines (``offline``), the
comparison of pla, fcfs and spf (``policies``), the same over many slices on a simulated clock
(``slices``), and exact bounds on SLO violations (``bounds``).

An experiment, not part of the runtime: ``benchmarks/policies.py``, ``benchmarks/policy_slices.py``,
``benchmarks/router_policies.py`` and ``benchmarks/sim_validation.py`` import it (a script's own folder
is on ``sys.path``), as do the tests under ``tests/benchmarks``.
"""
