"""harness: proves a weight cache serves the right weights, or blocks it.

The public face is the gate: :func:`harness.gate.run_gate` (what
``preload-gate gate`` runs) and :func:`harness.report.write_reports`; the
case catalogue, engine runners and verdicts are submodules a user rarely
imports. Importing this package does not import vLLM.

>>> from harness.gate import GateOptions, run_gate  # doctest: +SKIP
>>> run_gate(GateOptions(candidate="/models/tiny", mutations="all")).exit_code  # doctest: +SKIP
0
"""
