"""The pure placement rules (allocator/placement): policy, index, fair share, links."""
