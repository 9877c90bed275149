"""tercomp's version: a leaf that imports nothing, so any module may import it."""
__version__ = "0.1.0"
