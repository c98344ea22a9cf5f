"""Synchronous storage engines. Never imports trio; every entry point refuses the loop thread."""

from ._guard import LoopThreadError, refuses_loop_thread, register_loop_detector

__all__ = ["LoopThreadError", "refuses_loop_thread", "register_loop_detector"]
