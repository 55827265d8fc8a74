"""The gateway's routes, one module a feature (as vLLM's OpenAI entrypoint keeps them): completions (the client
API's work), models (what is served now), operator (health, readiness, metrics, status). Each handler takes the
:class:`gateway.app.Gateway` it serves for; the gateway's table (:meth:`Gateway.routes`) binds them."""
