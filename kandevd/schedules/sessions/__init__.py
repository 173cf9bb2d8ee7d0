"""A fire's session: which sessions are in flight, one per job at most (runner.py), the
turns of one session and its history entry (session.py), and telling someone how it
ended (notify.py)."""
