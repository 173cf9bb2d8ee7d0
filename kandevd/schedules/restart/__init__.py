"""What a previous daemon left, settled at start, entered in one place (repair.py):
its scheduled turns still running, adopted (adopted.py), the turns and entries a crash
stranded (stranded.py), and when a daemon last watched the root (alive.py)."""
