"""Addresses: unix socket paths of any length (unixaddr.py), ``host:port`` listen
addresses (listen.py), and URLs with their secrets scrubbed for logs (urls.py)."""
