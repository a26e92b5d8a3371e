"""OpenAI-compatible HTTP server (FastAPI) in front of the engine."""
