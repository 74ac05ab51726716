"""Who runs when and with which K: the worker and its queue, continuous batching, automatic K."""
