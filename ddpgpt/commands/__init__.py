"""The commands: one module per verb (train, eval, sample, export, plot, bench, doctor,
rendezvous) and the check/ package, each with `run(cfg)`; `cli.py`'s COMMANDS points here.
Nothing below the commands imports them."""
