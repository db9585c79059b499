# Enables the conformance suite: `pytest --deepinfer-backend=NAME` runs it against backend NAME.
pytest_plugins = ["deepinfer_conformance.plugin"]
