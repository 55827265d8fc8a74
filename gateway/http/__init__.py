"""HTTP/1.1 on both sides of the gateway: :mod:`.server` for clients, :mod:`.client` for miners, :mod:`.wire` shared."""
