"""Fast paths for the operations the model and learner spend their memory on, each beside its
plain-JAX reference (the test oracle)."""
