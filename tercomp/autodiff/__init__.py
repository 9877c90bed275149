"""Symbolic reverse-mode autodiff over tern IR, in one place.

    ad.py     the reverse walk over ops (`backward`: seeds, zeros, cotangent names, saved
              values) and the transforms built on it: grad, value_and_grad, vjp, jvp,
              custom_vjp (whose op's VJP rule it installs into the registry)
    loops.py  the VJPs of the ops with a body, built with the reverse walk: tern.scan
              (a reverse scan over saved residuals) and tern.checkpoint (recompute)

Importing this package installs those rules; ops never import it.
"""
from .ad import (GradFn, backward, custom_vjp, grad, jvp, saved_for_backward, value_and_grad, vjp,
                 zeros_like)
from . import body_vjps  # noqa: F401  installs the VJPs of tern.scan and tern.checkpoint

__all__ = ["GradFn", "backward", "custom_vjp", "grad", "jvp", "saved_for_backward", "value_and_grad",
           "vjp", "zeros_like"]
