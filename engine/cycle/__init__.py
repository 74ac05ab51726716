"""One sequence's state and the speculative cycle over it."""
