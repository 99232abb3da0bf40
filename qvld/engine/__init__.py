"""The engine: a request's pictures, clips and text in, tokens out, every generation
in one step loop (``loop/``) whatever runtime runs the model (``model/``). Knows nothing
of sockets or metrics; the fronts use only ``Engine``'s face (docs/ARCHITECTURE.md)."""

from qvld.engine.engine import Engine
from qvld.engine.types import GenerateRequest, GenerateResult

__all__ = ["Engine", "GenerateRequest", "GenerateResult"]
