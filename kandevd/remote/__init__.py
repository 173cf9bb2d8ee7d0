"""A runner: a process on another machine that runs the executions a daemon's gateway
routes to it, with its own home, config, keeper and agent profiles (docs/runners.md)."""
