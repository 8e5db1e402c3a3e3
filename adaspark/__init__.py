"""AdaSpark: adaptive DSpark tree speculative decoding that learns while it serves."""

__version__ = "0.1.0"
