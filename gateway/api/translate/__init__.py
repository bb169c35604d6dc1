"""Agent APIs over chat completions: OpenAI Responses and Anthropic Messages requests translated to chat
completions for engines that do not serve them natively, and the answers (and every stream event) back.

Pure functions and small stateful stream translators: no I/O, no framework. The endpoint picks native
pass-through or translation per backend (``EngineSpec.routes``)."""
