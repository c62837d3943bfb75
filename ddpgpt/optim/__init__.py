"""Optimizers: parameter groups and torch's AdamW + Muon as one (optimizer.py), Muon by whole
matrices (muon.py), the lr and momentum of every step (schedule.py)."""
