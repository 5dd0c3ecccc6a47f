"""Model storage: a model repository on a shared path or an object store, and the node cache in front of it."""
