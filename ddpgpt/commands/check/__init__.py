"""`ddpgpt check` (main.py): every path against its oracle on the hardware at hand. matrix.py
holds the rows, training.py runs the training rows, commands.py the commands as a user runs
them, report.py the table."""
