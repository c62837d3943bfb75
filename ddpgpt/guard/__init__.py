"""What keeps a run's ranks together through trouble: stop signals and the health exchange
(health.py), loss spikes (spike.py), the run's verdict at its end (verdict.py), test-only fault
injection (faults.py)."""
