"""Process groups (group.py: the environment, devices, a group's life) and the collectives over
them (collectives.py): the only place that reads torchrun's environment or touches a process
group. Import from the defining module: callers name `collectives.all_reduce`, and the
environment's names (`DistEnv`, `session`, ...) come from group.py."""
