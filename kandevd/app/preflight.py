"""What a config asks that this machine cannot give, found before the home is touched.

``serve`` refuses such a config with one line (exit 78) before it creates or locks
the home, and ``validate`` names the same problem (exit 1): the store's driver, and
the console's and the gateway's TLS certificate and key, read once here (the
daemon reads them again when it starts serving).
"""

from __future__ import annotations

from kandevd.app.gateway import GatewayTlsError, load_gateway_tls
from kandevd.app.webconsole import ConsoleTlsError, load_tls
from kandevd.config import Config
from kandevd.store.backend import backend_problem


def startup_problem(config: Config) -> str | None:
    """Why ``serve`` cannot start with ``config`` here; None when it can."""
    problem = backend_problem(config)
    if problem is not None:
        return problem
    try:
        if config.web.address is not None:
            load_tls(config)
        if config.gateway.address is not None:
            load_gateway_tls(config)
    except (ConsoleTlsError, GatewayTlsError) as exc:
        return str(exc)
    return None
