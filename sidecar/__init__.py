"""llm-sidecar: an LLM inference engine and gRPC/OpenAI sidecar for Java and Spring services."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Each pulls in torch (LLM also transformers): imported only when asked for, so that the command
    # line starts without them.
    if name == "LLM":
        from sidecar.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from sidecar.engine.request import SamplingParams

        return SamplingParams
    if name == "BeamSearchParams":
        from sidecar.engine.beam_params import BeamSearchParams

        return BeamSearchParams
    raise AttributeError(f"module 'sidecar' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "__version__"]
