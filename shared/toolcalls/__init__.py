"""Tool calls in model output: the syntaxes model families use (formats), parsing them, and streaming them."""
