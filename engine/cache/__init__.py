"""What the engine keeps across requests: the conversation (prefix) cache."""
