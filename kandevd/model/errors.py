"""The workspace model's errors; each message is meant for the caller."""

from __future__ import annotations


class ModelError(Exception):
    """Base of the model's errors; the message is meant for the caller."""


class NotFoundError(ModelError, LookupError):
    """The object the request names (its ``id``) does not exist."""


class ConflictError(ModelError):
    """The object cannot be created as asked (e.g. its id is taken)."""


class InvalidReference(ModelError, ValueError):
    """A field refers to something that does not exist or does not fit; names the field."""


class LaunchRefused(ModelError):
    """The runtime cannot start the launch now (full, or the agent is paused)."""
