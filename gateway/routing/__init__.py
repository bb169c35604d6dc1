"""Routing: filters drop ineligible backends, weighted scorers rank the rest (scores in [0, 1]), one picker
orders them. Plugins are registered by name; a policy names the plugins and weights. This package imports
neither fastapi nor httpx."""
