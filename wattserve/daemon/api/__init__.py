"""The local HTTP API: `wattserve.daemon.api.app.create_app(state)` builds the FastAPI app."""
