"""kandevd: a daemon that schedules autonomous AI-agent work reliably."""

__version__ = "0.1.0"
