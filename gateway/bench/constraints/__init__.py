"""``gateway bench constraints --out DIR``: the gateway's own constraint validators against
llguidance (the constraint engine llama.cpp, vLLM, SGLang and TabbyAPI can use), on one corpus.

For every input (GBNF, xgrammar EBNF, Lark, regex, JSON schema; valid, invalid and adversarial) it measures
the validation time of each engine (median of repeats) and records its verdict. Every engine runs in its
own worker process (``--worker ENGINE``), so a segfault is recorded as a crash of that input and the worker
is replaced. ``ours`` is what a gateway worker process runs (``gateway.structured.checks.run_check``, with the
default limits); ``ours-unlimited`` the same with the size and rule limits lifted (adversarial inputs only:
what the parsers cost, not the limits). Where a real llama-server is cached (``gateway llamacpp build``), its
verdicts on the GBNF grammars and JSON schemas are recorded too: llama.cpp's own parser is the authority
there. Other verdicts are judged against ``expect`` (read from the engines' sources and docs) where known.
A short second part drives constrained sampling with llguidance and a byte-level tokenizer, against the
emulators' sampler. Writes ``constraints.json`` and ``constraints.png`` under ``--out``.

Modules: ``corpus`` (the inputs), ``engines`` (the validators, in worker processes), ``llama_oracle`` (a real
llama-server's verdicts), ``report`` (judging, summary, chart), ``sampling`` (the sampling part), ``cli`` (the
command and ``run``).
"""

from gateway.bench.constraints.cli import Options, main, run
from gateway.bench.constraints.corpus import Case, full_corpus, smoke_corpus

__all__ = ["Case", "Options", "full_corpus", "main", "run", "smoke_corpus"]
