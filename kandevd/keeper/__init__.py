"""The keeper: one long-lived process per home that starts, reaps and times every agent.

protocol.py (the wire to the daemon), journal.py (spawns and exits on disk),
agents.py (spawning, signalling, learning an exit), server.py (the process).
The daemon's side is :mod:`kandevd.runtime.keeperclient`.
"""
