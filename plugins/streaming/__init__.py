"""streaming: attention sinks + a recent window (StreamingLLM, Xiao et al. 2023).  See method.py; its form served
inside vLLM's attention is served.py."""

from lcx.hookspecs import hookimpl
from lcx.plugins.streaming.method import SinkWindowLayer, Streaming

__all__ = ["SinkWindowLayer", "Streaming"]


@hookimpl
def lcx_register_methods(register):
    register(Streaming)
