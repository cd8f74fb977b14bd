"""Built-in models. Each names the logical axes of its parameters for parallel/sharding.py."""
