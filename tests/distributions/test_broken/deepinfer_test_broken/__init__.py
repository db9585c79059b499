"""Backends broken in every way the registry must isolate and explain."""
