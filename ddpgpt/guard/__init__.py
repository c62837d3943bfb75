"""What keeps a run's ranks together through trouble: stop signals and the health exchange
(health.py), loss spikes (spike.py), test-only fault injection (faults.py)."""
