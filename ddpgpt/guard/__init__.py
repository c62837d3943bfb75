"""What keeps a run's ranks together through trouble: stop signals and the health exchange
(health.py), loss spikes (spike.py), test-only fault injection (faults.py)."""

from ddpgpt.guard.health import (  # noqa: F401 -- the package's face
    EXIT_PREEMPTED,
    GRACE_S,
    SETTLE_S,
    STOP_SIGNALS,
    Guard,
    Health,
    Preempted,
    StopSignal,
    collective_failed,
    preempted,
    resume_hint,
)
