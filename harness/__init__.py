"""A NoETL-shaped deployment run on this machine, in processes over real sockets, and the
judge of what it saw: the system tests (``tests/system/``) and
``benchmarks/workload.py`` both run it, so neither imports the other."""
