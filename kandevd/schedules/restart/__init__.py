"""What a previous daemon left, settled at start: its scheduled turns still running,
adopted (adopted.py), the turns and entries a crash stranded (stranded.py), and when a
daemon last watched the root (alive.py)."""
