"""The OpenAI-compatible HTTP endpoint: a FastAPI app in front of any `EngineClient`."""
