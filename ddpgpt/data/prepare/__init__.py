"""`ddpgpt prepare`'s pipeline: the command (main.py), its sources and settings, the units
encoded on worker processes, their assembly into shards, the resumable build, and where it
writes."""
