"""The model: loading and memory planning, the trunk with its caches, the MTP head, conversion."""
