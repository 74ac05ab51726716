"""One sequence's state, the speculative cycle over it, and the conversation cache of states."""
