"""Helpers shared by the tests and the tools: tiny offline checkpoints, bounded waiting."""
