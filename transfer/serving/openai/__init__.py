"""The OpenAI-compatible HTTP front end (docs/http.md)."""
