"""A deliberately non-conformant backend for the conformance suite's own tests."""
