"""Model tooling: the embedded tiny model, miniatures of real families, model and stack checks."""
