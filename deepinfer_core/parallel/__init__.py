"""Expert-parallel dispatch/combine over a communicator."""
