"""Fails at import, like a vendor plugin whose SDK is missing."""

import deepinfer_vendor_sdk_that_does_not_exist  # noqa: F401
