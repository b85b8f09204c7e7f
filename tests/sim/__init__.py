"""The seeded interleaving harness: driver.py (the invariants and the rounds),
worker.py (a process running random operations), faults.py (delays, failures, kill -9),
check.py (the checks), content.py (what is put), backends.py (file, pg, s3); memtier.py
(the memory tier's own: a job on simulated nodes, nodes killed with their memory).
Run it with `python -m tests.sim --help`; tests/house/test_sim.py runs a short budget."""
