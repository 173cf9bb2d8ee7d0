"""Events pushed to clients: the topics, the hub that buffers them per subscriber, the
feed from the daemon's bus, and the relay between daemons on one PostgreSQL database."""
