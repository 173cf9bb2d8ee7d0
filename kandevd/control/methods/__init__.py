"""Control methods, one module per area; each exposes ``register(registry, services)``."""
