"""The admins' commands (``gpu-allocator``, ``gpu-ledger``) and what they read."""
