"""Choosing tokens: sampling as transformers orders it (``sampling``), response formats
as grammars (``constraints``), and one generation's token choice, stop rules, logprobs
and streamed text whatever computed its logits (``generation``). Imports only
``qvld.engine.model``."""
