"""What the tests share: real daemons (daemon.py), stores (stores.py), workflow files,
an Office environment, run and runtime helpers, and the agent scripts tests run."""
