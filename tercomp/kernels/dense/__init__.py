"""dense kernels (see tercomp/kernels/__init__.py)."""
