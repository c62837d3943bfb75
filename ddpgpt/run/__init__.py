"""A run's machinery: its directory (run_dir.py), where it starts (resume.py), what is resolved
before any process starts (preflight.py), precision (precision.py), launching (launch.py,
elastic.py), and its record (metrics.py, trackers.py)."""
