"""llm-sidecar: an LLM inference engine and gRPC/OpenAI sidecar for Java and Spring services."""
from sidecar.engine.request import SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and transformers; import it only when asked for.
    if name == "LLM":
        from sidecar.engine.engine import LLM

        return LLM
    raise AttributeError(f"module 'sidecar' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "__version__"]
