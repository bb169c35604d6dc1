"""Forwarding requests to a backend and streaming the answer back, with exact usage accounting."""
