"""vLLM integration: the only package that imports vLLM internals."""
