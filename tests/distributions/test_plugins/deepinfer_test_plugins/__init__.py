"""A general plugin: a logits processor, an observer and a model registration."""
