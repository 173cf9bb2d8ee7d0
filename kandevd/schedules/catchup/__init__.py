"""Fires besides the regular tick: a backfill over a past range (backfill.py) and the
occurrences no leader fired while leadership moved between daemons (late.py)."""
