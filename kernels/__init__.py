"""Triton kernels of the lab, one per file; imported as ``labkit.kernels``."""
