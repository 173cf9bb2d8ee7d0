"""Products: agents with a chat surface, and the recurring jobs their product.yaml declares."""
