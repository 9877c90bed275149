"""rows kernels (see tercomp/kernels/__init__.py)."""
