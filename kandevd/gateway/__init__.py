"""The gateway: the daemon's HTTP+JSON door for runners on other machines (docs/runners.md)."""
