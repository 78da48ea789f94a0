"""extproc: request-level admission control for GPU inference behind Envoy."""

__version__ = "0.1.0"
