"""Several daemons on one PostgreSQL store: membership and the leader (membership.py),
the fence that stops a cut-off daemon's agents (fence.py) and its timings (timing.py).
The statements are :mod:`kandevd.store.cluster`'s."""
