"""Backends, their health and load state, and the loop that keeps that state fresh."""
