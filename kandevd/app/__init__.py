"""The daemon as a whole: its composition root (assemble.py) and its process (daemon.py)."""
