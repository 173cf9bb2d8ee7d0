"""Product schedules: product.yaml and users.yaml, per-user state, the product's turns."""
