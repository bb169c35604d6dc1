"""HTTP handlers: the OpenAI routes (raw ASGI on the hot path), models, health, readiness, metrics."""
