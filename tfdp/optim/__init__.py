"""Optimisation: optimizers, learning-rate schedules and losses, each a registry from config names."""
