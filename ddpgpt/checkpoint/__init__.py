"""Checkpoints: the store (store.py: layout, atomic publication, prune), reading them back and a
run's model (read.py), each rank's share through torch.distributed.checkpoint (sharded.py) and
saving in the background (saver.py)."""
