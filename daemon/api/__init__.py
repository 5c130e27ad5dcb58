"""The local HTTP API: `daemon.api.app.create_app(state)` builds the FastAPI app."""
