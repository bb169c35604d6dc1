"""KV-cache events from the engines that publish them (vLLM, SGLang), and prompts as their token ids."""
