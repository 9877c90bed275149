"""Tracing Python into tern IR."""
from .tracer import Tracer, Trace, apply, current_trace, user_location
from .trace import trace, spec, Spec
from .api import *  # noqa: F401,F403
from . import api
