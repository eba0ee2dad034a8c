"""Soak, bad-input catalogue, load test and browser measurements (outside the library package)."""
