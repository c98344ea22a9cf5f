"""The control plane: the HTTP control face (``/livez`` ``/readyz`` ``/healthz``
``/metrics``, and NoETL's lag ports) and the in-memory health it reads.

It reads the writer's state, never writes it: its handlers await no data-plane lock,
limiter or store (tests/test_layering.py).
"""

from .face import ControlApp, LagPortApp, serve, serve_lag_port
from .health import FaceState, Health

__all__ = ["ControlApp", "FaceState", "Health", "LagPortApp", "serve", "serve_lag_port"]
