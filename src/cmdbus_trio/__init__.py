"""cmdbus-trio: a durable command bus, event bus and tier service on Trio."""

__version__ = "0.1.0"
