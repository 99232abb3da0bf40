"""The model: image and text in, tokens out. Knows nothing of sockets or metrics."""

from qvld.engine.engine import Engine
from qvld.engine.types import GenerateRequest, GenerateResult

__all__ = ["Engine", "GenerateRequest", "GenerateResult"]
