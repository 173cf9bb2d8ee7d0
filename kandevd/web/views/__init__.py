"""One module per screen: each view reads through control methods and renders a template."""
