"""The admins' commands and settings: gpu-ledger, gpu-allocator, help, secrets."""
