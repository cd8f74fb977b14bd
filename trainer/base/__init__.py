"""What every layer may use: the user-error type, the workdir as a folder or bucket, the config keys a config may set,
the dtype names."""
