"""Which module's backward is wrong: activation probes and a search along the modules the loss runs."""
