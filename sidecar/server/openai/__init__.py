"""OpenAI-compatible HTTP transport (FastAPI) over the service layer."""
