"""fot: Focused Transformer (LongLLaMA) memory attention.  See method.py."""

from lcx.hookspecs import hookimpl
from lcx.plugins.fot.method import FoT

__all__ = ["FoT"]


@hookimpl
def lcx_register_methods(register):
    register(FoT)
