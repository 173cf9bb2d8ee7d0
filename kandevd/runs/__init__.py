"""The run vocabulary: what a run is, its statuses and errors, and the retry policy (no I/O)."""
