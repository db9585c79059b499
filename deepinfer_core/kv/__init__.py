"""KV-cache layout interface: cache kinds, specs and slot ids."""
